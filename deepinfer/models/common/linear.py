"""Linear weights held as the checkpoint stores them: plain, or FP8 / FP4 codes with block scales.

A ``QuantPlan`` says, per weight role (``attn.wq_a``, ``ffn.experts``, ...;
the same in every layer), whether it stays quantized and how. It comes from
the checkpoint's headers when loading (``from_checkpoint``: whatever carries
codes and a block-scale companion) or from ``config.json`` alone
(``from_config``: the release's layout, for sizing without a download).
Roles the plan does not list are plain in the model dtype; the loader
dequantizes a quantized tensor into a plain parameter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from deepinfer_interfaces import Kernels, QuantizedWeight
from deepinfer_interfaces.quant import grid_shape

from ...errors import CheckpointError
from .config import ModelConfig
from .params import ParamTree

#: the weight roles of one layer that the release quantizes to FP8 (routed experts follow ``expert_dtype``)
FP8_ROLES = (
    "attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
    "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "engram.wkv",
)
EXPERTS = "ffn.experts"
#: DeepSeek's FP4 experts: one scale per 32 columns of a row
FP4_BLOCK = (1, 32)
#: a checkpoint name of a layer's weight or block scale: (layer, role path, leaf)
_LAYER_PARAM = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|scale)$")
_EXPERT_ROLE = re.compile(r"^ffn\.experts\.(\d+)\.w[123]$")


def role_of(name: str) -> str | None:
    """The weight role of a layer's weight or scale named ``name`` (every routed expert is ``ffn.experts``);
    None for anything else."""
    m = _LAYER_PARAM.match(name)
    if m is None:
        return None
    return EXPERTS if _EXPERT_ROLE.match(m.group(2)) else m.group(2)


def expert_of(name: str) -> tuple[int, int] | None:
    """``(layer, expert)`` of a routed expert's weight or scale named ``name``; None for anything else."""
    m = _LAYER_PARAM.match(name)
    e = _EXPERT_ROLE.match(m.group(2)) if m is not None else None
    return None if e is None else (int(m.group(1)), int(e.group(1)))


@dataclass(frozen=True)
class Storage:
    """How a role's weights are held: ``fmt`` None is plain in the model dtype."""

    fmt: str | None = None
    block: tuple[int, int] = (128, 128)
    #: ``uint8`` UE8M0 exponent bytes, or ``float32`` scales
    scale_dtype: torch.dtype = torch.uint8

    @property
    def quantized(self) -> bool:
        return self.fmt is not None


PLAIN = Storage()


@dataclass
class QuantPlan:
    """The storage of each quantized role; every other role is plain."""

    roles: dict[str, Storage] = field(default_factory=dict)

    def storage(self, role: str) -> Storage:
        return self.roles.get(role, PLAIN)

    @classmethod
    def from_config(cls, config: ModelConfig, stored: set[str] | None = None) -> "QuantPlan":
        """The layout DeepSeek's release uses for a ``config.json`` with ``quantization_config``;
        with ``stored`` (the model names a checkpoint index lists), only roles stored with block scales."""
        q = config.quantization
        if q is None:
            return cls()
        scale = torch.uint8 if q.scale_fmt == "ue8m0" else torch.float32
        fp8 = Storage("e4m3", tuple(q.weight_block_size), scale)
        roles = {role: fp8 for role in FP8_ROLES}
        if q.expert_dtype == "fp4":
            roles[EXPERTS] = Storage("e2m1", FP4_BLOCK, torch.uint8)
        elif q.expert_dtype == "fp8":
            roles[EXPERTS] = fp8
        if stored is not None:
            scaled = {role_of(n) for n in stored if n.endswith(".scale")}
            roles = {role: s for role, s in roles.items() if role in scaled}
        return cls(roles)

    @classmethod
    def from_checkpoint(cls, catalog: dict, block: tuple[int, int]) -> "QuantPlan":
        """Quantized wherever the checkpoint stores codes with a block-scale companion (``catalog``: model
        name -> ``TensorEntry``); one storage per role across layers, or a ``CheckpointError``."""
        roles: dict[str, tuple[Storage, str]] = {}
        for name, entry in catalog.items():
            role = role_of(name) if name.endswith(".weight") else None
            if role is None:
                continue
            fmt = _code_format(entry.dtype)
            scale = catalog.get(name[: -len("weight")] + "scale")
            if fmt is None or scale is None:
                continue
            logical = (*entry.shape[:-1], entry.shape[-1] * (2 if fmt == "e2m1" else 1))
            tile = block if fmt == "e4m3" else FP4_BLOCK
            if tuple(scale.shape) != grid_shape(logical, tile):
                continue  # held as the role's other weights are; the loader names a scale that does not fit
            scale_dtype = torch.float32 if scale.dtype.is_floating_point and scale.dtype != torch.float8_e8m0fnu else torch.uint8
            storage = Storage(fmt, tile, scale_dtype)
            seen = roles.setdefault(role, (storage, entry.name))
            if seen[0] != storage:
                raise CheckpointError(
                    f"checkpoint tensors {seen[1]!r} and {entry.name!r} store {role} differently ({seen[0]} and {storage}); "
                    "deepinfer keeps one storage per weight role: re-export the checkpoint with one quantization"
                )
        return cls({role: s for role, (s, _) in roles.items()})


def _code_format(dtype: torch.dtype) -> str | None:
    if dtype == torch.float8_e4m3fn:
        return "e4m3"
    if dtype in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        return "e2m1"
    return None


def quantized_param(tree: ParamTree, name: str, shape: tuple[int, ...], storage: Storage) -> QuantizedWeight:
    """Codes ``name.weight`` and scales ``name.scale`` (checkpoint keys) of a logical ``shape`` weight."""
    *lead, n, k = shape
    if storage.fmt == "e2m1":
        if k % 2:
            raise CheckpointError(f"{name}: an FP4 weight packs values in pairs but has {k} columns")
        codes = tree.param(f"{name}.weight", (*lead, n, k // 2), torch.uint8)
    else:
        codes = tree.param(f"{name}.weight", (*lead, n, k), torch.float8_e4m3fn)
    scales = tree.param(f"{name}.scale", grid_shape(shape, storage.block), storage.scale_dtype)
    return QuantizedWeight(codes, scales, storage.block, storage.fmt)


def linear_param(tree: ParamTree, name: str, out_features: int, in_features: int, dtype: torch.dtype, storage: Storage):
    """A linear weight ``[out, in]`` under key ``name``: a plain tensor, or a ``QuantizedWeight``."""
    if storage.quantized:
        return quantized_param(tree, name, (out_features, in_features), storage)
    return tree.param(f"{name}.weight", (out_features, in_features), dtype)


def linear(k: Kernels, x: torch.Tensor, weight) -> torch.Tensor:
    """``x @ weightᵀ`` for either storage, through the kernels (so batch-invariant mode reaches it)."""
    if isinstance(weight, QuantizedWeight):
        return k.fp8_linear(x, weight)
    return k.linear(x, weight)


def weight_bytes(weight) -> int:
    """Bytes a linear weight holds, in either storage."""
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes()
    return weight.numel() * weight.element_size()


@dataclass(frozen=True)
class ProjectionPart:
    """One linear map of a shared input: the tree and key its weight loads under, its rows, its storage."""

    tree: ParamTree
    name: str
    out_features: int
    storage: Storage = PLAIN


class FusedProjection:
    """Linear maps of one input run as few matmuls as their storage allows.

    Consecutive parts with the same storage share one weight (``[Σ out, in]``,
    or one ``QuantizedWeight`` whose codes and scales stack along the rows)
    whose row blocks are exposed, as views, under each part's own checkpoint
    key. A quantized part whose rows do not fill whole blocks ends its group.
    """

    def __init__(self, in_features: int, parts: list[ProjectionPart], dtype: torch.dtype, device) -> None:
        self.sizes = [p.out_features for p in parts]
        groups: list[list[ProjectionPart]] = []
        for part in parts:
            last = groups[-1] if groups else None
            joins = last is not None and last[-1].storage == part.storage
            if joins and part.storage.quantized:
                joins = last[-1].out_features % part.storage.block[0] == 0
            if joins:
                last.append(part)
            else:
                groups.append([part])
        self.weights = [self._group(in_features, g, dtype, device) for g in groups]
        self.group_sizes = [[p.out_features for p in g] for g in groups]
        #: each part's weight (a view of its group's), in order
        self.parts = []
        for weight, group in zip(self.weights, groups):
            at = 0
            for part in group:
                self.parts.append(_rows(weight, at, at + part.out_features))
                at += part.out_features

    @staticmethod
    def _group(in_features: int, group: list[ProjectionPart], dtype: torch.dtype, device):
        total = sum(p.out_features for p in group)
        storage = group[0].storage
        owner = ParamTree(device)
        weight = linear_param(owner, "fused", total, in_features, dtype, storage)
        at = 0
        for part in group:
            view = _rows(weight, at, at + part.out_features)
            if isinstance(view, QuantizedWeight):
                part.tree.alias(f"{part.name}.weight", view.codes)
                part.tree.alias(f"{part.name}.scale", view.scales)
            else:
                part.tree.alias(f"{part.name}.weight", view)
            at += part.out_features
        return weight

    def __call__(self, k: Kernels, x: torch.Tensor) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for weight, sizes in zip(self.weights, self.group_sizes):
            y = linear(k, x, weight)
            out.extend(y.split(sizes, dim=-1) if len(sizes) > 1 else [y])
        return out


def _rows(weight, start: int, stop: int):
    return weight.rows(start, stop) if isinstance(weight, QuantizedWeight) else weight[start:stop]

"""The memory a checkpoint's weights will take, from ``config.json`` (and the index) alone.

The family's model (and its DSpark draft, when the config declares one with a
known stage count) is built on the meta device with the storage the checkpoint
uses (``QuantPlan.from_config``: the release's FP8 linears and FP4/FP8
experts, narrowed to the weights the index lists a block scale for), so the
figures are the engine's own parameter bytes, not an estimate. They come in
parts placed differently: the backbone (routed experts split by expert
parallelism), tables a family keeps on every rank (V4.1's Engram n-gram
tables) and the draft (its routed experts split the same way). Nothing is
downloaded or read beyond those two files (the shards' headers when there is no
index): what a user checks before fetching hundreds of GB.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import ConfigError
from .loader.files import model_directory, read_config, read_json
from .loader.names import model_name
from .loader.safetensors_reader import INDEX_FILE, open_shard
from .models.common.causal_lm import CausalLM
from .models.common.dspark import DSparkConfig, DSparkDraft
from .models.common.linear import EXPERTS, QuantPlan, role_of
from .models.registry import family_of, parse_config

#: the linears the checkpoint quantizes (held dequantized with ``quantization="dequantize"``), routed experts, the rest
KINDS = ("quantized linears", "experts", "rest")
#: the draft's own projection, quantized as the stages' linears are
DRAFT_ROLES = ("main_proj",)
#: a draft stage's tensor, named as a layer's for its role
_STAGE = re.compile(r"^mtp\.(\d+)\.")


@dataclass(frozen=True)
class PartMemory:
    """Bytes of one part of the weights, and of its share on the fullest expert-parallel rank."""

    total_bytes: int
    per_rank_bytes: int
    #: the routed experts' share of ``total_bytes`` (what expert parallelism splits)
    routed_expert_bytes: int
    by_kind: dict[str, int]


@dataclass(frozen=True)
class WeightMemory:
    """Bytes of a checkpoint's weights, by part (``backbone``, a family's replicated tables, ``draft``)."""

    parts: dict[str, PartMemory]
    ep: int
    dtype: str
    quantization: str
    #: one routed expert of the backbone (its weights with their scales)
    bytes_per_routed_expert: int
    #: ``metadata.total_size`` of the index (every stored tensor), when there is one
    checkpoint_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return sum(p.total_bytes for p in self.parts.values())

    @property
    def per_rank_bytes(self) -> int:
        return sum(p.per_rank_bytes for p in self.parts.values())

    @property
    def by_kind(self) -> dict[str, int]:
        return {kind: sum(p.by_kind[kind] for p in self.parts.values()) for kind in KINDS}

    def as_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "per_rank_bytes": self.per_rank_bytes, "by_kind": self.by_kind}


def largest_rank_bytes(total: int, expert_bytes: int, n_experts: int, ep: int) -> int:
    """Bytes on the fullest of ``ep`` ranks: ``n_experts`` routed experts split as evenly as they go, the rest replicated."""
    return total - expert_bytes + round(expert_bytes / n_experts * -(-n_experts // ep))


def _index(directory: Path) -> tuple[list[str] | None, int | None]:
    """The tensor names the index lists (as stored), and its total size; without an index, the names the
    shards' headers list (no size), or (None, None) when there are no shards either."""
    path = directory / INDEX_FILE
    if not path.is_file():
        shards = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
        if not shards:
            return None, None
        names: list[str] = []
        for shard in shards:
            with open_shard(shard) as f:
                names.extend(f.keys())
        return names, None
    index = read_json(path, "checkpoint index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    names = list(weight_map) if isinstance(weight_map, dict) else None
    meta = index.get("metadata") if isinstance(index, dict) else None
    total = meta.get("total_size") if isinstance(meta, dict) else None
    return names, int(total) if isinstance(total, (int, float)) else None


def _part(params: dict[str, torch.Tensor], stored: QuantPlan, n_experts: int, ep: int) -> PartMemory:
    by_kind = dict.fromkeys(KINDS, 0)
    for name, p in params.items():
        role = role_of(_STAGE.sub(r"model.layers.\1.", name))
        kind = "experts" if role == EXPERTS else "quantized linears" if role and stored.storage(role).quantized else "rest"
        by_kind[kind] += p.numel() * p.element_size()
    total = sum(by_kind.values())
    routed = by_kind["experts"]
    per_rank = largest_rank_bytes(total, routed, n_experts, ep) if routed else total
    return PartMemory(total, per_rank, routed, by_kind)


def weight_memory(
    model_dir: str | Path, ep: int = 1, dtype: torch.dtype = torch.bfloat16, quantization: str = "auto"
) -> WeightMemory:
    """Weight bytes of ``model_dir``'s model held in ``dtype`` (quantized where ``quantization="auto"``)."""
    from deepinfer_interfaces import Kernels

    directory = model_directory(model_dir)
    raw = read_config(directory)
    config = parse_config(raw)
    model_class: type[CausalLM] = family_of(raw).model_class
    if quantization not in ("auto", "dequantize"):
        raise ConfigError(f"quantization {quantization!r} is not one of 'auto', 'dequantize'")
    if not 1 <= ep <= config.n_routed_experts:
        raise ConfigError(f"--ep {ep} must be between 1 and the model's {config.n_routed_experts} routed experts")
    names, checkpoint_bytes = _index(directory)
    model_names = {model_name(n) for n in names} if names is not None else None
    if model_names is not None and not any(role_of(n) for n in model_names):
        model_names = None  # an index naming no layer tensor says nothing of how the layers are stored
    stored = QuantPlan.from_config(config, model_names)  # what the checkpoint quantizes: it names the kinds either way
    plan = stored if quantization == "auto" else QuantPlan()
    model = model_class(config, Kernels(), dtype=dtype, device="meta", plan=plan, **model_class.inventory_kwargs(quantization == "auto"))
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in model.named_parameters().items():
        grouped.setdefault(model.inventory_part(name), {})[name] = p
    parts = {part: _part(params, stored, config.n_routed_experts, ep) for part, params in grouped.items()}
    draft = _draft(model, raw, names, plan)
    if draft is not None:
        parts["draft"] = _part(draft.named_parameters(), stored, len(draft.stages[0].ffn.slots), ep)
    expert = parts["backbone"].routed_expert_bytes // (config.num_hidden_layers * config.n_routed_experts)
    return WeightMemory(parts, ep, str(dtype).removeprefix("torch."), quantization, expert, checkpoint_bytes)


def _draft(model: CausalLM, raw: dict, names: list[str] | None, plan: QuantPlan) -> DSparkDraft | None:
    """The draft on the meta device when the config declares one whose stage count is known (from the
    config or the index's ``mtp.{i}`` names); its linears stored as the backbone's, ``main_proj`` with them."""
    if type(model).draft_class is None:
        return None
    cfg = DSparkConfig.from_hf(raw, model.config, [n for n in names if n.startswith("mtp.")] if names is not None else None)
    if cfg is None or not cfg.dspark_num_stages:
        return None
    fp8 = next((s for s in plan.roles.values() if s.fmt == "e4m3"), None)
    roles = {**plan.roles, **({role: fp8 for role in DRAFT_ROLES} if fp8 is not None else {})}
    return type(model).draft_class(model, cfg, QuantPlan(roles))

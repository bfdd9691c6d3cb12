"""The memory a checkpoint's weights will take, from ``config.json`` (and the index) alone.

The model is built on the meta device with the storage the checkpoint uses
(``QuantPlan.from_config``: the release's FP8 linears and FP4/FP8 experts,
narrowed to the weights the index lists a block scale for), so the figures are
the engine's own parameter bytes, not an estimate. Nothing is downloaded or read
beyond those two files: what a user checks before fetching 160 GB.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import ConfigError
from .loader.files import model_directory, read_config, read_json
from .loader.safetensors_reader import INDEX_FILE
from .loader.names import model_name
from .model.config import ModelConfig
from .model.linear import EXPERTS, QuantPlan, role_of

#: the linears the checkpoint quantizes (held dequantized with ``quantization="dequantize"``), routed experts, the rest
KINDS = ("quantized linears", "experts", "rest")


@dataclass(frozen=True)
class WeightMemory:
    """Bytes of the main model's weights (the ``mtp.*`` draft layers are not counted)."""

    total_bytes: int
    #: the largest rank at ``ep``-way expert parallelism: every routed-expert stack split, the rest replicated
    per_rank_bytes: int
    by_kind: dict[str, int]
    ep: int
    dtype: str
    quantization: str
    #: ``metadata.total_size`` of the index (every stored tensor, draft layers included), when there is one
    checkpoint_bytes: int | None

    def as_dict(self) -> dict:
        return asdict(self)


def largest_rank_bytes(total: int, expert_bytes: int, n_experts: int, ep: int) -> int:
    """Bytes on the fullest of ``ep`` ranks: ``n_experts`` routed experts split as evenly as they go, the rest replicated."""
    return total - expert_bytes + round(expert_bytes / n_experts * -(-n_experts // ep))


def _stored_names(directory: Path) -> tuple[set[str] | None, int | None]:
    """Model names of the tensors the index lists, and its total size; (None, None) without an index."""
    path = directory / INDEX_FILE
    if not path.is_file():
        return None, None
    index = read_json(path, "checkpoint index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    names = {model_name(n) for n in weight_map} if isinstance(weight_map, dict) else None
    meta = index.get("metadata") if isinstance(index, dict) else None
    total = meta.get("total_size") if isinstance(meta, dict) else None
    return names, int(total) if isinstance(total, (int, float)) else None


def weight_memory(
    model_dir: str | Path, ep: int = 1, dtype: torch.dtype = torch.bfloat16, quantization: str = "auto"
) -> WeightMemory:
    """Weight bytes of ``model_dir``'s model held in ``dtype`` (quantized where ``quantization="auto"``)."""
    from deepinfer_interfaces import Kernels

    from .model.model import DeepseekV4Model

    directory = model_directory(model_dir)
    config = ModelConfig.from_hf(read_config(directory))
    if quantization not in ("auto", "dequantize"):
        raise ConfigError(f"quantization {quantization!r} is not one of 'auto', 'dequantize'")
    if not 1 <= ep <= config.n_routed_experts:
        raise ConfigError(f"--ep {ep} must be between 1 and the model's {config.n_routed_experts} routed experts")
    names, checkpoint_bytes = _stored_names(directory)
    stored = QuantPlan.from_config(config, names)  # what the checkpoint quantizes: it names the kinds either way
    plan = stored if quantization == "auto" else QuantPlan()
    model = DeepseekV4Model(config, Kernels(), dtype=dtype, device="meta", plan=plan)
    by_kind = dict.fromkeys(KINDS, 0)
    for name, p in model.named_parameters().items():
        role = role_of(name)
        kind = "experts" if role == EXPERTS else "quantized linears" if role and stored.storage(role).quantized else "rest"
        by_kind[kind] += p.numel() * p.element_size()
    total = sum(by_kind.values())
    per_rank = largest_rank_bytes(total, by_kind["experts"], config.n_routed_experts, ep)
    return WeightMemory(total, per_rank, by_kind, ep, str(dtype).removeprefix("torch."), quantization, checkpoint_bytes)

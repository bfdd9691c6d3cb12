"""The KV cache's bytes per token of a model, from its config alone, as the engine's planner counts them.

``deepinfer inspect`` reports them beside the weights: the compressed state one
more token of context costs (entries and indexer keys, per cache kind and in
total) for a ``kv_cache_dtype``, and, apart, the sliding-window rows every
sequence keeps whatever its length (bytes per row and per sequence slot, the
ring sized for the engine's default step). The figures are the
``CacheGeometry`` numbers the planner splits the budget by, so they are the
bytes the pools hold.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .config import EngineConfig
from .models.common.cache_spec import CacheGeometry, block_size_for
from .models.common.config import ModelConfig


def default_step_tokens() -> int:
    """Tokens one sequence brings to a step under the engine's defaults (what its rings are sized for)."""
    fields = EngineConfig.model_fields
    return min(fields["max_num_batched_tokens"].default, fields["max_prefill_chunk"].default)


@dataclass(frozen=True)
class WindowMemory:
    """The sliding-window rows a sequence keeps whatever its length."""

    #: bytes one window row (one token position) holds, per cache kind (every layer of the kind together)
    bytes_per_row_by_kind: dict[str, int]
    #: ring rows per layer and sequence slot: the window, plus room for one step's tokens
    rows_per_slot: int
    #: every layer's ring of one sequence slot
    bytes_per_slot: int
    #: the step size the rings are sized for
    step_tokens: int

    @property
    def bytes_per_row(self) -> int:
        return sum(self.bytes_per_row_by_kind.values())


@dataclass(frozen=True)
class KVMemory:
    """Cache bytes of one model for one ``kv_cache_dtype``."""

    #: what was asked for, what it resolved to (``model`` or the packed records' name), and the formats in words
    kv_cache_dtype: str
    formats: str
    storage: str
    #: the model dtype plain rows are held in
    dtype: str
    block_size: int
    #: compressed-state bytes per token of context, in total and per cache kind
    total: float
    by_kind: dict[str, float]
    window: WindowMemory
    #: every ring of one sequence slot: window rows, compressor states, the Engram token history
    ring_bytes_per_slot: int

    def as_dict(self) -> dict:
        return {**asdict(self), "window": {**asdict(self.window), "bytes_per_row": self.window.bytes_per_row}}


def kv_memory(config: ModelConfig, kv_cache_dtype: str = "auto", dtype: torch.dtype = torch.bfloat16, step_tokens: int | None = None) -> KVMemory:
    """The cache bytes of ``config``'s model stored as ``kv_cache_dtype`` (plain rows in ``dtype``), block size 16
    rounded up to the compress ratios, rings for steps of ``step_tokens`` (the engine's default when None)."""
    step = step_tokens or default_step_tokens()
    geometry = CacheGeometry.build(config, block_size_for(config, 16), step, config.max_position_embeddings, kv_cache_dtype)
    per_row: dict[str, int] = {}
    for lt in geometry.layer_types:
        per_row[lt] = per_row.get(lt, 0) + geometry.window_row_bytes(geometry.specs[lt], dtype)
    window = WindowMemory(per_row, geometry.window_rows, geometry.window_bytes_per_slot(dtype), geometry.max_step_tokens)
    f = geometry.formats
    return KVMemory(
        kv_cache_dtype, f.name, f.describe(), str(dtype).removeprefix("torch."), geometry.block_size,
        geometry.bytes_per_token(dtype), geometry.bytes_per_token_by_kind(dtype), window, geometry.bytes_per_slot(dtype),
    )

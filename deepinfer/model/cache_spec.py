"""The cache's geometry as data: one spec per attention layer type, read by the cache and the memory planner.

Two storage kinds per layer (see ``cache.py``): per-sequence rings, sized for
one step of at most ``max_step_tokens`` tokens beyond what the layer must still
read, and token blocks holding compressed entries (and indexer keys). The
formulas live here once; pools are allocated from these numbers and the
planner's budget is their sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import CSA, SLIDING, ModelConfig


def block_size_for(config: ModelConfig, requested: int) -> int:
    """The smallest multiple of ``requested`` that every compress ratio divides."""
    ratios = [config.compress_ratio(t) for t in set(config.layer_types) if t != SLIDING]
    lcm = math.lcm(*ratios) if ratios else 1
    return lcm * math.ceil(requested / lcm) if requested % lcm else requested


@dataclass(frozen=True)
class LayerCacheSpec:
    """What one layer of a given attention type keeps, in rows of its pools."""

    layer_type: str
    #: tokens per compressed entry (0: the layer keeps only its sliding window)
    ratio: int
    head_dim: int
    #: indexer key width (compressed sparse attention only, else 0)
    index_head_dim: int
    #: sliding-window K=V ring rows per sequence slot
    window_rows: int
    #: compressor-state ring rows per sequence slot (0 without a compressor)
    state_rows: int
    #: width of the compressor's kv and gate projections (doubled by the overlapping windows of CSA)
    state_width: int
    #: width of the indexer compressor's kv and gate projections (CSA only, else 0)
    index_state_width: int
    #: compressed entries per token block
    entries_per_block: int

    @property
    def compressed(self) -> bool:
        return self.ratio > 0

    @property
    def overlap(self) -> bool:
        """Whether each entry also pools the previous window (compressed sparse attention)."""
        return self.layer_type == CSA

    @property
    def rows_per_block(self) -> int:
        """kv-pool rows (and index-pool rows, for CSA) one token block adds."""
        return self.entries_per_block

    def slot_elements(self) -> int:
        """Elements one sequence slot's rings hold across this layer's pools."""
        states = 2 * self.state_rows * (self.state_width + self.index_state_width)  # kv and gate each
        return self.window_rows * self.head_dim + states

    def block_elements(self) -> int:
        """Elements one token block holds across this layer's pools."""
        return self.entries_per_block * (self.head_dim + self.index_head_dim)

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        """Compressed-state bytes one more token of context costs this layer."""
        return self.ratio and self.block_elements() * _itemsize(dtype) / (self.entries_per_block * self.ratio)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheGeometry:
    """Every layer's cache spec for one block size, step size and longest sequence."""

    block_size: int
    max_step_tokens: int
    max_len: int
    sliding_window: int
    #: the spec of each distinct layer type, in order of first appearance
    specs: dict[str, LayerCacheSpec]
    #: the layer type of each layer
    layer_types: tuple[str, ...]

    @classmethod
    def build(cls, config: ModelConfig, block_size: int, max_step_tokens: int, max_len: int) -> "CacheGeometry":
        """Rings hold what one step of ``max_step_tokens`` tokens reads and writes; none holds more than
        ``max_len`` rows (a ring that long never wraps)."""
        if block_size % math.lcm(*(config.compress_ratio(t) or 1 for t in set(config.layer_types))):
            raise ValueError(f"block size {block_size} is not a multiple of every compress ratio; use block_size_for()")
        step = min(max_step_tokens, max_len)
        w = config.sliding_window
        specs: dict[str, LayerCacheSpec] = {}
        for lt in dict.fromkeys(config.layer_types):
            m = config.compress_ratio(lt)
            overlap = 2 if lt == CSA else 1
            specs[lt] = LayerCacheSpec(
                layer_type=lt,
                ratio=m,
                head_dim=config.head_dim,
                index_head_dim=config.index_head_dim if lt == CSA else 0,
                window_rows=min(w - 1 + step, max_len),
                state_rows=min(overlap * m - 1 + step, max_len) if m else 0,
                state_width=config.head_dim * overlap if m else 0,
                index_state_width=2 * config.index_head_dim if lt == CSA else 0,
                entries_per_block=block_size // m if m else 0,
            )
        return cls(block_size, step, max_len, w, specs, tuple(config.layer_types))

    @property
    def window_rows(self) -> int:
        """Ring rows per slot of the sliding window, the same for every layer."""
        return next(iter(self.specs.values())).window_rows

    @property
    def compressed_types(self) -> list[str]:
        return [lt for lt, s in self.specs.items() if s.compressed]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        """Cache bytes one token block costs across all layers."""
        return sum(self.specs[lt].block_elements() for lt in self.layer_types) * _itemsize(dtype)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Cache bytes one sequence slot's rings cost across all layers."""
        return sum(self.specs[lt].slot_elements() for lt in self.layer_types) * _itemsize(dtype)

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        """Compressed-state bytes per token of context across all layers."""
        return sum(self.specs[lt].bytes_per_token(dtype) for lt in self.layer_types)

    def pool_bytes(self, num_slots: int, num_blocks: int, dtype: torch.dtype) -> int:
        """What a cache of ``num_slots`` slots and ``num_blocks`` blocks allocates."""
        return num_slots * self.bytes_per_slot(dtype) + num_blocks * self.bytes_per_block(dtype)

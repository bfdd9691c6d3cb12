"""The cache's geometry as data: one spec per cache kind, read by the cache and the memory planner.

Two storage kinds per layer (see ``cache.py``): per-sequence rings, sized for
one step of at most ``max_step_tokens`` tokens beyond what the layer must still
read, and token blocks holding compressed entries (and indexer keys). The
formulas live here once; pools are allocated from these numbers and the
planner's budget is their sum.

A cache kind is what a group of layers keeps; each model family names its
kinds and sizes them (``ModelConfig.cache_geometry``, in the family's
``cache.py``). A layer's window ring may live in another layer's pool
(``window_pools``), after its entries, so one gather reads both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import torch


class CacheShape(Protocol):
    """What the geometry reads of a model's config (``ModelConfig`` provides it)."""

    @property
    def ratios(self) -> list[int]: ...

    def cache_geometry(self, block_size: int, step: int, max_len: int) -> "CacheGeometry": ...


def block_size_for(config: CacheShape, requested: int) -> int:
    """The smallest multiple of ``requested`` that every compress ratio divides."""
    ratios = config.ratios
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
    #: compressed entries per token block (0 for a layer that reads another layer's entries)
    entries_per_block: int
    #: the kind whose compressed entries these layers read: their own kind, a V4.1 source's, or None (sliding)
    entry_kind: str | None = None
    #: compressor-ring positions a sequence carries from one step to the next (the rest is room for a step's tokens)
    state_keep: int = 0
    #: each entry also pools the previous window (overlapping compression, V4's CSA)
    overlap: bool = False

    @property
    def compressed(self) -> bool:
        return self.ratio > 0

    @property
    def owns_entries(self) -> bool:
        return self.entry_kind == self.layer_type

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
        if not (self.ratio and self.entries_per_block):
            return 0.0
        return self.block_elements() * _itemsize(dtype) / (self.entries_per_block * self.ratio)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheGeometry:
    """Every layer's cache spec for one block size, step size and longest sequence."""

    block_size: int
    max_step_tokens: int
    max_len: int
    sliding_window: int
    #: the spec of each distinct cache kind, in order of first appearance
    specs: dict[str, LayerCacheSpec]
    #: the cache kind of each layer
    layer_types: tuple[str, ...]
    #: per layer, the layer whose kv pool holds its window ring, and the ring's place among that pool's rings
    window_pools: tuple[tuple[int, int], ...] = ()
    #: kv pools put compressed entries before the window rings (V4.1's shared pools), else after them
    entries_first: bool = False
    #: per slot, rows of the ring of raw token ids the Engram n-gram hashes read (0: no Engram)
    history_rows: int = 0
    #: tokens an n-gram spans (the token and those before it); 0 without Engram
    history_window: int = 0
    #: per layer after the last one that keeps shared state (V4.1's layers past the last KV source), how many
    #: trailing positions of a prefill it must compute for the prompt's last logits and the window rings to
    #: come out exact (``(layers from it to the end) · (W − 1) + 1``, plus a margin); empty: none
    prefill_tail: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.window_pools:
            object.__setattr__(self, "window_pools", tuple((i, 0) for i in range(len(self.layer_types))))

    @classmethod
    def build(cls, config: CacheShape, block_size: int, max_step_tokens: int, max_len: int) -> "CacheGeometry":
        """Rings hold what one step of ``max_step_tokens`` tokens reads and writes; none holds more than
        ``max_len`` rows (a ring that long never wraps)."""
        if block_size % math.lcm(1, *config.ratios):
            raise ValueError(f"block size {block_size} is not a multiple of every compress ratio; use block_size_for()")
        step = min(max_step_tokens, max_len)
        return config.cache_geometry(block_size, step, max_len)

    @property
    def window_rows(self) -> int:
        """Ring rows per slot of the sliding window, the same for every layer."""
        return next(iter(self.specs.values())).window_rows

    @property
    def entry_kinds(self) -> list[str]:
        """The kinds that own compressed entries (each has its own step indices)."""
        return [lt for lt, s in self.specs.items() if s.owns_entries]

    def with_prefill_margin(self, margin: int) -> "CacheGeometry":
        """The same geometry with every ``prefill_tail`` ``margin`` positions longer (a draft's context)."""
        if not self.prefill_tail:
            return self
        return dataclasses.replace(self, prefill_tail=tuple(t + margin for t in self.prefill_tail))

    def pool_members(self, layer: int) -> int:
        """How many layers keep their window ring in ``layer``'s kv pool (0: it keeps its ring elsewhere)."""
        return sum(owner == layer for owner, _ in self.window_pools)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        """Cache bytes one token block costs across all layers."""
        return sum(self.specs[lt].block_elements() for lt in self.layer_types) * _itemsize(dtype)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Cache bytes one sequence slot's rings cost across all layers (the n-gram history ring included)."""
        history = self.history_rows * _itemsize(torch.int64)
        return sum(self.specs[lt].slot_elements() for lt in self.layer_types) * _itemsize(dtype) + history

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        """Compressed-state bytes per token of context across all layers."""
        return sum(self.specs[lt].bytes_per_token(dtype) for lt in self.layer_types)

    def pool_bytes(self, num_slots: int, num_blocks: int, dtype: torch.dtype) -> int:
        """What a cache of ``num_slots`` slots and ``num_blocks`` blocks allocates."""
        return num_slots * self.bytes_per_slot(dtype) + num_blocks * self.bytes_per_block(dtype)

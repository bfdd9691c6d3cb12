"""The cache's geometry as data: one spec per cache kind, read by the cache and the memory planner.

Two storage kinds per layer (see ``cache.py``): per-sequence rings, sized for
one step of at most ``max_step_tokens`` tokens beyond what the layer must still
read, and token blocks holding compressed entries (and indexer keys). The
formulas live here once; pools are allocated from these numbers and the
planner's budget is their sum.

A cache kind is what a group of layers keeps: in DeepSeek V4 one per attention
type (sliding, CSA, HCA). In V4.1 the compressed KV and indexer keys of a ratio
are owned by its KV source layers and read by the layers after them, so a
ratio has two kinds: ``shared{r}.source`` (window, compressor state, entries)
and ``shared{r}.reader`` (its window only). A reader's window ring lives in
its source's pool, after the entries, so one gather reads both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .config import CSA, SLIDING, ModelConfig


def block_size_for(config: ModelConfig, requested: int) -> int:
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

    @property
    def compressed(self) -> bool:
        return self.ratio > 0

    @property
    def owns_entries(self) -> bool:
        return self.entry_kind == self.layer_type

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
    def build(cls, config: ModelConfig, block_size: int, max_step_tokens: int, max_len: int) -> "CacheGeometry":
        """Rings hold what one step of ``max_step_tokens`` tokens reads and writes; none holds more than
        ``max_len`` rows (a ring that long never wraps)."""
        if block_size % math.lcm(1, *config.ratios):
            raise ValueError(f"block size {block_size} is not a multiple of every compress ratio; use block_size_for()")
        step = min(max_step_tokens, max_len)
        if config.v41 is not None:
            return _build_v41(config, block_size, step, max_len)
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
                entry_kind=lt if m else None,
                state_keep=overlap * m - 1 if m else 0,
            )
        return cls(block_size, step, max_len, w, specs, tuple(config.layer_types))

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


def v41_kind(layer) -> str:
    """The cache kind of a V4.1 layer (a ``V41Layer``): sliding, or its ratio's source or reader kind."""
    m = layer.compress_ratio
    if not m:
        return SLIDING
    return f"shared{m}.source" if layer.owns_kv else f"shared{m}.reader"


def _build_v41(config: ModelConfig, block_size: int, step: int, max_len: int) -> CacheGeometry:
    """DeepSeek V4.1: per ratio a source kind (window, compressor state unless the ratio is 1, entries and
    indexer keys) and a reader kind (window only, in its source's pool)."""
    v = config.v41
    w = config.sliding_window
    window = min(w - 1 + step, max_len)
    specs: dict[str, LayerCacheSpec] = {}
    kinds: list[str] = []
    pools: list[tuple[int, int]] = []
    members: dict[int, int] = {}
    for layer in v.layers():
        m = layer.compress_ratio
        kind = v41_kind(layer)
        if not m:
            specs.setdefault(kind, LayerCacheSpec(kind, 0, config.head_dim, 0, window, 0, 0, 0, 0))
            pools.append((layer.index, 0))
        else:
            source = f"shared{m}.source"
            owner = layer.index if layer.owns_kv else layer.kv_source
            state = min(m - 1 + step, max_len) if m > 1 else 0
            specs.setdefault(kind, LayerCacheSpec(
                layer_type=kind,
                ratio=m,
                head_dim=config.head_dim,
                index_head_dim=config.index_head_dim if layer.owns_kv else 0,
                window_rows=window,
                state_rows=state if layer.owns_kv else 0,
                state_width=config.head_dim if layer.owns_kv and state else 0,
                index_state_width=0,
                entries_per_block=block_size // m if layer.owns_kv else 0,
                entry_kind=source,
                state_keep=m - 1 if layer.owns_kv and state else 0,
            ))
            pools.append((owner, members.get(owner, 0)))
            members[owner] = members.get(owner, 0) + 1
        kinds.append(kind)
    n_gram = v.engram_max_ngram_size if v.engram_layer_ids else 0
    history = min(n_gram - 1 + step, max_len) if n_gram else 0
    n = config.num_hidden_layers
    last_source = max(v.kv_source_layer_ids, default=n - 1)
    tail = tuple((n - layer) * (w - 1) + 1 for layer in range(last_source + 1, n))
    return CacheGeometry(block_size, step, max_len, w, specs, tuple(kinds), tuple(pools), True, history, n_gram, tail)

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
from typing import Any, Protocol

import torch

from deepinfer_interfaces import KVFormat


class CacheShape(Protocol):
    """What the geometry reads of a model's config (``ModelConfig`` provides it)."""

    @property
    def ratios(self) -> list[int]: ...

    def cache_geometry(self, block_size: int, step: int, max_len: int) -> "CacheGeometry": ...

    def kv_cache_formats(self, kv_cache_dtype: str) -> "CacheFormats": ...


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


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fit_block(width: int, block: int, what: str) -> int:
    """The scale block of ``width`` channels: the format's ``block``, or the whole row when it is narrower
    (a tiny model's); ``ValueError`` when wider rows do not split into whole blocks."""
    if width <= 0 or (width > block and width % block) or (width < block and block % width):
        raise ValueError(f"{what} of {width} channels does not split into blocks of {block}")
    return min(width, block)


@dataclass(frozen=True)
class CacheFormats:
    """How the cache stores each kind of row: a packed record format (``KVFormat``), or None for the model
    dtype. ``kv_cache_dtype`` picks them (``ModelConfig.kv_cache_formats``)."""

    #: what ``kv_cache_dtype`` resolved to: ``model`` (plain rows) or the packed records' name
    name: str = "model"
    #: sliding-window K=V rows
    window: KVFormat | None = None
    #: compressed K=V entries
    entry: KVFormat | None = None
    #: indexer keys (the indexer's queries are rounded the same way)
    index: KVFormat | None = None
    #: the indexer rotates its keys and queries (an orthonormal Walsh–Hadamard transform) before rounding
    index_rotate: bool = False
    #: the compressors' pooling state (None: the model dtype)
    state_dtype: torch.dtype | None = None

    @property
    def packed(self) -> bool:
        return self.window is not None or self.entry is not None or self.index is not None

    def row_bytes(self, fmt: KVFormat | None, width: int, dtype: torch.dtype) -> int:
        """Bytes of one row stored as ``fmt`` (None: ``width`` elements of ``dtype``)."""
        return fmt.record_bytes if fmt is not None else width * _itemsize(dtype)

    def as_dict(self) -> dict[str, object]:
        """Every field as plain data (each format's fields, None for the model dtype): what must match for two
        caches' rows to be interchangeable (the KV store's fingerprint, a transferred sequence's state)."""
        state = str(self.state_dtype).removeprefix("torch.") if self.state_dtype is not None else None
        return {"name": self.name, "window": format_fields(self.window), "entry": format_fields(self.entry),
                "index": format_fields(self.index), "index_rotate": self.index_rotate, "state_dtype": state}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CacheFormats":
        """The formats ``as_dict`` gave (``ValueError``/``TypeError`` for anything else)."""
        def fmt(f: dict[str, Any] | None) -> KVFormat | None:
            return None if f is None else KVFormat(**f)

        state = d.get("state_dtype")
        state_dtype = getattr(torch, state) if state is not None else None
        if state_dtype is not None and not isinstance(state_dtype, torch.dtype):
            raise ValueError(f"{state!r} is not a dtype")
        return cls(str(d["name"]), fmt(d["window"]), fmt(d["entry"]), fmt(d["index"]), bool(d["index_rotate"]), state_dtype)

    def describe(self) -> str:
        """One line naming how rows are stored: ``model`` (plain rows), or each kind's record format, bytes and scales."""
        if not self.packed:
            return "model (plain rows in the model dtype)"
        kinds = [("window", self.window), ("entries", self.entry), ("indexer keys", self.index)]
        parts = [f"{what} {fmt.name} ({fmt.record_bytes} B, {fmt.scale} scales)" for what, fmt in kinds if fmt is not None]
        return f"{self.name}: " + ", ".join(parts) + (", indexer rotated" if self.index_rotate else "")


def format_fields(fmt: KVFormat | None) -> dict[str, object] | None:
    """A record format's fields as plain data (None for plain rows)."""
    return None if fmt is None else dataclasses.asdict(fmt)


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
    #: how rows are stored (``kv_cache_dtype``)
    formats: CacheFormats = CacheFormats()

    def __post_init__(self) -> None:
        if not self.window_pools:
            object.__setattr__(self, "window_pools", tuple((i, 0) for i in range(len(self.layer_types))))

    @classmethod
    def build(
        cls, config: CacheShape, block_size: int, max_step_tokens: int, max_len: int, kv_cache_dtype: str = "model"
    ) -> "CacheGeometry":
        """Rings hold what one step of ``max_step_tokens`` tokens reads and writes; none holds more than
        ``max_len`` rows (a ring that long never wraps). ``kv_cache_dtype``: ``auto``, ``fp8`` or ``model``."""
        if block_size % math.lcm(1, *config.ratios):
            raise ValueError(f"block size {block_size} is not a multiple of every compress ratio; use block_size_for()")
        step = min(max_step_tokens, max_len)
        geometry = config.cache_geometry(block_size, step, max_len)
        return dataclasses.replace(geometry, formats=config.kv_cache_formats(kv_cache_dtype))

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

    def entry_row_bytes(self, spec: LayerCacheSpec, dtype: torch.dtype) -> int:
        """Bytes one compressed entry of ``spec``'s layers holds: its K=V row and, with an indexer, its key."""
        f = self.formats
        index = f.row_bytes(f.index, spec.index_head_dim, dtype) if spec.index_head_dim else 0
        return f.row_bytes(f.entry, spec.head_dim, dtype) + index

    def window_row_bytes(self, spec: LayerCacheSpec, dtype: torch.dtype) -> int:
        """Bytes one sliding-window row of ``spec``'s layers holds."""
        return self.formats.row_bytes(self.formats.window, spec.head_dim, dtype)

    def block_bytes_of(self, spec: LayerCacheSpec, dtype: torch.dtype) -> int:
        """Bytes one token block holds for one layer of ``spec``."""
        return spec.entries_per_block * self.entry_row_bytes(spec, dtype)

    def slot_bytes_of(self, spec: LayerCacheSpec, dtype: torch.dtype) -> int:
        """Bytes one sequence slot's rings hold for one layer of ``spec``."""
        state = 2 * spec.state_rows * (spec.state_width + spec.index_state_width) * _itemsize(self.formats.state_dtype or dtype)
        return spec.window_rows * self.window_row_bytes(spec, dtype) + state

    def kind_bytes_per_token(self, spec: LayerCacheSpec, dtype: torch.dtype) -> float:
        """Compressed-state bytes one more token of context costs one layer of ``spec``."""
        if not (spec.ratio and spec.entries_per_block):
            return 0.0
        return self.entry_row_bytes(spec, dtype) / spec.ratio

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        """Cache bytes one token block costs across all layers."""
        return sum(self.block_bytes_of(self.specs[lt], dtype) for lt in self.layer_types)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Cache bytes one sequence slot's rings cost across all layers (the n-gram history ring included)."""
        history = self.history_rows * _itemsize(torch.int64)
        return sum(self.slot_bytes_of(self.specs[lt], dtype) for lt in self.layer_types) + history

    def bytes_per_token(self, dtype: torch.dtype) -> float:
        """Compressed-state bytes per token of context across all layers."""
        return sum(self.kind_bytes_per_token(self.specs[lt], dtype) for lt in self.layer_types)

    def bytes_per_token_by_kind(self, dtype: torch.dtype) -> dict[str, float]:
        """``bytes_per_token`` split by cache kind (every layer of the kind together)."""
        out: dict[str, float] = {}
        for lt in self.layer_types:
            out[lt] = out.get(lt, 0.0) + self.kind_bytes_per_token(self.specs[lt], dtype)
        return out

    def window_bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes every layer's sliding-window ring holds per sequence slot (apart from the per-token figure)."""
        return sum(self.specs[lt].window_rows * self.window_row_bytes(self.specs[lt], dtype) for lt in self.layer_types)

    def pool_bytes(self, num_slots: int, num_blocks: int, dtype: torch.dtype) -> int:
        """What a cache of ``num_slots`` slots and ``num_blocks`` blocks allocates."""
        return num_slots * self.bytes_per_slot(dtype) + num_blocks * self.bytes_per_block(dtype)

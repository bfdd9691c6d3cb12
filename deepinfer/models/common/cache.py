"""The state the model keeps between steps: per-layer pools, and the host-side map into them.

Two storage kinds per layer, sized by one ``CacheGeometry``:

- per sequence slot, rings for the sliding-window K=V rows and the
  compressors' per-token projections (state that depends on everything before
  it, never shared): a position lives in ring row ``position mod ring``;
- token blocks for the compressed entries and indexer keys (content-addressed
  state, shared through the engine's prefix cache): a block of ``block_size``
  tokens holds ``block_size / ratio`` entries of each compressing layer, and
  each sequence's block table maps its entry numbers to blocks.

The model reaches rows only through index tensors that the host computes from
these tables (``inputs.py``), so nothing in the forward depends on where a
sequence's state lives, and rolling a sequence back only moves its length: rows
past the new length are rewritten before anything reads them again.

What one forward step with a sequence at positions ``[s, e)`` touches, per layer
type with compress ratio ``m`` (the rows the rings keep live and distinct):

- window rows (raw K=V) for positions ``[s − W + 1, e)``, ``W`` the sliding window;
- compressor state rows for positions ``[m·⌊s/m⌋ − m·o, e)``, ``o`` = 1 for the
  overlapping compressor of compressed sparse attention, 0 for heavy compression;
- compressed-entry rows (and indexer-key rows) ``0 … ⌊e/m⌋ − 1``.

Two host-side settings per slot protect state the sequence did not compute:
its *floor* (after a prefix hit the ring holds only positions from the replay
start on; rows before it read as absent) and its *shared* tokens (entries of
blocks shared with other sequences are never rewritten).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer_interfaces import KVFormat, PackedPool

from ...errors import DeepInferError
from .batch import Batch
from .cache_spec import CacheGeometry, LayerCacheSpec, block_size_for
from .config import ModelConfig

COMPRESSOR = "compressor"
INDEXER = "indexer"


@dataclass(frozen=True)
class BlockPart:
    """Where one kind of a token block's state lives: ``rows`` consecutive rows of ``pool`` per block,
    block ``b`` at row ``base + b * rows``. A packed pool's part is its region's records (uint8 rows of
    ``record_bytes``), so blocks move as the bytes the cache holds."""

    name: str
    pool: torch.Tensor
    base: int
    rows: int
    #: the records' format of a packed pool's part (None: plain rows of the pool's dtype)
    format: KVFormat | None = None

    @property
    def width(self) -> int:
        return self.pool.shape[1]


class ModelCache:
    """Per-layer pools of ``num_slots`` sequence rings and ``num_blocks`` token blocks."""

    def __init__(
        self,
        geometry: CacheGeometry,
        num_slots: int,
        num_blocks: int,
        max_blocks_per_seq: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.geometry = geometry
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = geometry.block_size
        self.dtype = dtype
        self.window_rows = geometry.window_rows
        #: how rows are stored (``kv_cache_dtype``): the model reads it to round what the cache rounds
        self.formats = formats = geometry.formats
        self._kv: list[torch.Tensor | PackedPool] = []
        self._state: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        self._index: list[torch.Tensor | PackedPool] = []
        #: per layer, the first kv-pool row of its window ring, and of its pool's compressed entries
        self.window_base: list[int] = []
        self.entry_base: list[int] = []
        zeros = dict(dtype=dtype, device=device)
        for i, lt in enumerate(geometry.layer_types):
            spec = geometry.specs[lt]
            owner, member = geometry.window_pools[i]
            owner_spec = geometry.specs[geometry.layer_types[owner]]
            windows = geometry.pool_members(owner) * num_slots * spec.window_rows
            entries = num_blocks * owner_spec.entries_per_block
            if owner == i:
                self._kv.append(_kv_pool(formats, windows, entries, geometry.entries_first, spec.head_dim, dtype, device))
            else:
                self._kv.append(self._kv[owner])
            first = entries if geometry.entries_first else 0
            self.window_base.append(first + member * num_slots * spec.window_rows)
            self.entry_base.append(0 if geometry.entries_first else windows)
            states: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            state = dict(dtype=formats.state_dtype or dtype, device=device)
            if spec.state_rows:
                rows = num_slots * spec.state_rows
                states[COMPRESSOR] = (torch.zeros(rows, spec.state_width, **state), torch.zeros(rows, spec.state_width, **state))
                if spec.index_state_width:
                    states[INDEXER] = (
                        torch.zeros(rows, spec.index_state_width, **state),
                        torch.zeros(rows, spec.index_state_width, **state),
                    )
            self._state.append(states)
            keys = num_blocks * spec.entries_per_block if spec.index_head_dim else 0
            if keys and formats.index is not None:
                self._index.append(PackedPool.allocate([(keys, formats.index)], spec.index_head_dim, dtype, device))
            else:
                self._index.append(torch.zeros(keys, max(spec.index_head_dim, 1), **zeros))
        #: per slot ``history_rows`` raw token ids by position: the look-back of the Engram n-grams
        self.history = torch.zeros(num_slots * geometry.history_rows, dtype=torch.int64, device=device)
        #: per slot: its block table (-1: no block), the first position of ring state it computed
        #: itself, and how many leading tokens' entries it shares with other sequences
        self.tables = np.full((num_slots, max_blocks_per_seq), -1, dtype=np.int64)
        self.floors = np.zeros(num_slots, dtype=np.int64)
        self.shared = np.zeros(num_slots, dtype=np.int64)

    # ----- sequences -----

    def set_sequence(self, slot: int, blocks: list[int], floor: int = 0, shared_tokens: int = 0) -> None:
        """Install one sequence's block table, floor and shared-token count (host only, no device work)."""
        if len(blocks) > self.tables.shape[1]:
            raise DeepInferError(f"sequence slot {slot} has {len(blocks)} blocks but a table holds {self.tables.shape[1]}")
        row = self.tables[slot]
        row[: len(blocks)] = blocks
        row[len(blocks) :] = -1
        self.floors[slot] = floor
        self.shared[slot] = shared_tokens

    def begin_forward(self, batch: Batch) -> None:
        """Called with each step's batch before its inputs are built (bookkeeping caches check it here)."""

    def fork(self, src: int, dst: int, block_copies: list[tuple[int, int]]) -> None:
        """Make slot ``dst`` continue exactly where slot ``src`` is: copy its rings, and the
        entries of each ``(source block, destination block)`` (a partly filled block the two
        sequences will fill differently). Device copies only, in stream order."""
        g = self.geometry
        for i, lt in enumerate(g.layer_types):
            spec = g.specs[lt]
            base = self.window_base[i]
            _copy_rows(self._kv[i], base + src * spec.window_rows, base + dst * spec.window_rows, spec.window_rows)
            for kv, gate in self._state[i].values():
                for pool in (kv, gate):
                    _copy_rows(pool, src * spec.state_rows, dst * spec.state_rows, spec.state_rows)
            epb = spec.entries_per_block
            for a, b in block_copies:
                if epb:
                    _copy_rows(self._kv[i], self.entry_base[i] + a * epb, self.entry_base[i] + b * epb, epb)
                    if spec.index_head_dim:
                        _copy_rows(self._index[i], a * epb, b * epb, epb)
        r = g.history_rows
        if r:
            _copy_rows(self.history, src * r, dst * r, r)

    # ----- pools -----

    def kv_pool(self, layer: int) -> torch.Tensor | PackedPool:
        """``[N, head_dim]``: K=V rows of window tokens and of compressed entries (a V4.1 reader's pool is
        its source's: the window rows of ``layer`` start at ``window_base[layer]``)."""
        return self._kv[layer]

    def state_pool(self, layer: int, branch: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv, gate)`` per-token compressor projections of ``branch`` (``compressor`` or ``indexer``)."""
        return self._state[layer][branch]

    def index_pool(self, layer: int) -> torch.Tensor | PackedPool:
        """``[N, index_head_dim]`` indexer keys of compressed entries (compressed sparse attention)."""
        return self._index[layer]

    def pools(self) -> list[torch.Tensor]:
        """Every tensor the cache allocated (each once; a packed pool's regions)."""
        kv = [t for pool in {id(p): p for p in self._kv}.values() for t in _tensors(pool)]
        out = kv + [t for states in self._state for pair in states.values() for t in pair]
        index = [t for pool in self._index if pool.shape[0] for t in _tensors(pool)]
        return out + index + ([self.history] if self.history.numel() else [])

    def pool_bytes(self) -> int:
        """Bytes the pools hold."""
        return sum(t.numel() * t.element_size() for t in self.pools())

    # ----- token blocks as data (the on-disk store's unit) -----

    def block_parts(self) -> list[BlockPart]:
        """Every pool region a token block fills, in layer order: the compressed K=V entries of each layer
        that owns entries, and its indexer keys (compressed sparse attention)."""
        parts = []
        for i, lt in enumerate(self.geometry.layer_types):
            epb = self.geometry.specs[lt].entries_per_block
            if not epb:
                continue
            parts.append(_part(f"layers.{i}.kv", self._kv[i], self.entry_base[i], epb))
            if self.geometry.specs[lt].index_head_dim:
                parts.append(_part(f"layers.{i}.index", self._index[i], 0, epb))
        return parts

    def read_blocks(self, block_ids: list[int]) -> list[list[torch.Tensor]]:
        """Host copies of the blocks' state, per block one tensor ``[rows, width]`` per ``block_parts()``
        entry. Runs in stream order after the steps that wrote them (the device thread)."""
        if not block_ids:
            return []
        parts = self.block_parts()
        host = [part.pool.index_select(0, _block_rows(part, block_ids, part.pool.device)).cpu() for part in parts]
        return [[h[k * p.rows : (k + 1) * p.rows] for h, p in zip(host, parts)] for k in range(len(block_ids))]

    def write_blocks(self, block_ids: list[int], data: list[list[torch.Tensor]]) -> None:
        """Install state read by ``read_blocks`` (here or in another process) into ``block_ids``; runs
        before the step that reads them."""
        if not block_ids:
            return
        for j, part in enumerate(self.block_parts()):
            rows = _block_rows(part, block_ids, part.pool.device)
            values = torch.cat([d[j] for d in data]).to(part.pool.device, part.pool.dtype)
            part.pool.index_copy_(0, rows, values)

    # ----- the host-side map: numpy int64 in, rows out, -1 where nothing is (or may be written) -----

    def window_rows_of(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rows of every layer's kv pool holding the raw K=V of the tokens at ``positions``."""
        return self._ring(slots, positions, self.window_rows)

    def state_rows_of(self, spec: LayerCacheSpec, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rows of the state pools holding the compressor projections of the tokens at ``positions``."""
        return self._ring(slots, positions, spec.state_rows)

    def entry_rows_of(self, spec: LayerCacheSpec, slots: np.ndarray, entries: np.ndarray, index: bool = False) -> np.ndarray:
        """Rows of the kv pool (``index``: the index pool) holding compressed entries ``entries``."""
        epb = spec.entries_per_block
        ok = (entries >= 0) & (slots >= 0)
        e = np.where(ok, entries, 0)
        block = np.minimum(e // epb, self.tables.shape[1] - 1)
        phys = self.tables[np.where(ok, slots, 0), block]
        base = 0 if index or self.geometry.entries_first else self.num_slots * spec.window_rows
        return np.where(ok & (phys >= 0), base + phys * epb + e % epb, -1)

    def entry_write_rows_of(self, spec: LayerCacheSpec, slots: np.ndarray, entries: np.ndarray, index: bool = False) -> np.ndarray:
        """Rows new ``entries`` are written to; -1 for entries shared with other sequences (kept as they are)."""
        rows = self.entry_rows_of(spec, slots, entries, index)
        own = entries >= self.shared[np.maximum(slots, 0)] // spec.ratio
        return np.where(own, rows, -1)

    def history_rows_of(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rows of the token-history ring holding the ids at ``positions`` (the floor does not apply: the
        ids before a replay start are written by the step that starts there)."""
        r = self.geometry.history_rows
        ok = (slots >= 0) & (positions >= 0)
        return np.where(ok, slots * r + positions % max(r, 1), -1)

    def _ring(self, slots: np.ndarray, positions: np.ndarray, rows_per_slot: int) -> np.ndarray:
        ok = (slots >= 0) & (positions >= 0)
        ok &= positions >= self.floors[np.maximum(slots, 0)]
        return np.where(ok, slots * rows_per_slot + positions % max(rows_per_slot, 1), -1)


def _block_rows(part: BlockPart, block_ids: list[int], device: torch.device) -> torch.Tensor:
    """Pool rows of ``part`` for ``block_ids``, block after block."""
    starts = part.base + np.asarray(block_ids, dtype=np.int64) * part.rows
    rows = (starts[:, None] + np.arange(part.rows, dtype=np.int64)[None, :]).reshape(-1)
    return torch.from_numpy(rows).to(device)


def _copy_rows(pool: torch.Tensor | PackedPool, src: int, dst: int, n: int) -> None:
    if isinstance(pool, PackedPool):
        pool.copy_rows(src, dst, n)
    elif n and src != dst:
        pool[dst : dst + n].copy_(pool[src : src + n])


def _kv_pool(
    formats, windows: int, entries: int, entries_first: bool, dim: int, dtype: torch.dtype, device
) -> torch.Tensor | PackedPool:
    """One layer's K=V pool of ``windows`` ring rows and ``entries`` entry rows (plain, or packed records)."""
    if formats.window is None:
        return torch.zeros(windows + entries, dim, dtype=dtype, device=device)
    parts = [(entries, formats.entry), (windows, formats.window)] if entries_first else [(windows, formats.window), (entries, formats.entry)]
    if formats.window == formats.entry:
        parts = [(windows + entries, formats.window)]
    return PackedPool.allocate([(n, f) for n, f in parts if n], dim, dtype, device)


def _tensors(pool: torch.Tensor | PackedPool) -> list[torch.Tensor]:
    return pool.tensors() if isinstance(pool, PackedPool) else [pool]


def _part(name: str, pool: torch.Tensor | PackedPool, base: int, rows: int) -> BlockPart:
    """The block part at logical row ``base`` of ``pool``: for a packed pool, in its region's records."""
    if isinstance(pool, PackedPool):
        region = pool.region_of(base) if pool.shape[0] > base else pool.regions[-1]
        return BlockPart(name, region.data, base - region.start, rows, region.format)
    return BlockPart(name, pool, base, rows)


class ContiguousCache(ModelCache):
    """A cache whose every sequence slot owns a fixed run of blocks, with its own length bookkeeping.

    For running the model without the engine (tests, training, conformance).
    Steps bring at most ``max_step_tokens`` tokens per sequence (all of
    ``max_len`` when None), which also bounds how far ``truncate`` can roll a
    sequence back (rejected speculative tokens). ``kv_cache_dtype`` as the
    engine's (plain rows in ``dtype`` unless asked).
    """

    def __init__(
        self,
        config: ModelConfig,
        max_seqs: int,
        max_len: int,
        *,
        max_step_tokens: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "model",
    ) -> None:
        if max_seqs <= 0 or max_len <= 0:
            raise DeepInferError(f"ContiguousCache needs max_seqs > 0 and max_len > 0 (got {max_seqs}, {max_len})")
        block = block_size_for(config, 16)
        geometry = CacheGeometry.build(config, block, max_step_tokens or max_len, max_len, kv_cache_dtype)
        per_seq = geometry.blocks_for(max_len)
        super().__init__(geometry, max_seqs, max_seqs * per_seq, per_seq, dtype, device)
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.max_step_tokens = geometry.max_step_tokens
        for slot in range(max_seqs):
            self.set_sequence(slot, list(range(slot * per_seq, (slot + 1) * per_seq)))
        self.lengths = [0] * max_seqs
        self._in_use = [False] * max_seqs

    def allocate(self) -> int:
        """Claim a free sequence slot (length 0)."""
        for slot, used in enumerate(self._in_use):
            if not used:
                self._in_use[slot] = True
                self.lengths[slot] = 0
                return slot
        raise DeepInferError(f"all {self.max_seqs} sequence slots of the cache are in use; free one or build a larger cache")

    def free(self, slot: int) -> None:
        """Release ``slot``; its rows are reused by the next ``allocate``."""
        self._check_slot(slot)
        self._in_use[slot] = False
        self.lengths[slot] = 0

    def truncate(self, slot: int, new_len: int) -> None:
        """Drop the tokens at positions ``>= new_len`` (e.g. rejected speculative tokens)."""
        self._check_slot(slot)
        length = self.lengths[slot]
        if not 0 <= new_len <= length:
            raise DeepInferError(f"cannot truncate sequence slot {slot} of length {length} to {new_len}; give 0 <= new_len <= {length}")
        if new_len < length - self.max_step_tokens and new_len != 0:
            raise DeepInferError(
                f"cannot roll sequence slot {slot} back from {length} to {new_len}: the rings keep only "
                f"{self.max_step_tokens} tokens of history beyond the window; truncate to 0 and prefill again"
            )
        self.lengths[slot] = new_len

    def begin_forward(self, batch: Batch) -> None:
        """Check each sequence continues where its cached state ends, then extend its length."""
        for slot, start, n in zip(batch.seq_slots, batch.start_positions, batch.query_lens):
            self._check_slot(slot)
            if start != self.lengths[slot]:
                raise DeepInferError(
                    f"sequence slot {slot} holds {self.lengths[slot]} tokens but the batch continues it at position {start}; "
                    f"call truncate({slot}, {start}) first to roll it back"
                )
            if n > self.max_step_tokens:
                raise DeepInferError(f"sequence slot {slot} brings {n} tokens in one step; this cache takes at most {self.max_step_tokens} (max_step_tokens)")
            if start + n > self.max_len:
                raise DeepInferError(f"sequence slot {slot} would reach {start + n} tokens; this cache holds at most {self.max_len} (max_len)")
        for slot, start, n in zip(batch.seq_slots, batch.start_positions, batch.query_lens):
            self.lengths[slot] = start + n

    def _check_slot(self, slot: int) -> None:
        if not (0 <= slot < self.max_seqs and self._in_use[slot]):
            raise DeepInferError(f"sequence slot {slot} is not allocated in this cache; call allocate() first")

"""One sequence's whole cache state as data: what a prefill engine hands a decode engine.

A sequence that has computed positions ``[0, n)`` holds state of two kinds
(see ``models/common/cache.py``): token blocks (compressed entries and indexer keys,
block after block) and per-slot rings (the sliding-window K=V rows, the
compressors' per-token projections, the Engram token history, and the DSpark
draft's context). Blocks travel whole. Ring rows travel *by position*: each
is read at ``position mod ring`` of the source slot and written at the same
position of the destination slot's ring, so the two engines may differ in slot
numbers, block ids and ring sizes (prefill chunk margins). After ``write`` the
destination continues at position ``n`` exactly as the source would have.

A packed cache (``kv_cache_dtype`` fp8) moves its rows as the records it holds:
blocks as their regions' bytes (``ModelCache.block_parts``) and window rows as
the window region's records, never decoded, so a transfer is as much smaller as
the cache. The state names how its rows are stored (``storage``); a decode
engine whose cache stores them otherwise refuses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from deepinfer_interfaces import PackedPool

from ..models.common.cache import ModelCache
from ..models.common.cache_spec import CacheFormats
from ..models.common.dspark import DSparkRing


@dataclass
class RowRead:
    """Rows ``rows`` of a 2-D contiguous cache ``pool``, not yet read: what a state tensor is before it is
    copied (``gather``) or read by another process straight from the pool's memory (``segments``)."""

    pool: torch.Tensor
    rows: np.ndarray

    @property
    def row_bytes(self) -> int:
        return self.pool.shape[1] * self.pool.element_size()

    @property
    def nbytes(self) -> int:
        return len(self.rows) * self.row_bytes

    def gather(self) -> torch.Tensor:
        """The rows, copied to the host."""
        return self.pool.index_select(0, torch.from_numpy(self.rows).to(self.pool.device)).cpu()

    def segments(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each run of consecutive rows, in row order (a ring that wraps has two)."""
        if not len(self.rows):
            return []
        breaks = np.flatnonzero(np.diff(self.rows) != 1) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(self.rows)]))
        base, size = self.pool.data_ptr(), self.row_bytes
        return [(base + int(self.rows[a]) * size, int(b - a) * size) for a, b in zip(starts, ends)]


#: a state tensor: read (on the host), or still in the pools (a plan)
Data = torch.Tensor | RowRead


@dataclass
class RingRows:
    """The rows of one ring pool that hold ``positions`` (ascending), as ``data`` ``[len(positions), width]``."""

    positions: np.ndarray
    data: Data


@dataclass
class DraftContext:
    """The DSpark ring of one slot: context vectors and per-stage K=V rows, each with the positions it holds."""

    ctx_positions: np.ndarray
    ctx: Data
    kv_positions: np.ndarray
    #: ``[stages, rows, head_dim]`` once read; before, one read per stage
    kv: torch.Tensor | list[RowRead]


@dataclass
class SequenceState:
    """Positions ``[0, num_tokens)`` of one sequence: its blocks and its ring rows (all on the host)."""

    num_tokens: int
    #: per block, one tensor per ``ModelCache.block_parts()`` entry
    blocks: list[list[Data]]
    #: per layer: its sliding-window K=V rows
    window: list[RingRows]
    #: per layer and compressor branch: the (kv, gate) projection rows
    states: list[dict[str, tuple[RingRows, RingRows]]]
    history: RingRows | None = None
    draft: DraftContext | None = None
    #: how the source cache stores rows (``CacheFormats.as_dict()``): the destination's must be the same
    storage: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the state holds (what a transfer moves)."""
        sizes: list[int] = []
        map_data(self, lambda x: sizes.append(x.nbytes if isinstance(x, RowRead) else x.numel() * x.element_size()) or x)
        return sum(sizes)


def map_data(state: SequenceState, fn: Callable[[Data], Data]) -> SequenceState:
    """``state`` with every tensor (or read) replaced by ``fn`` of it, always in the same order: blocks, window
    rows, compressor states, history, the draft's context and its per-stage K=V."""
    blocks = [[fn(t) for t in block] for block in state.blocks]
    window = [replace(r, data=fn(r.data)) for r in state.window]
    states = [{b: (replace(kv, data=fn(kv.data)), replace(gate, data=fn(gate.data))) for b, (kv, gate) in layer.items()}
              for layer in state.states]
    history = replace(state.history, data=fn(state.history.data)) if state.history is not None else None
    draft = None
    if state.draft is not None:
        d = state.draft
        kv = [fn(r) for r in d.kv] if isinstance(d.kv, list) else fn(d.kv)
        draft = replace(d, ctx=fn(d.ctx), kv=torch.stack(kv) if isinstance(kv, list) and all(isinstance(t, torch.Tensor) for t in kv) else kv)
    return SequenceState(state.num_tokens, blocks, window, states, history, draft, state.storage)


def storage_mismatch(cache: ModelCache, state: SequenceState) -> str | None:
    """Why ``state`` cannot be installed into ``cache`` (its rows are stored another way), or None."""
    if state.storage == cache.formats.as_dict():
        return None
    try:
        theirs = CacheFormats.from_dict(state.storage).describe() if state.storage is not None else "an unnamed layout"
    except (KeyError, TypeError, ValueError, AttributeError):
        theirs = "an unreadable layout"
    return (f"the prefilled state's cache stores rows as {theirs} but this engine's stores them as {cache.formats.describe()}; "
            "start the prefill and decode engines with the same --kv-cache-dtype")


def reads(plan: SequenceState) -> list[RowRead]:
    """A plan's reads in ``map_data`` order."""
    out: list[RowRead] = []
    map_data(plan, lambda x: out.append(x) or x)
    return out


@dataclass
class SequenceInstall:
    """Another engine's sequence state to install into ``slot`` and the (freshly allocated) ``block_ids``
    before the step that reads it (a decode engine's first step of a prefilled request)."""

    slot: int
    block_ids: list[int]
    state: SequenceState


@dataclass
class PrefilledRequest:
    """What a prefill engine hands a decode engine for one request: the state of its prompt and the
    token(s) it sampled after it (the decode engine feeds them next), with their log-probabilities when the
    request asked for them (token id -> (logprob, rank) per token), so the decode side's output begins exactly
    where the prefill side's ended."""

    state: SequenceState
    output_token_ids: list[int]
    output_logprobs: list[dict[int, tuple[float, int]]] | None = None


def _live(n: int, rows: int) -> np.ndarray:
    """The last ``rows`` positions of ``[0, n)``: those a sequence carries into its next step (a ring holds
    more, room for one step's tokens, which the next step overwrites before it reads them)."""
    return np.arange(max(0, n - rows), n, dtype=np.int64)


def _storage(pool: torch.Tensor | PackedPool, base: int) -> tuple[torch.Tensor, int]:
    """Where the rows from logical row ``base`` on are stored: the pool itself, or the packed region holding
    them (its records, rows counted from the region's start)."""
    if isinstance(pool, PackedPool):
        region = pool.region_of(base)
        return region.data, base - region.start
    return pool, base


def _read(pool: torch.Tensor | PackedPool, base: int, rows: np.ndarray, positions: np.ndarray) -> RingRows:
    """The rows holding ``positions`` (those below the slot's floor, which it never computed, left out), as
    stored (a packed pool's records)."""
    held = rows >= 0
    data, start = _storage(pool, base)
    return RingRows(positions[held], RowRead(data, start + rows[held]))


def _tail(r: RingRows, keep: int) -> RingRows:
    """The last ``keep`` positions of ``r`` (a smaller ring holds no more)."""
    k = len(r.positions) - min(len(r.positions), keep)
    return RingRows(r.positions[k:], r.data[k:])


def _write(pool: torch.Tensor | PackedPool, base: int, rows: np.ndarray, data: torch.Tensor) -> None:
    """Rows as ``_read`` gave them into ``rows`` (from logical row ``base``); a packed pool takes records as they are."""
    if not len(rows):
        return
    target, start = _storage(pool, base)
    if isinstance(pool, PackedPool) and (data.dtype != torch.uint8 or data.shape[1] != target.shape[1]):
        raise ValueError(f"rows of {data.shape[1]} {data.dtype} are not {target.shape[1]}-byte records of this packed cache")
    target.index_copy_(0, torch.from_numpy(start + rows).to(target.device), data.to(target.device, target.dtype))


def read_sequence(cache: ModelCache, ring: DSparkRing | None, slot: int, blocks: list[int], num_tokens: int) -> SequenceState:
    """Copy positions ``[0, num_tokens)`` of the sequence in ``slot`` (block table ``blocks``) off the device.
    Runs on the device thread, after the steps that wrote them."""
    return gather(plan_sequence(cache, ring, slot, blocks, num_tokens))


def gather(plan: SequenceState) -> SequenceState:
    """The plan's rows copied to the host with one gather and one copy per pool (not one per block and part)."""
    pending = reads(plan)
    by_pool: dict[int, list[int]] = {}
    for k, r in enumerate(pending):
        by_pool.setdefault(id(r.pool), []).append(k)
    pieces: list[torch.Tensor | None] = [None] * len(pending)
    for members in by_pool.values():
        first = pending[members[0]]
        rows = np.concatenate([pending[k].rows for k in members])
        host = RowRead(first.pool, rows).gather()
        for k, part in zip(members, torch.split(host, [len(pending[k].rows) for k in members])):
            pieces[k] = part
    taken = iter(pieces)
    return map_data(plan, lambda _: next(taken))


def plan_sequence(cache: ModelCache, ring: DSparkRing | None, slot: int, blocks: list[int], num_tokens: int) -> SequenceState:
    """Where positions ``[0, num_tokens)`` of the sequence in ``slot`` live in the pools: its state with every
    tensor a ``RowRead`` (host-side arithmetic only; valid while the slot and blocks stay held)."""
    g = cache.geometry
    used = blocks[: -(-num_tokens // cache.block_size)]
    slots = lambda positions: np.full(len(positions), slot, dtype=np.int64)  # noqa: E731
    window_pos = _live(num_tokens, min(cache.window_rows, g.sliding_window - 1))
    window = [_read(cache.kv_pool(i), cache.window_base[i], cache.window_rows_of(slots(window_pos), window_pos), window_pos)
              for i in range(len(g.layer_types))]
    states: list[dict[str, tuple[RingRows, RingRows]]] = []
    for i, lt in enumerate(g.layer_types):
        spec = g.specs[lt]
        pos = _live(num_tokens, min(spec.state_rows, spec.state_keep))
        rows = cache.state_rows_of(spec, slots(pos), pos)
        branches = {}
        for branch in ("compressor", "indexer"):
            if spec.state_rows and (branch == "compressor" or spec.index_state_width):
                kv, gate = cache.state_pool(i, branch)
                branches[branch] = (_read(kv, 0, rows, pos), _read(gate, 0, rows, pos))
        states.append(branches)
    history = None
    if g.history_rows:
        pos = _live(num_tokens, min(g.history_rows, g.history_window - 1))
        history = _read(cache.history.view(-1, 1), 0, cache.history_rows_of(slots(pos), pos), pos)
    parts = cache.block_parts()
    block_reads = [[RowRead(p.pool, p.base + b * p.rows + np.arange(p.rows, dtype=np.int64)) for p in parts] for b in used]
    return SequenceState(num_tokens, block_reads, window, states, history, _read_draft(ring, slot, num_tokens), cache.formats.as_dict())


def _read_draft(ring: DSparkRing | None, slot: int, num_tokens: int) -> DraftContext | None:
    if ring is None:
        return None
    rows = slot * ring.window + np.arange(ring.window, dtype=np.int64)
    lo = num_tokens - ring.window
    ctx_ok = rows[(ring.ctx_pos[rows] >= lo) & (ring.ctx_pos[rows] < num_tokens)]
    kv_ok = rows[(ring.kv_pos[rows] >= lo) & (ring.kv_pos[rows] < num_tokens)]
    return DraftContext(ring.ctx_pos[ctx_ok].copy(), RowRead(ring.ctx, ctx_ok), ring.kv_pos[kv_ok].copy(),
                        [RowRead(ring.kv[s], kv_ok) for s in range(ring.kv.shape[0])])


def write_sequence(cache: ModelCache, ring: DSparkRing | None, slot: int, blocks: list[int], state: SequenceState) -> None:
    """Install ``state`` into ``slot`` and the (freshly allocated) ``blocks``: the sequence continues at
    position ``state.num_tokens``. Runs on the device thread, before the step that reads it."""
    g = cache.geometry
    used = blocks[: len(state.blocks)]
    cache.write_blocks(used, state.blocks)
    slots = lambda positions: np.full(len(positions), slot, dtype=np.int64)  # noqa: E731
    cache.set_sequence(slot, blocks)  # floor 0: every position it holds is its own
    for i, rows in enumerate(state.window):
        r = _tail(rows, cache.window_rows)
        _write(cache.kv_pool(i), cache.window_base[i], cache.window_rows_of(slots(r.positions), r.positions), r.data)
    for i, lt in enumerate(g.layer_types):
        spec = g.specs[lt]
        for branch, (kv_rows, gate_rows) in state.states[i].items():
            kv, gate = cache.state_pool(i, branch)
            for pool, rows in ((kv, kv_rows), (gate, gate_rows)):
                r = _tail(rows, spec.state_rows)
                _write(pool, 0, cache.state_rows_of(spec, slots(r.positions), r.positions), r.data)
    if state.history is not None and g.history_rows:
        r = _tail(state.history, g.history_rows)
        _write(cache.history.view(-1, 1), 0, cache.history_rows_of(slots(r.positions), r.positions), r.data)
    if ring is not None:
        _write_draft(ring, slot, state.draft)


def _write_draft(ring: DSparkRing, slot: int, draft: DraftContext | None) -> None:
    ring.clear(slot)
    if draft is None:
        return
    ctx_rows = slot * ring.window + draft.ctx_positions % ring.window
    ring.keep(ctx_rows, draft.ctx_positions, draft.ctx)
    if len(draft.kv_positions):
        kv_rows = slot * ring.window + draft.kv_positions % ring.window
        index = torch.from_numpy(kv_rows).to(ring.kv.device)
        ring.kv[:, index] = draft.kv.to(ring.kv.device, ring.kv.dtype)
        ring.positions[index] = torch.from_numpy(draft.kv_positions).to(ring.positions.device)
        ring.kv_pos[kv_rows] = draft.kv_positions

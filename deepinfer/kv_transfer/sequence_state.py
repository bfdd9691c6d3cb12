"""One sequence's whole cache state as data: what a prefill engine hands a decode engine.

A sequence that has computed positions ``[0, n)`` holds state of two kinds
(see ``model/cache.py``): token blocks (compressed entries and indexer keys,
block after block) and per-slot rings (the sliding-window K=V rows, the
compressors' per-token projections, the Engram token history, and the DSpark
draft's context). Blocks travel whole. Ring rows travel *by position*: each
is read at ``position mod ring`` of the source slot and written at the same
position of the destination slot's ring, so the two engines may differ in slot
numbers, block ids and ring sizes (prefill chunk margins). After ``write`` the
destination continues at position ``n`` exactly as the source would have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..model.cache import ModelCache
from ..model.dspark import DSparkRing


@dataclass
class RingRows:
    """The rows of one ring pool that hold ``positions`` (ascending), as ``data`` ``[len(positions), width]``."""

    positions: np.ndarray
    data: torch.Tensor


@dataclass
class DraftContext:
    """The DSpark ring of one slot: context vectors and per-stage K=V rows, each with the positions it holds."""

    ctx_positions: np.ndarray
    ctx: torch.Tensor
    kv_positions: np.ndarray
    kv: torch.Tensor  # [stages, rows, head_dim]


@dataclass
class SequenceState:
    """Positions ``[0, num_tokens)`` of one sequence: its blocks and its ring rows (all on the host)."""

    num_tokens: int
    #: per block, one tensor per ``ModelCache.block_parts()`` entry
    blocks: list[list[torch.Tensor]]
    #: per layer: its sliding-window K=V rows
    window: list[RingRows]
    #: per layer and compressor branch: the (kv, gate) projection rows
    states: list[dict[str, tuple[RingRows, RingRows]]]
    history: RingRows | None = None
    draft: DraftContext | None = None
    #: bytes the state holds (what a transfer moves)
    nbytes: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.nbytes:
            tensors = [t for b in self.blocks for t in b] + [r.data for r in self.window]
            tensors += [r.data for s in self.states for pair in s.values() for r in pair]
            tensors += [self.history.data] if self.history is not None else []
            tensors += [self.draft.ctx, self.draft.kv] if self.draft is not None else []
            self.nbytes = sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class PrefilledRequest:
    """What a prefill engine hands a decode engine for one request: the state of its prompt and the
    token(s) it sampled after it (the decode engine feeds them next)."""

    state: SequenceState
    output_token_ids: list[int]


def _live(n: int, rows: int) -> np.ndarray:
    """The last ``rows`` positions of ``[0, n)``: those a sequence carries into its next step (a ring holds
    more, room for one step's tokens, which the next step overwrites before it reads them)."""
    return np.arange(max(0, n - rows), n, dtype=np.int64)


def _read(pool: torch.Tensor, base: int, rows: np.ndarray, positions: np.ndarray) -> RingRows:
    """The rows holding ``positions`` (those below the slot's floor, which it never computed, left out)."""
    held = rows >= 0
    return RingRows(positions[held], pool.index_select(0, torch.from_numpy(base + rows[held]).to(pool.device)).cpu())


def _tail(r: RingRows, keep: int) -> RingRows:
    """The last ``keep`` positions of ``r`` (a smaller ring holds no more)."""
    k = len(r.positions) - min(len(r.positions), keep)
    return RingRows(r.positions[k:], r.data[k:])


def _write(pool: torch.Tensor, base: int, rows: np.ndarray, data: torch.Tensor) -> None:
    if len(rows):
        pool.index_copy_(0, torch.from_numpy(base + rows).to(pool.device), data.to(pool.device, pool.dtype))


def read_sequence(cache: ModelCache, ring: DSparkRing | None, slot: int, blocks: list[int], num_tokens: int) -> SequenceState:
    """Copy positions ``[0, num_tokens)`` of the sequence in ``slot`` (block table ``blocks``) off the device.
    Runs on the device thread, after the steps that wrote them."""
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
    return SequenceState(num_tokens, cache.read_blocks(used), window, states, history, _read_draft(ring, slot, num_tokens))


def _read_draft(ring: DSparkRing | None, slot: int, num_tokens: int) -> DraftContext | None:
    if ring is None:
        return None
    rows = slot * ring.window + np.arange(ring.window, dtype=np.int64)
    lo = num_tokens - ring.window
    ctx_ok = rows[(ring.ctx_pos[rows] >= lo) & (ring.ctx_pos[rows] < num_tokens)]
    kv_ok = rows[(ring.kv_pos[rows] >= lo) & (ring.kv_pos[rows] < num_tokens)]
    dev = ring.ctx.device
    return DraftContext(
        ring.ctx_pos[ctx_ok].copy(), ring.ctx.index_select(0, torch.from_numpy(ctx_ok).to(dev)).cpu(),
        ring.kv_pos[kv_ok].copy(), ring.kv.index_select(1, torch.from_numpy(kv_ok).to(dev)).cpu(),
    )


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

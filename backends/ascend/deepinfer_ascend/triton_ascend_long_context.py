"""The ops that read every compressed entry a token sees through per-sequence tables, as Triton-Ascend kernels:
``indexer_topk`` (lightning-indexer scores fused with their top-k) and ``entry_attention`` (sink attention over
a token's listed rows, then its table entries).

Both walk ``table [B, N]`` in entry blocks and never build a ``[T, N, D]`` gather; written to the same
Triton-Ascend rules as ``triton_ascend_indexer`` (a 1-D grid of one program per vector core, each walking its
share of tiles; no atomics, every output element has one writer; fp32 math after loading; no 3-D tiles; the
score reductions run along the last axis of a tile at least ``REDUCE_MIN`` wide; blocks from the UB budget) and
sync-free (no ``.item()``, no host read: every loop bound is a shape).

``indexer_topk`` is three launches per chunk of tokens:

1. ``_entry_keys_kernel`` walks (token, entry-block) tiles: the rows ``table[seq, j]`` for ``j < visible``, their
   keys as one ``[BLOCK_N, D]`` tile, ``Σ_h w_h · relu(q_h · k)`` head by head (as ``_indexer_scores_kernel``),
   times ``scale``; each score is stored as an int32 key that orders like the float (``NONE_KEY`` for a
   non-candidate) in a ``[chunk, N]`` int32 scratch. The chunk holds ``SCRATCH_ELEMENTS // N`` tokens (one at
   least), so the scratch is bounded: 16 MiB, or one token's ``4·N`` bytes where ``N`` alone is larger (half the
   size of that token's table row).
2. ``_select_entries_kernel`` walks the chunk's tokens: bisection over the int32 keys finds ``theta``, the
   ``k``-th largest (32 counting passes), a second bisection over entry numbers the last entry equal to
   ``theta`` still needed (ties to the lower entry, as the reference's stable sort), exactly as
   ``candidate_blocks`` selects blocks. It then compacts the kept entries, in entry order, into ``[chunk, k]``
   (key, entry) lists: each block's exclusive prefix count is a last-axis sum over a ``[BLOCK_P, BLOCK_P]``
   triangle, no scan. Slots past the kept ones get ``NONE_KEY``.
3. ``_rank_entries_kernel`` ranks each kept entry among the kept (``O(k²)`` compares in ``[BLOCK_I, BLOCK_J]``
   tiles: higher key first, equal keys by list position, i.e. by entry number) and writes its entry number at
   its rank of the output row; the rest of the row stays ``-1``.

Steps 2 and 3 are separate launches because 3 reads what 2 wrote. The picks are exact: equal scores give
equal keys, and integer inputs score exactly in fp32.

``entry_attention`` is one launch over (token, head) tiles: the head's query, a running max (started at the
head's sink), sum and ``[D]`` accumulator, over the listed rows then the table entries ``j < visible`` in blocks
of ``BLOCK_N`` rows (the entry loop stops at the token's own ``visible``). Each block's logits are a last-axis
reduction of its ``[BLOCK_N, D]`` rows tile; the weighted rows reduce its leading axis (a 2-D tile whose inner
extent is ``D >= 16``; triton-ascend#2291 concerns 3-D tiles, #2247 inner extents below 8). Rows are read once
per head: the price of keeping one head's accumulator, not ``H × D``, in UB.

Both kernels read a one-region packed pool (``PackedPool``) as well as a plain one: each rows tile is decoded as it is
loaded (``triton_ascend_kv_quant._load_rows``: every channel's code and block scale gathered from its record,
rope channels from their bf16 bytes, then rounded to the pool dtype as ``PackedPool.take`` rounds them), so a
packed pool costs no decoded copy and the rest of each kernel is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_interfaces import PackedPool
from deepinfer_interfaces.kv_format import KVFormat

from .launch import (
    REDUCE_MIN, Tile, TilePlan, UnifiedBuffer, block, fit_blocks, interpreting, next_power_of_2, program_count, require_fit,
    unified_buffer,
)
from .triton_ascend_indexer import NONE_KEY, PINNED_KEY, _count_keys
from .triton_ascend_kv_quant import _load_rows, format_label, packed_read_tiles, row_source
from .triton_ascend_mhc import _total, interpreter_block

#: most entries per scoring tile, per counting step, per compaction step; most kept entries ranked at once
BLOCK_N_CAP, BLOCK_R_CAP, BLOCK_P_CAP, BLOCK_I_CAP, BLOCK_J_CAP = 128, 4096, 64, 512, 16
#: most int32 score keys the indexer's scratch holds (16 MiB); a chunk of tokens fills at most this
SCRATCH_ELEMENTS = 1 << 22
#: most rows per attention block
ATTENTION_BLOCK_CAP = 64


@triton.jit
def _order_key(score):
    """An int32 that orders like the fp32 ``score`` (``-0.0`` folded into ``+0.0``, which compare equal)."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


# ---- indexer_topk ------------------------------------------------------------------------------


@triton.jit
def _entry_keys_kernel(
    q_ptr, w_ptr, keys_ptr, table_ptr, seq_ptr, vis_ptr, out_ptr,
    T0, TT, H, D, N,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_tb, stride_ot,
    scale,
    PACKED: tl.constexpr, FP4: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, ROPE: tl.constexpr, ROUND: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    n_blocks = tl.cdiv(N, BLOCK_N)
    for tile in range(pid, TT * n_blocks, NUM_PROGRAMS):
        lt = tl.cast(tile // n_blocks, tl.int64)
        t = T0 + lt
        offs_n = (tile % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        seq = tl.load(seq_ptr + t).to(tl.int64)
        vis = tl.load(vis_ptr + t)
        row = tl.load(table_ptr + seq * stride_tb + offs_n, mask=n_ok & (offs_n < vis), other=-1)
        valid = row >= 0
        rows = tl.where(valid, row, 0).to(tl.int64)
        keys = _load_rows(
            keys_ptr, rows, valid, offs_d, d_ok, stride_kn,
            PACKED, FP4, SCALE, BLOCK, QUANT, ROPE_OFF, SCALE_OFF, ROPE, ROUND,
        )
        q_row = q_ptr + t * stride_qt
        w_row = w_ptr + t * stride_wt
        score = tl.zeros([BLOCK_N], dtype=tl.float32)
        for h in range(H):
            q = tl.load(q_row + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            dots = tl.sum(keys * q[None, :], axis=1)
            w = tl.load(w_row + h).to(tl.float32)
            score += w * tl.maximum(dots, 0.0)
        key = tl.where(valid, _order_key(score * scale), NONE_KEY)
        tl.store(out_ptr + lt * stride_ot + offs_n, key, mask=n_ok)


@triton.jit
def _select_entries_kernel(
    key_ptr, ckey_ptr, cid_ptr,
    TT, N, K, INDEX_STEPS,
    stride_kt, stride_ct,
    NUM_PROGRAMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_p = tl.arange(0, BLOCK_P)
    for lt in range(pid, TT, NUM_PROGRAMS):
        lt64 = tl.cast(lt, tl.int64)
        key_row = key_ptr + lt64 * stride_kt
        last = N - 1
        # theta: the largest key with at least K keys >= it; the smallest keepable key when fewer are keepable
        lo = tl.full([], NONE_KEY + 1, tl.int64)
        hi = tl.full([], PINNED_KEY, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            take = _count_keys(key_row, N, mid.to(tl.int32), last, False, BLOCK_R) >= K
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid - 1)
        theta = lo.to(tl.int32)
        ties = _count_keys(key_row, N, theta, last, True, BLOCK_R)
        need = tl.minimum(K - (_count_keys(key_row, N, theta, last, False, BLOCK_R) - ties), ties)
        # cut: the lowest entry with `need` ties at or before it
        c_lo = tl.full([], 0, tl.int32)
        c_hi = tl.full([], 0, tl.int32) + last
        for _ in range(INDEX_STEPS):
            c_mid = (c_lo + c_hi) // 2
            enough = _count_keys(key_row, N, theta, c_mid, True, BLOCK_R) >= need
            c_hi = tl.where(enough, c_mid, c_hi)
            c_lo = tl.where(enough, c_lo, c_mid + 1)
        cut = tl.where(need > 0, c_lo, -1)
        # the kept entries, in entry order, at their prefix counts
        ckey_row = ckey_ptr + lt64 * stride_ct
        cid_row = cid_ptr + lt64 * stride_ct
        running = tl.full([], 0, tl.int32)
        for n0 in range(0, N, BLOCK_P):
            offs = n0 + offs_p
            ok = offs < N
            key = tl.load(key_row + offs, mask=ok, other=NONE_KEY)
            kept = ok & ((key > theta) | ((key == theta) & (offs <= cut)))
            k32 = kept.to(tl.int32)
            before = tl.sum(tl.where(offs_p[None, :] < offs_p[:, None], k32[None, :], 0), axis=1)
            pos = running + before
            tl.store(ckey_row + pos, key, mask=kept)
            tl.store(cid_row + pos, offs.to(tl.int64), mask=kept)
            running += _total(k32)
        for s0 in range(0, K, BLOCK_P):
            offs = s0 + offs_p
            tl.store(ckey_row + offs, tl.full([BLOCK_P], NONE_KEY, tl.int32), mask=(offs < K) & (offs >= running))


@triton.jit
def _rank_entries_kernel(
    ckey_ptr, cid_ptr, out_ptr,
    T0, TT, K,
    stride_ct, stride_ot,
    NUM_PROGRAMS: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
):
    pid = tl.program_id(0)
    for lt in range(pid, TT, NUM_PROGRAMS):
        lt64 = tl.cast(lt, tl.int64)
        ckey_row = ckey_ptr + lt64 * stride_ct
        out_row = out_ptr + (T0 + lt64) * stride_ot
        for i0 in range(0, K, BLOCK_I):
            offs_i = i0 + tl.arange(0, BLOCK_I)
            key_i = tl.load(ckey_row + offs_i, mask=offs_i < K, other=NONE_KEY)
            kept = key_i > NONE_KEY
            rank = tl.zeros([BLOCK_I], dtype=tl.int32)
            for j0 in range(0, K, BLOCK_J):
                offs_j = j0 + tl.arange(0, BLOCK_J)
                key_j = tl.load(ckey_row + offs_j, mask=offs_j < K, other=NONE_KEY)
                above = (key_j[None, :] > key_i[:, None]) | ((key_j[None, :] == key_i[:, None]) & (offs_j[None, :] < offs_i[:, None]))
                above = above & (key_j > NONE_KEY)[None, :]
                rank += tl.sum(above.to(tl.int32), axis=1)
            ids = tl.load(cid_ptr + lt64 * stride_ct + offs_i, mask=kept, other=-1)
            tl.store(out_row + rank, ids, mask=kept & (rank < K))


def plan_entry_keys(
    h: int, d: int, n: int, dtype: torch.dtype, ub: UnifiedBuffer, *, interpret: bool = False, packed: KVFormat | None = None,
) -> TilePlan:
    """Blocks of ``_entry_keys_kernel``: ``BLOCK_D`` the whole head (at least 16, the reduced axis), ``BLOCK_N``
    entries shrinking until the tiles fit (keys read from ``packed`` records where given)."""
    bd = max(REDUCE_MIN, next_power_of_2(d))
    xs = torch.empty((), dtype=dtype).element_size()

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bn = b["BLOCK_N"]
        return (
            Tile("table rows", (bn,), 8, loaded=True), Tile("valid", (bn,), 1), Tile("rows", (bn,), 8),
            Tile("keys", (bn, bd), xs, loaded=True), Tile("keys fp32", (bn, bd), 4),
            Tile("keys offsets", (bn, bd), 8), Tile("keys mask", (bn, bd), 1),
            Tile("q_h", (bd,), xs, loaded=True), Tile("q_h fp32", (bd,), 4),
            Tile("keys·q_h", (bn, bd), 4), Tile("dots", (bn,), 4), Tile("relu·w", (bn,), 4), Tile("score", (bn,), 4),
            Tile("key", (bn,), 4),
        ) + packed_read_tiles(bn, bd, packed)

    bn = interpreter_block(n, BLOCK_N_CAP, 1) if interpret else block(n, BLOCK_N_CAP)
    start = {"BLOCK_N": bn, "BLOCK_D": bd}
    shape = f"H={h}, D={d}, {str(dtype).removeprefix('torch.')}{'' if packed is None else ', ' + format_label(packed)}"
    return fit_blocks("indexer_topk", shape, ub, start, {"BLOCK_D": bd}, tiles)


def plan_select_entries(n: int, ub: UnifiedBuffer, *, interpret: bool = False) -> TilePlan:
    """Blocks of ``_select_entries_kernel``: ``BLOCK_R`` keys per counting step (a 1-D sum, at least 16) and
    ``BLOCK_P`` per compaction step (its ``[BLOCK_P, BLOCK_P]`` prefix triangle, at least 16)."""

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        br, bp = b["BLOCK_R"], b["BLOCK_P"]
        return (
            Tile("keys", (br,), 4, loaded=True), Tile("hits", (br,), 1), Tile("count", (br,), 4),
            Tile("entry ids", (br,), 4), Tile("key mask", (br,), 1),
            Tile("compact keys", (bp,), 4, loaded=True), Tile("kept", (bp,), 4),
            Tile("prefix triangle", (bp, bp), 4), Tile("prefix mask", (bp, bp), 1), Tile("positions", (bp,), 4),
            Tile("entry numbers", (bp,), 8),
        )

    if interpret:  # the counting passes cost per step: two steps per pass
        start = {"BLOCK_R": block(-(-n // 2), BLOCK_R_CAP, REDUCE_MIN), "BLOCK_P": interpreter_block(n, BLOCK_P_CAP)}
    else:
        start = {"BLOCK_R": block(n, BLOCK_R_CAP, REDUCE_MIN), "BLOCK_P": BLOCK_P_CAP}
    floors = {"BLOCK_R": REDUCE_MIN, "BLOCK_P": REDUCE_MIN}
    return fit_blocks("indexer_topk", "selection", ub, start, floors, tiles)


def plan_rank_entries(k: int, ub: UnifiedBuffer, *, interpret: bool = False) -> TilePlan:
    """Blocks of ``_rank_entries_kernel``: ``BLOCK_I`` kept entries ranked at once against ``BLOCK_J`` (16) others."""

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bi, bj = b["BLOCK_I"], b["BLOCK_J"]
        return (
            Tile("keys i", (bi,), 4, loaded=True), Tile("kept", (bi,), 1), Tile("rank", (bi,), 4),
            Tile("entry numbers", (bi,), 8, loaded=True), Tile("keys j", (bj,), 4, loaded=True),
            Tile("above", (bi, bj), 1), Tile("above int32", (bi, bj), 4), Tile("compare masks", (bi, bj), 1),
        )

    bi = interpreter_block(k, BLOCK_I_CAP) if interpret else block(k, BLOCK_I_CAP, REDUCE_MIN)
    start = {"BLOCK_I": bi, "BLOCK_J": interpreter_block(k, 64) if interpret else BLOCK_J_CAP}
    return fit_blocks("indexer_topk", f"ranking, k={k}", ub, start, {"BLOCK_I": REDUCE_MIN, "BLOCK_J": REDUCE_MIN}, tiles)


def chunk_tokens(t: int, n: int) -> int:
    """Tokens per chunk of ``indexer_topk``: its ``[chunk, n]`` scratch holds at most ``SCRATCH_ELEMENTS`` (one token
    at least)."""
    return max(1, min(t, SCRATCH_ELEMENTS // max(n, 1)))


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | PackedPool, table: torch.Tensor, token_seq: torch.Tensor,
    visible: torch.Tensor, scale: float, k: int,
) -> torch.Tensor:
    """``Kernels.indexer_topk`` for fp32/fp16/bf16 inputs with at least one token, entry and pick; ``keys`` a plain
    pool or a one-region packed one."""
    t, h, d = q.shape
    n = table.shape[1]
    kk = min(int(k), n)
    src = row_source(keys)
    wider = max(q.dtype, keys.dtype, key=lambda dt: torch.empty((), dtype=dt).element_size())
    ub = unified_buffer(q.device)
    interpret = interpreting()
    keys_plan = require_fit(plan_entry_keys(h, d, n, wider, ub, interpret=interpret, packed=src.format))
    select_plan = require_fit(plan_select_entries(n, ub, interpret=interpret))
    rank_plan = require_fit(plan_rank_entries(kk, ub, interpret=interpret))
    q, weights, table = (_rows_contiguous(x) for x in (q, weights, table))
    seq = token_seq.to(torch.int64).contiguous()
    vis = visible.to(torch.int64).contiguous()
    out = torch.full((t, k), -1, dtype=torch.int64, device=q.device)
    chunk = chunk_tokens(t, n)
    scratch = torch.empty(chunk, n, dtype=torch.int32, device=q.device)
    ckey = torch.empty(chunk, kk, dtype=torch.int32, device=q.device)
    cid = torch.empty(chunk, kk, dtype=torch.int64, device=q.device)
    programs = program_count(q.device)
    for t0 in range(0, t, chunk):
        tt = min(chunk, t - t0)
        _entry_keys_kernel[(programs,)](
            q, weights, src.data, table, seq, vis, scratch,
            t0, tt, h, d, n,
            q.stride(0), q.stride(1), weights.stride(0), src.stride, table.stride(0), scratch.stride(0),
            float(scale),
            **src.layout, NUM_PROGRAMS=programs, **keys_plan.blocks,
        )
        _select_entries_kernel[(programs,)](
            scratch, ckey, cid,
            tt, n, kk, max(1, n.bit_length()),
            scratch.stride(0), ckey.stride(0),
            NUM_PROGRAMS=programs, **select_plan.blocks,
        )
        _rank_entries_kernel[(programs,)](
            ckey, cid, out,
            t0, tt, kk,
            ckey.stride(0), out.stride(0),
            NUM_PROGRAMS=programs, **rank_plan.blocks,
        )
    return out


# ---- entry_attention ---------------------------------------------------------------------------


@triton.jit
def _absorb_rows(
    kv_ptr, row, q, run_max, run_sum, acc, offs_d, d_ok, stride_kv, scale,
    PACKED: tl.constexpr, FP4: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, ROPE: tl.constexpr, ROUND: tl.constexpr,
):
    """The running softmax after the rows ``row`` (``-1``: none) of ``kv``."""
    valid = row >= 0
    rows = tl.where(valid, row, 0).to(tl.int64)
    kv = _load_rows(kv_ptr, rows, valid, offs_d, d_ok, stride_kv, PACKED, FP4, SCALE, BLOCK, QUANT, ROPE_OFF, SCALE_OFF, ROPE, ROUND)
    s = tl.where(valid, tl.sum(kv * q[None, :], axis=1) * scale, float("-inf"))
    new_max = tl.maximum(run_max, tl.max(s, axis=0))
    keep = tl.exp(run_max - new_max)
    p = tl.exp(s - new_max)
    run_sum = run_sum * keep + tl.sum(p, axis=0)
    acc = acc * keep + tl.sum(p[:, None] * kv, axis=0)
    return new_max, run_sum, acc


@triton.jit
def _entry_attention_kernel(
    q_ptr, kv_ptr, idx_ptr, table_ptr, seq_ptr, vis_ptr, sinks_ptr, out_ptr,
    T, H, D, K, N,
    stride_qt, stride_qh, stride_kv, stride_it, stride_tb, stride_ot, stride_oh,
    scale,
    PACKED: tl.constexpr, FP4: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, ROPE: tl.constexpr, ROUND: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(pid, T * H, NUM_PROGRAMS):
        t = tl.cast(tile // H, tl.int64)
        h = tile % H
        q = tl.load(q_ptr + t * stride_qt + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        # the sink starts the running softmax: max = sink, sum = exp(0) = 1, no value
        run_max = tl.load(sinks_ptr + h).to(tl.float32)
        run_sum = tl.full([], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_N):
            offs = k0 + offs_n
            row = tl.load(idx_ptr + t * stride_it + offs, mask=offs < K, other=-1)
            run_max, run_sum, acc = _absorb_rows(
                kv_ptr, row, q, run_max, run_sum, acc, offs_d, d_ok, stride_kv, scale,
                PACKED, FP4, SCALE, BLOCK, QUANT, ROPE_OFF, SCALE_OFF, ROPE, ROUND,
            )
        seq = tl.load(seq_ptr + t).to(tl.int64)
        vis = tl.minimum(tl.load(vis_ptr + t), N)
        for n0 in range(0, vis, BLOCK_N):
            offs = n0 + offs_n
            row = tl.load(table_ptr + seq * stride_tb + offs, mask=offs < vis, other=-1)
            run_max, run_sum, acc = _absorb_rows(
                kv_ptr, row, q, run_max, run_sum, acc, offs_d, d_ok, stride_kv, scale,
                PACKED, FP4, SCALE, BLOCK, QUANT, ROPE_OFF, SCALE_OFF, ROPE, ROUND,
            )
        out = acc / run_sum
        tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def plan_entry_attention(
    d: int, dtype: torch.dtype, ub: UnifiedBuffer, *, interpret: bool = False, packed: KVFormat | None = None,
) -> TilePlan:
    """Blocks of ``_entry_attention_kernel``: ``BLOCK_D`` the whole head (at least 16), ``BLOCK_N`` rows shrinking
    until the tiles fit (to one row at V4's 512-wide head on the smallest UB, if need be; rows read from ``packed``
    records where given)."""
    bd = max(REDUCE_MIN, next_power_of_2(d))
    xs = torch.empty((), dtype=dtype).element_size()

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bn = b["BLOCK_N"]
        return (
            Tile("row indices", (bn,), 8, loaded=True), Tile("valid", (bn,), 1), Tile("rows", (bn,), 8),
            Tile("kv", (bn, bd), xs, loaded=True), Tile("kv fp32", (bn, bd), 4), Tile("kv offsets", (bn, bd), 8),
            Tile("kv mask", (bn, bd), 1), Tile("kv·q", (bn, bd), 4), Tile("p·kv", (bn, bd), 4),
            Tile("logits", (bn,), 4), Tile("p", (bn,), 4),
            Tile("q", (bd,), xs, loaded=True), Tile("q fp32", (bd,), 4), Tile("acc", (bd,), 4), Tile("out", (bd,), 4),
        ) + packed_read_tiles(bn, bd, packed)

    start = {"BLOCK_N": 4 if interpret else ATTENTION_BLOCK_CAP, "BLOCK_D": bd}
    shape = f"D={d}, {str(dtype).removeprefix('torch.')}{'' if packed is None else ', ' + format_label(packed)}"
    return fit_blocks("entry_attention", shape, ub, start, {"BLOCK_D": bd}, tiles)


def entry_attention(
    q: torch.Tensor, kv: torch.Tensor | PackedPool, indices: torch.Tensor, table: torch.Tensor, token_seq: torch.Tensor,
    visible: torch.Tensor, sinks: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``Kernels.entry_attention`` for fp32/fp16/bf16 ``q``/``kv`` with at least one token and pool row; ``kv`` a
    plain pool or a one-region packed one."""
    t, h, d = q.shape
    k, n = indices.shape[1], table.shape[1]
    src = row_source(kv)
    wider = max(q.dtype, kv.dtype, key=lambda dt: torch.empty((), dtype=dt).element_size())
    plan = require_fit(plan_entry_attention(d, wider, unified_buffer(q.device), interpret=interpreting(), packed=src.format))
    q = _rows_contiguous(q)
    indices = indices.to(torch.int64).contiguous()
    table = table.to(torch.int64).contiguous()
    seq = token_seq.to(torch.int64).contiguous()
    vis = visible.to(torch.int64).contiguous()
    sinks = sinks.to(torch.float32).contiguous()
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    programs = program_count(q.device)
    _entry_attention_kernel[(programs,)](
        q, src.data, indices, table, seq, vis, sinks, out,
        t, h, d, k, n,
        q.stride(0), q.stride(1), src.stride, indices.stride(0), table.stride(0), out.stride(0), out.stride(1),
        float(scale),
        **src.layout, NUM_PROGRAMS=programs, **plan.blocks,
    )
    return out


"""Lightning-indexer scores as a Triton-Ascend kernel.

Written to Triton-Ascend's constraints: a 1-D grid of one program per vector
core, each program walking its share of (token, candidate-block) tiles; no
atomics (every output element is written by exactly one program); all math in
fp32 after loading (the interpreter's bf16 arithmetic is not trustworthy, and
fp32 keeps the ranking stable). The head-dim reduction runs on the vector
cores, so the kernel has no ``tl.dot`` shape floor.

Each tile loads its candidates' keys once as a 2-D ``[BLOCK_K, D]`` tile and
walks the heads: ``Σ_d keys[k, d] · q_h[d]`` is a last-axis reduction of that
tile, ``D`` padded with zeros to at least ``REDUCE_MIN`` (16) lanes
(triton-ascend#2247: inner extents below 8 drop lanes on Ascend 950), and
``Σ_h w_h · relu(·)`` accumulates into a vector, with no reduction. The old
``[H, K, D]`` broadcast product is gone: at V4's 64 × 128 index heads it alone
took more than the 192 KiB unified buffer of an A2/A3 vector core, and 3-D
tile reductions are where triton-ascend#2291 miscompiles on 910B.
``BLOCK_K`` comes from the UB budget (``plan_indexer_scores``). A packed pool's
keys tile is decoded as it is loaded (``triton_ascend_kv_quant._load_rows``:
each channel's code byte and block scale gathered from the record), the rest of
the kernel unchanged.

V4.1's candidate blocks (``candidate_blocks``, the first level of its
two-level top-k) are two kernels, static shapes and no host sync, under the
same rules (no atomics, no 3-D tiles, reductions only along the last axis of a
tile at least 16 wide, blocks from the UB budget):

1. ``_block_keys_kernel`` walks (token, block-tile) tiles of ``[BLOCK_B blocks,
   BLOCK_C columns]``: each block's max over its columns (a last-axis max, V4.1's
   8 columns padded to 16 with ``-inf``), as an int32 key that orders like the
   float (``-0.0`` folded into ``+0.0``, which compare equal); the pinned block
   (the one holding entry ``visible − 1``) gets ``PINNED_KEY`` above every
   score, a ``-inf`` block ``NONE_KEY`` (never kept).
2. ``_select_blocks_kernel`` walks the rows. The selection is by rank with no
   sort: bisection over the int32 keys finds ``theta``, the ``topk_blocks``-th
   largest key (32 counting passes over the row's keys), and a second bisection
   over block indices finds the last block whose key equals ``theta`` still
   needed (ties go to the lower block index, as the reference's stable sort).
   Every count is a 1-D sum (``_total``); no cumulative scan is needed. It then
   writes each kept block's columns.
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
from .triton_ascend_kv_quant import _load_rows, format_label, packed_read_tiles, row_source
from .triton_ascend_mhc import _total, interpreter_block

#: most candidates per tile (more buys nothing once every vector core has several tiles)
BLOCK_K_CAP = 128

#: the key of a block that is never kept (a -inf block that is not pinned) and of the pinned block
NONE_KEY = tl.constexpr(-(2**31))
PINNED_KEY = tl.constexpr(2**31 - 1)
#: most columns of a block read or written at once, most blocks per tile, most keys counted at once
BLOCK_C_CAP, BLOCK_B_CAP, BLOCK_R_CAP = 64, 256, 4096


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, idx_ptr, out_ptr,
    T, H, D, K,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_ot,
    scale,
    PACKED: tl.constexpr, FP4: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, ROPE: tl.constexpr, ROUND: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    k_blocks = tl.cdiv(K, BLOCK_K)
    for tile in range(pid, T * k_blocks, NUM_PROGRAMS):
        t = tl.cast(tile // k_blocks, tl.int64)
        offs_k = (tile % k_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        idx = tl.load(idx_ptr + t * stride_it + offs_k, mask=k_ok, other=-1)
        valid = k_ok & (idx >= 0)
        rows = tl.where(valid, idx, 0).to(tl.int64)
        keys = _load_rows(
            keys_ptr, rows, valid, offs_d, d_ok, stride_kn,
            PACKED, FP4, SCALE, BLOCK, QUANT, ROPE_OFF, SCALE_OFF, ROPE, ROUND,
        )
        q_row = q_ptr + t * stride_qt
        w_row = w_ptr + t * stride_wt
        score = tl.zeros([BLOCK_K], dtype=tl.float32)
        for h in range(H):
            q = tl.load(q_row + h * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            dots = tl.sum(keys * q[None, :], axis=1)
            w = tl.load(w_row + h).to(tl.float32)
            score += w * tl.maximum(dots, 0.0)
        score = tl.where(valid, score * scale, float("-inf"))
        tl.store(out_ptr + t * stride_ot + offs_k, score, mask=k_ok)


def plan_indexer_scores(
    h: int, d: int, k: int, dtype: torch.dtype, ub: UnifiedBuffer, *, interpret: bool = False, packed: KVFormat | None = None,
) -> TilePlan:
    """Blocks of ``_indexer_scores_kernel`` for ``h`` heads of width ``d`` over ``k`` candidates within ``ub``
    (keys read from ``packed`` records where given).

    ``BLOCK_D`` covers the whole head dim (padded to at least 16: it is the
    reduced axis, and the keys tile is reused by every head); ``BLOCK_K``
    shrinks until the tiles fit.
    """
    bd = max(REDUCE_MIN, next_power_of_2(d))
    xs = torch.empty((), dtype=dtype).element_size()

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bk = b["BLOCK_K"]
        return (
            Tile("indices", (bk,), 8, loaded=True), Tile("valid", (bk,), 1), Tile("rows", (bk,), 8),
            Tile("keys", (bk, bd), xs, loaded=True), Tile("keys fp32", (bk, bd), 4),
            Tile("keys offsets", (bk, bd), 8), Tile("keys mask", (bk, bd), 1),
            Tile("q_h", (bd,), xs, loaded=True), Tile("q_h fp32", (bd,), 4),
            Tile("keys·q_h", (bk, bd), 4), Tile("dots", (bk,), 4), Tile("relu·w", (bk,), 4), Tile("score", (bk,), 4),
        ) + packed_read_tiles(bk, bd, packed)

    start = {"BLOCK_K": block(k, 4 if interpret else BLOCK_K_CAP), "BLOCK_D": bd}
    shape = f"H={h}, D={d}, {str(dtype).removeprefix('torch.')}{'' if packed is None else ', ' + format_label(packed)}"
    return fit_blocks("indexer_scores", shape, ub, start, {"BLOCK_D": bd}, tiles)


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | PackedPool, indices: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``Kernels.indexer_scores`` for fp32/fp16/bf16 inputs with at least one token and candidate; ``keys`` a
    plain pool or a one-region packed one."""
    t, h, d = q.shape
    k = indices.shape[1]
    src = row_source(keys)
    wider = max(q.dtype, keys.dtype, key=lambda dt: torch.empty((), dtype=dt).element_size())
    plan = require_fit(plan_indexer_scores(h, d, k, wider, unified_buffer(q.device), interpret=interpreting(), packed=src.format))
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    out = torch.empty(t, k, dtype=torch.float32, device=q.device)
    programs = program_count(q.device)
    _indexer_scores_kernel[(programs,)](
        q, weights, src.data, indices, out,
        t, h, d, k,
        q.stride(0), q.stride(1), weights.stride(0), src.stride, indices.stride(0), out.stride(0),
        float(scale),
        **src.layout,
        NUM_PROGRAMS=programs,
        **plan.blocks,
    )
    return out


# ---- candidate blocks (V4.1) ----------------------------------------------------------------


@triton.jit
def _block_keys_kernel(
    scores_ptr, visible_ptr, key_ptr,
    T, N, NB, BS,
    stride_st, stride_kt,
    NUM_PROGRAMS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    b_tiles = tl.cdiv(NB, BLOCK_B)
    for tile in range(pid, T * b_tiles, NUM_PROGRAMS):
        t = tl.cast(tile // b_tiles, tl.int64)
        b = (tile % b_tiles) * BLOCK_B + tl.arange(0, BLOCK_B)
        b_ok = b < NB
        best = tl.full([BLOCK_B], float("-inf"), tl.float32)
        for c0 in range(0, BS, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            col = b[:, None] * BS + c[None, :]
            ok = b_ok[:, None] & (c < BS)[None, :] & (col < N)
            s = tl.load(scores_ptr + t * stride_st + col, mask=ok, other=float("-inf")).to(tl.float32)
            best = tl.maximum(best, tl.max(s, axis=1))
        best = tl.where(best == 0.0, 0.0, best)
        bits = best.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        key = tl.where(best == float("-inf"), NONE_KEY, key)
        vis = tl.load(visible_ptr + t)
        pinned = (vis > 0) & (b == (vis - 1) // BS)
        key = tl.where(pinned, PINNED_KEY, key)
        tl.store(key_ptr + t * stride_kt + b, key, mask=b_ok)


@triton.jit
def _count_keys(key_row, NB, theta, cut, EQUAL: tl.constexpr, BLOCK_R: tl.constexpr):
    """How many keys of blocks ``<= cut`` are ``>= theta`` (``== theta`` with ``EQUAL``); ``theta > NONE_KEY``."""
    acc = tl.zeros([BLOCK_R], dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_R):
        b = b0 + tl.arange(0, BLOCK_R)
        key = tl.load(key_row + b, mask=b < NB, other=NONE_KEY)
        hit = (key == theta) if EQUAL else (key >= theta)
        acc += (hit & (b <= cut)).to(tl.int32)
    return _total(acc)


@triton.jit
def _select_blocks_kernel(
    key_ptr, out_ptr,
    T, N, NB, BS, K, INDEX_STEPS,
    stride_kt, stride_ot,
    NUM_PROGRAMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    for t in range(pid, T, NUM_PROGRAMS):
        t64 = tl.cast(t, tl.int64)
        key_row = key_ptr + t64 * stride_kt
        last = NB - 1
        # theta: the largest key with at least K keys >= it; the smallest keepable key when fewer are keepable
        lo = tl.full([], NONE_KEY + 1, tl.int64)
        hi = tl.full([], PINNED_KEY, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            take = _count_keys(key_row, NB, mid.to(tl.int32), last, False, BLOCK_R) >= K
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid - 1)
        theta = lo.to(tl.int32)
        ties = _count_keys(key_row, NB, theta, last, True, BLOCK_R)
        need = tl.minimum(K - (_count_keys(key_row, NB, theta, last, False, BLOCK_R) - ties), ties)
        # cut: the lowest block index with `need` ties at or before it
        c_lo = tl.full([], 0, tl.int32)
        c_hi = tl.full([], 0, tl.int32) + last
        for _ in range(INDEX_STEPS):
            c_mid = (c_lo + c_hi) // 2
            enough = _count_keys(key_row, NB, theta, c_mid, True, BLOCK_R) >= need
            c_hi = tl.where(enough, c_mid, c_hi)
            c_lo = tl.where(enough, c_lo, c_mid + 1)
        cut = tl.where(need > 0, c_lo, -1)
        out_row = out_ptr + t64 * stride_ot
        for b0 in range(0, NB, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            b_ok = b < NB
            key = tl.load(key_row + b, mask=b_ok, other=NONE_KEY)
            kept = (key > theta) | ((key == theta) & (b <= cut))
            for c0 in range(0, BS, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)
                col = b[:, None] * BS + c[None, :]
                ok = b_ok[:, None] & (c < BS)[None, :] & (col < N)
                flag = (kept[:, None] & ok).to(tl.uint8)
                tl.store(out_row + col, flag, mask=ok)


def _column_block(block_size: int, interpret: bool) -> int:
    """Columns of a block read at once: the whole block up to 64 (16 at least: the max reduces them)."""
    return block(block_size, REDUCE_MIN if interpret else BLOCK_C_CAP, REDUCE_MIN)


def plan_candidate_keys(
    blocks: int, block_size: int, dtype: torch.dtype, ub: UnifiedBuffer, *, interpret: bool = False
) -> TilePlan:
    """Blocks of ``_block_keys_kernel`` for rows of ``blocks`` blocks: ``BLOCK_C`` covers a block's columns
    (16 to 64), ``BLOCK_B`` shrinks until the tiles fit."""
    bc = _column_block(block_size, interpret)
    xs = torch.empty((), dtype=dtype).element_size()

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bb = b["BLOCK_B"]
        return (
            Tile("scores", (bb, bc), xs, loaded=True), Tile("scores fp32", (bb, bc), 4),
            Tile("column offsets", (bb, bc), 4), Tile("column mask", (bb, bc), 1),
            Tile("block max", (bb,), 4), Tile("best", (bb,), 4), Tile("bits", (bb,), 4), Tile("key", (bb,), 4),
            Tile("pinned", (bb,), 1), Tile("block ids", (bb,), 4),
        )

    bb = interpreter_block(blocks, BLOCK_B_CAP, 1) if interpret else block(blocks, BLOCK_B_CAP)
    shape = f"block maxima, block {block_size}, {str(dtype).removeprefix('torch.')}"
    return fit_blocks("candidate_blocks", shape, ub, {"BLOCK_B": bb, "BLOCK_C": bc}, {"BLOCK_C": bc}, tiles)


def plan_candidate_select(blocks: int, block_size: int, ub: UnifiedBuffer, *, interpret: bool = False) -> TilePlan:
    """Blocks of ``_select_blocks_kernel`` for rows of ``blocks`` blocks: ``BLOCK_R`` keys per counting step
    (a 1-D sum, at least 16), ``BLOCK_B`` blocks of ``BLOCK_C`` columns per write; the first two shrink to fit."""
    bc = _column_block(block_size, interpret)

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        br, bb = b["BLOCK_R"], b["BLOCK_B"]
        return (
            Tile("keys", (br,), 4, loaded=True), Tile("hits", (br,), 1), Tile("count", (br,), 4),
            Tile("block ids", (br,), 4), Tile("key mask", (br,), 1),
            Tile("write keys", (bb,), 4, loaded=True), Tile("kept", (bb,), 1),
            Tile("column offsets", (bb, bc), 4), Tile("column mask", (bb, bc), 1), Tile("flags", (bb, bc), 1),
        )

    if interpret:  # the 32 counting passes cost per step: two steps per pass
        start = {"BLOCK_R": block(-(-blocks // 2), BLOCK_R_CAP, REDUCE_MIN), "BLOCK_B": interpreter_block(blocks, BLOCK_B_CAP, 1)}
    else:
        start = {"BLOCK_R": block(blocks, BLOCK_R_CAP, REDUCE_MIN), "BLOCK_B": block(blocks, BLOCK_B_CAP)}
    floors = {"BLOCK_R": REDUCE_MIN, "BLOCK_C": bc}
    return fit_blocks("candidate_blocks", f"selection, block {block_size}", ub, {**start, "BLOCK_C": bc}, floors, tiles)


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """``Kernels.candidate_blocks`` for fp32/fp16/bf16 ``scores`` of at least one row and one entry."""
    t, n = scores.shape
    nb = -(-n // block_size)
    ub = unified_buffer(scores.device)
    keys_plan = require_fit(plan_candidate_keys(nb, block_size, scores.dtype, ub, interpret=interpreting()))
    select_plan = require_fit(plan_candidate_select(nb, block_size, ub, interpret=interpreting()))
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    visible = visible.to(torch.int64).contiguous()
    keys = torch.empty(t, nb, dtype=torch.int32, device=scores.device)
    out = torch.empty(t, n, dtype=torch.bool, device=scores.device)
    programs = program_count(scores.device)
    _block_keys_kernel[(programs,)](
        scores, visible, keys,
        t, n, nb, block_size,
        scores.stride(0), keys.stride(0),
        NUM_PROGRAMS=programs,
        **keys_plan.blocks,
    )
    _select_blocks_kernel[(programs,)](
        keys, out.view(torch.uint8),
        t, n, nb, block_size, min(int(topk_blocks), nb), max(1, nb.bit_length()),
        keys.stride(0), out.stride(0),
        NUM_PROGRAMS=programs,
        **select_plan.blocks,
    )
    return out

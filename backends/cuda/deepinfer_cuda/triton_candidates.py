"""V4.1's candidate blocks (the first level of its two-level top-k) as two kernels, without a host sync.

1. ``_block_max_kernel``: a tile of blocks of one row; each block's max over
   its columns, turned into an int32 key that orders like the float (``-0.0``
   folded into ``+0.0`` so the two tie, as they compare equal), with the pinned
   block (the one holding entry ``visible − 1``) at ``INT32_MAX`` above every
   score and a ``-inf`` block at ``INT32_MIN`` (never kept).
2. ``_select_kernel``: one program per row (a few under the interpreter)
   finds the ``topk_blocks``-th largest key by bisection over the int32 range
   (32 counting passes over the row's keys), keeps the blocks above it and, of
   those equal to it, the lowest-indexed ones still needed (a running prefix
   count), and writes the column mask.

Shapes are static (``T``, ``N``) and nothing is read back to the host, so a
decode step that calls it can be captured as a graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, next_power_of_2, num_warps_for, unit_inner

#: the key of a block that is never kept (a -inf block that is not pinned) and of the pinned block
NONE_KEY = tl.constexpr(-(2**31))
PINNED_KEY = tl.constexpr(2**31 - 1)


@triton.jit
def _block_max_kernel(
    scores_ptr, visible_ptr, key_ptr, N, NB, BS, stride_s, stride_k,
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    b_ok = b < NB
    best = tl.full([BLOCK_B], float("-inf"), tl.float32)
    for c0 in range(0, BS, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        col = b[:, None] * BS + c[None, :]
        ok = b_ok[:, None] & (c < BS)[None, :] & (col < N)
        s = tl.load(scores_ptr + t * stride_s + col, mask=ok, other=float("-inf")).to(tl.float32)
        best = tl.maximum(best, tl.max(s, axis=1))
    best = tl.where(best == 0.0, 0.0, best)  # -0.0 -> +0.0
    bits = best.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = tl.where(best == float("-inf"), tl.full([BLOCK_B], NONE_KEY, tl.int32), key)
    vis = tl.load(visible_ptr + t)
    pinned = (vis > 0) & (b == (vis - 1) // BS)
    key = tl.where(pinned, tl.full([BLOCK_B], PINNED_KEY, tl.int32), key)
    tl.store(key_ptr + t * stride_k + b, key, mask=b_ok)


@triton.jit
def _count_at_least(key_ptr, rows, r_ok, NB, theta, stride_k, BLOCK_R: tl.constexpr):
    """How many keys of each row are ``>= theta`` (per row, an int64 above ``NONE_KEY``)."""
    count = tl.zeros(theta.shape, tl.int32)
    for b0 in range(0, NB, BLOCK_R):
        b = b0 + tl.arange(0, BLOCK_R)
        key = tl.load(key_ptr + rows[:, None] * stride_k + b[None, :], mask=r_ok[:, None] & (b < NB)[None, :], other=NONE_KEY)
        count += tl.sum((key.to(tl.int64) >= theta[:, None]).to(tl.int32), axis=1)
    return count


@triton.jit
def _select_kernel(
    key_ptr, out_ptr, T, N, NB, BS, K, stride_k, stride_o,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    r_ok = rows < T
    # the range of each row's keepable keys (empty, lo > hi, when the row has none)
    lo = tl.full([BLOCK_T], PINNED_KEY, tl.int64)
    hi = tl.full([BLOCK_T], NONE_KEY, tl.int64)
    for b0 in range(0, NB, BLOCK_R):
        b = b0 + tl.arange(0, BLOCK_R)
        key = tl.load(key_ptr + rows[:, None] * stride_k + b[None, :], mask=r_ok[:, None] & (b < NB)[None, :],
                      other=NONE_KEY).to(tl.int64)
        lo = tl.minimum(lo, tl.min(tl.where(key > NONE_KEY, key, PINNED_KEY), axis=1))
        hi = tl.maximum(hi, tl.max(key, axis=1))
    # theta (in lo): the largest key with at least K keys >= it, the K-th largest (the smallest when fewer are keepable)
    for _ in range(32):
        mid = lo + (hi - lo + 1) // 2
        take = _count_at_least(key_ptr, rows, r_ok, NB, mid, stride_k, BLOCK_R) >= K
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    need = K - _count_at_least(key_ptr, rows, r_ok, NB, lo + 1, stride_k, BLOCK_R)
    # keep every key above theta and, in block order, the first `need` equal to it; write their columns
    seen = tl.zeros([BLOCK_T], tl.int32)
    for b0 in range(0, NB, BLOCK_F):
        b = b0 + tl.arange(0, BLOCK_F)
        ok = r_ok[:, None] & (b < NB)[None, :]
        key = tl.load(key_ptr + rows[:, None] * stride_k + b[None, :], mask=ok, other=NONE_KEY).to(tl.int64)
        keepable = key > NONE_KEY
        tie = keepable & (key == lo[:, None])
        order = seen[:, None] + tl.cumsum(tie.to(tl.int32), axis=1)
        kept = keepable & ((key > lo[:, None]) | (tie & (order <= need[:, None])))
        seen += tl.sum(tie.to(tl.int32), axis=1)
        for c0 in range(0, BS, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            col = b[:, None] * BS + c[None, :]
            col_ok = ok[:, :, None] & ((c < BS)[None, :] & (col < N))[None, :, :]
            flag = tl.broadcast_to(kept[:, :, None], [BLOCK_T, BLOCK_F, BLOCK_C]).to(tl.uint8)
            tl.store(out_ptr + rows[:, None, None] * stride_o + col[None, :, :], flag, mask=col_ok)


def _column_chunk(block_size: int) -> int:
    """Columns of a block read (or written) at once: the whole block up to 64 (V4.1's is 8)."""
    return min(next_power_of_2(block_size), 64)


def block_max_tiles(block_size: int) -> Tiles:
    """Blocks × their columns, about 4096 scores a program (4 blocks under the interpreter)."""
    block_c = _column_chunk(block_size)
    block_b = choose(max(16, 4096 // block_c), 64)
    return Tiles({"BLOCK_B": block_b, "BLOCK_C": block_c}, num_warps=num_warps_for(block_b * block_c))


def select_tiles(blocks: int, block_size: int) -> Tiles:
    """One row a program, its block keys counted in chunks of up to 8192 (a whole row at V4.1's 65536 entries in
    blocks of 8) and columns written about 4096 at a time. Under the interpreter, whose cost is per operation,
    4 rows a program, 128 keys and 32 blocks at a time (small rows still cross chunks)."""
    block_c = _column_chunk(block_size)
    block_r = min(next_power_of_2(blocks), choose(8192, 128))
    block_f = min(next_power_of_2(blocks), choose(max(16, 4096 // block_c), 32))
    block_t = choose(1, 4)
    return Tiles({"BLOCK_T": block_t, "BLOCK_R": block_r, "BLOCK_F": block_f, "BLOCK_C": block_c},
                 num_warps=num_warps_for(block_t * max(block_r, block_f * block_c)))


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """``Kernels.candidate_blocks`` on the device for ``T >= 1`` rows of ``N >= 1`` entries."""
    if scores.dim() != 2 or tuple(visible.shape) != (scores.shape[0],):
        raise ValueError(f"candidate_blocks: need scores [T, N] and visible [T], got {tuple(scores.shape)} and {tuple(visible.shape)}")
    tokens, n = scores.shape
    blocks = triton.cdiv(n, block_size)
    scores = unit_inner(scores)
    visible = visible.to(torch.int64).contiguous()
    keys = torch.empty(tokens, blocks, dtype=torch.int32, device=scores.device)
    out = torch.empty(tokens, n, dtype=torch.bool, device=scores.device)
    first = block_max_tiles(block_size)
    _block_max_kernel[(tokens, triton.cdiv(blocks, first.blocks["BLOCK_B"]))](
        scores, visible, keys, n, blocks, block_size, scores.stride(0), keys.stride(0), **first.kwargs(),
    )
    select = select_tiles(blocks, block_size)
    _select_kernel[(triton.cdiv(tokens, select.blocks["BLOCK_T"]),)](
        keys, out.view(torch.uint8), tokens, n, blocks, block_size, int(topk_blocks), keys.stride(0), out.stride(0),
        **select.kwargs(),
    )
    return out

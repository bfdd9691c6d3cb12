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
``BLOCK_K`` comes from the UB budget (``plan_indexer_scores``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (
    REDUCE_MIN, Tile, TilePlan, UnifiedBuffer, block, fit_blocks, interpreting, next_power_of_2, program_count, require_fit,
    unified_buffer,
)

#: most candidates per tile (more buys nothing once every vector core has several tiles)
BLOCK_K_CAP = 128


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, idx_ptr, out_ptr,
    T, H, D, K,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_ot,
    scale,
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
        keys = tl.load(
            keys_ptr + rows[:, None] * stride_kn + offs_d[None, :],
            mask=valid[:, None] & d_ok[None, :], other=0.0,
        ).to(tl.float32)
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


def plan_indexer_scores(h: int, d: int, k: int, dtype: torch.dtype, ub: UnifiedBuffer, *, interpret: bool = False) -> TilePlan:
    """Blocks of ``_indexer_scores_kernel`` for ``h`` heads of width ``d`` over ``k`` candidates within ``ub``.

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
        )

    start = {"BLOCK_K": block(k, 4 if interpret else BLOCK_K_CAP), "BLOCK_D": bd}
    shape = f"H={h}, D={d}, {str(dtype).removeprefix('torch.')}"
    return fit_blocks("indexer_scores", shape, ub, start, {"BLOCK_D": bd}, tiles)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """``Kernels.indexer_scores`` for fp32/fp16/bf16 inputs with at least one token and candidate."""
    t, h, d = q.shape
    k = indices.shape[1]
    wider = max(q.dtype, keys.dtype, key=lambda dt: torch.empty((), dtype=dt).element_size())
    plan = require_fit(plan_indexer_scores(h, d, k, wider, unified_buffer(q.device), interpret=interpreting()))
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    out = torch.empty(t, k, dtype=torch.float32, device=q.device)
    programs = program_count(q.device)
    _indexer_scores_kernel[(programs,)](
        q, weights, keys, indices, out,
        t, h, d, k,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), indices.stride(0), out.stride(0),
        float(scale),
        NUM_PROGRAMS=programs,
        **plan.blocks,
    )
    return out

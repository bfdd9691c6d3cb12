"""Lightning-indexer scores as a Triton-Ascend kernel.

Written to Triton-Ascend's constraints: a 1-D grid of one program per vector
core, each program walking its share of (token, candidate-block) tiles; no
atomics (every output element is written by exactly one program); all math in
fp32 after loading (the interpreter's bf16 arithmetic is not trustworthy, and
fp32 keeps the ranking stable). The head-dim reduction is a broadcast multiply
and sum on the vector cores, so the kernel has no ``tl.dot`` shape floor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import block, interpreting, program_count


@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, idx_ptr, out_ptr,
    T, H, D, K,
    stride_qt, stride_qh, stride_wt, stride_kn, stride_it, stride_ot,
    scale,
    NUM_PROGRAMS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    k_blocks = tl.cdiv(K, BLOCK_K)
    for tile in range(pid, T * k_blocks, NUM_PROGRAMS):
        t = tl.cast(tile // k_blocks, tl.int64)
        offs_k = (tile % k_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        idx = tl.load(idx_ptr + t * stride_it + offs_k, mask=k_ok, other=-1)
        valid = k_ok & (idx >= 0)
        rows = tl.where(valid, idx, 0).to(tl.int64)
        score = tl.zeros([BLOCK_K], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < H
            dots = tl.zeros([BLOCK_H, BLOCK_K], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs_d = d0 + tl.arange(0, BLOCK_D)
                d_ok = offs_d < D
                q = tl.load(
                    q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0,
                ).to(tl.float32)
                kv = tl.load(
                    keys_ptr + rows[:, None] * stride_kn + offs_d[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0,
                ).to(tl.float32)
                dots += tl.sum(q[:, None, :] * kv[None, :, :], axis=2)
            w = tl.load(w_ptr + t * stride_wt + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            score += tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0)
        score = tl.where(valid, score * scale, float("-inf"))
        tl.store(out_ptr + t * stride_ot + offs_k, score, mask=k_ok)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, scale: float) -> torch.Tensor:
    """``Kernels.indexer_scores`` for fp32/fp16/bf16 inputs with at least one token and candidate."""
    t, h, d = q.shape
    k = indices.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    weights = weights if weights.stride(-1) == 1 else weights.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    out = torch.empty(t, k, dtype=torch.float32, device=q.device)
    programs = program_count(q.device)
    small = interpreting()
    _indexer_scores_kernel[(programs,)](
        q, weights, keys, indices, out,
        t, h, d, k,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), indices.stride(0), out.stride(0),
        float(scale),
        NUM_PROGRAMS=programs,
        BLOCK_H=block(h, 4 if small else 16),
        BLOCK_K=block(k, 4 if small else 32),
        BLOCK_D=block(d, 8 if small else 64),
    )
    return out

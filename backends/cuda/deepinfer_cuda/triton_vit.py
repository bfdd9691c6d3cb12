"""The vision tower's attention (``vit_attention``) as one Triton kernel, flash-attention style over a packed batch.

A program takes ``BLOCK_M`` consecutive tokens of the packed sequence and one
head. Each token finds its image by counting the boundaries ``cu[1..n]`` at or
before it (no host read of the lengths, no per-image launch); the tile then walks
the keys from the first image it touches to the end of the last, ``BLOCK_N`` at a
time, with an online softmax in fp32 (log2 domain), and a key counts for a token
only inside the token's own image. A tile inside one image (the usual case: images
are hundreds of patches) reads exactly its image's keys; a tile that straddles a
boundary reads both images' keys and masks across.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, next_power_of_2
from .triton_common import dot_operands

#: log2(e): scores are kept in the log2 domain so the softmax uses exp2
LOG2E = 1.4426950408889634


@triton.jit
def _vit_attention_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, out_ptr, T, D, NSEG, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < T
    seg = tl.zeros([BLOCK_M], tl.int32)
    for j in range(1, NSEG + 1):
        seg += (tl.load(cu_ptr + j).to(tl.int32) <= rows).to(tl.int32)
    seg = tl.minimum(seg, NSEG - 1)
    lo = tl.load(cu_ptr + seg).to(tl.int32)
    hi = tl.load(cu_ptr + seg + 1).to(tl.int32)
    k_start = tl.min(tl.where(r_ok, lo, T), axis=0)
    k_end = tl.max(tl.where(r_ok, hi, 0), axis=0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    rows64 = rows.to(tl.int64)
    q = tl.load(q_ptr + rows64[:, None] * stride_qt + h * stride_qh + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(k_start, k_end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        c_ok = cols < k_end
        cols64 = cols.to(tl.int64)
        kt = tl.load(k_ptr + cols64[:, None] * stride_kt + h * stride_kh + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale
        mine = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        s = tl.where(mine, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: avoid inf - inf
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + cols64[:, None] * stride_vt + h * stride_vh + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), vt, input_precision=PREC)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])


def vit_attention_tiles(dim: int, dtype: torch.dtype) -> Tiles:
    """64 tokens by 64 keys a tile (MMA-sized; 16 by 16 under the interpreter, so small images cross tiles) and the
    whole head dim (at least 16: ``tl.dot`` needs it for 16-bit operands); fp32 operands on 8 warps, which on 4
    spill their tiles to local memory."""
    warps = 8 if dtype == torch.float32 else 4
    return Tiles({"BLOCK_M": choose(64, 16), "BLOCK_N": choose(64, 16), "BLOCK_D": max(16, next_power_of_2(dim))},
                 num_warps=choose(warps, 1), num_stages=choose(2, 1))


def vit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """``Kernels.vit_attention`` on ``[T, H, D]`` tensors with unit stride along ``D``."""
    t, h, d = q.shape
    if k.shape != q.shape or v.shape != q.shape or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"vit_attention: need q, k, v [T, H, D] alike and cu_seqlens [n + 1]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(cu_seqlens.shape)}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q)
    dot, prec = dot_operands(q.dtype)
    tiles = vit_attention_tiles(d, q.dtype)
    grid = (triton.cdiv(t, tiles.blocks["BLOCK_M"]), h)
    _vit_attention_kernel[grid](
        q, k, v, cu_seqlens, out, t, d, cu_seqlens.shape[0] - 1, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        DOT=dot, PREC=prec, **tiles.kwargs(),
    )
    return out

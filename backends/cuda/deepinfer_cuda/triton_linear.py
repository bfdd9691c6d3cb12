"""The dense linear of batch-invariant mode: one fixed tile shape, K walked in one order, no split-K.

cuBLAS chooses its algorithm (and split-K) from the problem's shape, so a row's
bits move with the batch size. This GEMM gives every output tile the same
program whatever ``M``: each row's dot products accumulate over K in steps of
``BLOCK_K`` in the same order, in fp32, whichever tile the row lands in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose
from .triton_common import dot_operands


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o,
    DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``x @ wᵀ`` over the whole of K."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    m64, n64 = m.to(tl.int64), n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(x_ptr + m64[:, None] * stride_x + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + n64[None, :] * stride_w + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a.to(DOT), b.to(DOT), input_precision=PREC)
    tl.store(out_ptr + m64[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def linear_tiles() -> Tiles:
    """The one tile shape of every launch (small blocks under the interpreter)."""
    return choose(Tiles({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
                  Tiles({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``Kernels.linear`` in batch-invariant mode on the device: ``x`` ``[..., K]``, ``weight`` ``[N, K]``."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"linear: need x [..., {k}] for a weight [{n}, {k}]; got {tuple(x.shape)}")
    flat = x.reshape(-1, k)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = flat.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        tiles = linear_tiles()
        dot, prec = dot_operands(x.dtype)
        grid = (triton.cdiv(m, tiles.blocks["BLOCK_M"]), triton.cdiv(n, tiles.blocks["BLOCK_N"]))
        _linear_kernel[grid](flat, weight, out, m, n, k, flat.stride(0), weight.stride(0), out.stride(0),
                             DOT=dot, PREC=prec, **tiles.kwargs())
    return out.view(*x.shape[:-1], n)

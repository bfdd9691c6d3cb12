"""The orthonormal Walsh–Hadamard transform of rows (the V4 indexer's rotation) as one matmul per tile of rows.

A program takes ``BLOCK_T`` rows and multiplies them by the ``±1`` Sylvester
matrix built in registers, ``H[i, j] = (−1)^popcount(i & j)``, then by
``d^-1/2``: no matrix in memory, no host work (so a captured graph needs no
cached matrix), the upcast and the downcast fused. The ``±1`` entries are
exact in every operand dtype, so 16-bit rows run on tensor cores with exact
products and fp32 sums; fp32 rows use exact (``ieee``) products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, next_power_of_2, rows
from .triton_common import dot_operands

#: the widest rows the kernel transforms (V4's indexer keys: its ``±1`` matrix, ``d × d``, is a ``tl.dot`` operand,
#: 64 KB in fp32); wider rows run the reference
MAX_WIDTH = 128


@triton.jit
def _hadamard_kernel(
    x_ptr, out_ptr, T, D, stride_x, stride_o, inv_sqrt,
    DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, BLOCK_D)
    mask = (t < T)[:, None] & (i < D)[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_x + i[None, :], mask=mask, other=0.0).to(DOT)
    # the parity of i & j, folded down to one bit
    v = i[:, None] & i[None, :]
    v ^= v >> 8
    v ^= v >> 4
    v ^= v >> 2
    v ^= v >> 1
    h = tl.where((v & 1) == 0, 1.0, -1.0)
    h = tl.where((i < D)[:, None] & (i < D)[None, :], h, 0.0).to(DOT)
    y = tl.dot(x, h, input_precision=PREC) * inv_sqrt
    tl.store(out_ptr + t[:, None] * stride_o + i[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def hadamard_tiles(width: int) -> Tiles:
    """32 rows per program (4 under the interpreter) by the whole (power-of-two, at least 16) width, on 4 warps."""
    return Tiles({"BLOCK_T": choose(32, 4), "BLOCK_D": max(16, next_power_of_2(width))}, num_warps=choose(4, 1))


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``Kernels.hadamard`` on the device for ``x`` ``[..., d]``, ``d`` a power of two up to ``MAX_WIDTH``, at least one row."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1) or d > MAX_WIDTH:
        raise ValueError(f"hadamard: the kernel takes power-of-two widths up to {MAX_WIDTH}; got {d}")
    flat = rows(x, d)
    n = flat.shape[0]
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    tiles = hadamard_tiles(d)
    dot, prec = dot_operands(x.dtype)
    _hadamard_kernel[(triton.cdiv(n, tiles.blocks["BLOCK_T"]),)](
        flat, out, n, d, flat.stride(0), out.stride(0), d**-0.5, DOT=dot, PREC=prec, **tiles.kwargs(),
    )
    return out.view(x.shape)

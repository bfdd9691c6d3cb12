"""Partial interleaved RoPE in one pass: each program copies the pass-through channels and rotates the rope pairs.

A program handles one token and a block of heads. Loads and stores are
contiguous along the head dim; each rope lane also reads its pair partner
(``r ^ 1`` within the rope slice), which the same cache lines already hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, next_power_of_2, num_warps_for, unit_inner
from .triton_common import accumulator

#: values one program holds at once (heads x channels)
_TILE = 4096


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, H, D, NOPE,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_ct, stride_st,
    INVERSE: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    x_base = x_ptr + t * stride_xt + heads[:, None].to(tl.int64) * stride_xh
    o_base = out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh
    for start in range(0, D, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        mask = head_ok[:, None] & (d < D)[None, :]
        x = tl.load(x_base + d[None, :], mask=mask, other=0.0).to(ACC)
        r = d - NOPE  # index inside the rope slice; negative for pass-through channels
        in_rope = (r >= 0) & (d < D)
        r = tl.where(in_rope, r, 0)
        c = tl.load(cos_ptr + t * stride_ct + r // 2, mask=in_rope, other=1.0).to(ACC)
        s = tl.load(sin_ptr + t * stride_st + r // 2, mask=in_rope, other=0.0).to(ACC)
        partner = tl.load(x_base + (NOPE + (r ^ 1))[None, :], mask=mask & in_rope[None, :], other=0.0).to(ACC)
        # even lane: x0·c − x1·s; odd lane: x1·c + x0·s (the inverse negates s)
        even = (r % 2) == 0
        if INVERSE:
            signed_s = tl.where(even, s, -s)
        else:
            signed_s = tl.where(even, -s, s)
        y = tl.where(in_rope[None, :], x * c[None, :] + partner * signed_s[None, :], x)
        tl.store(o_base + d[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def rope_tiles(heads: int, dim: int) -> Tiles:
    """Up to 1024 channels per step and as many heads as keep a program near ``_TILE`` values."""
    block_d = min(next_power_of_2(dim), choose(1024, 32))
    block_h = max(1, min(next_power_of_2(heads), choose(_TILE, 64) // block_d))
    return Tiles({"BLOCK_H": block_h, "BLOCK_D": block_d}, num_warps=num_warps_for(block_h * block_d))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``Kernels.rope`` on the device; ``x`` is ``[T, D]`` or ``[T, H, D]`` with ``T >= 1`` and a non-empty rope slice."""
    if x.dim() not in (2, 3):
        raise ValueError(f"rope: x must be [T, D] or [T, H, D], got shape {tuple(x.shape)}")
    tokens, dim = x.shape[0], x.shape[-1]
    half = cos.shape[-1]
    if tuple(cos.shape) != (tokens, half) or tuple(sin.shape) != (tokens, half):
        raise ValueError(
            f"rope: cos/sin must both be [T={tokens}, R/2], got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if 2 * half > dim:
        raise ValueError(f"rope: rope width 2·{half} exceeds the head dim {dim}")
    x3 = x if x.dim() == 3 else x[:, None, :]
    x3 = unit_inner(x3)
    cos = unit_inner(cos)
    sin = unit_inner(sin)
    heads = x3.shape[1]
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    tiles = rope_tiles(heads, dim)
    grid = (tokens, triton.cdiv(heads, tiles.blocks["BLOCK_H"]))
    _rope_kernel[grid](
        x3, cos, sin, out, heads, dim, dim - 2 * half,
        x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        INVERSE=bool(inverse), ACC=accumulator(x.dtype), **tiles.kwargs(),
    )
    return out.view(x.shape)

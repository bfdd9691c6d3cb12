"""Cache writes: rows of values scattered into pool rows by slot, ``-1`` slots skipped, on the device.

One program copies one value row (a block of its columns) into row
``slots[i]`` of the pool; values of another dtype are cast by torch first, so
the stored bits equal the reference's. Skipping
``-1`` rows in the kernel avoids the reference's boolean-mask indexing, which
waits on the device to learn how many rows survive.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, next_power_of_2, num_warps_for, rows


@triton.jit
def _cache_write_kernel(pool_ptr, slots_ptr, values_ptr, N, W, stride_p, stride_v, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + i)
    # a skipped row copies no columns (a scalar limit, not a scalar mask, keeps the interpreter happy)
    ok = c < tl.where((slot >= 0) & (slot < N), W, 0)
    v = tl.load(values_ptr + i * stride_v + c, mask=ok, other=0)
    tl.store(pool_ptr + slot * stride_p + c, v, mask=ok)


def cache_write_tiles(width: int) -> Tiles:
    """Rows of ``width`` values, copied up to 2048 columns per program."""
    block = min(next_power_of_2(width), choose(2048, 64))
    return Tiles({"BLOCK": block}, num_warps=num_warps_for(block))


def cache_write(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``Kernels.cache_write`` on the device for a contiguous ``pool`` and at least one value row."""
    n = slots.shape[0]
    if slots.dim() != 1 or tuple(values.shape) != (n, *pool.shape[1:]):
        raise ValueError(
            f"cache_write: need slots [n] and values [n, *{tuple(pool.shape[1:])}]; got {tuple(slots.shape)} and {tuple(values.shape)}"
        )
    width = 1
    for s in pool.shape[1:]:
        width *= s
    if width == 0:
        return
    pool2 = pool.view(pool.shape[0], width)
    # cast with torch (round to nearest even, like the reference); the kernel then copies bits
    vals = rows(values if values.dtype == pool.dtype else values.to(pool.dtype), width)
    slots = slots.to(torch.int64).contiguous()
    tiles = cache_write_tiles(width)
    _cache_write_kernel[(n, triton.cdiv(width, tiles.blocks["BLOCK"]))](
        pool2, slots, vals, pool.shape[0], width, pool2.stride(0), vals.stride(0), **tiles.kwargs(),
    )

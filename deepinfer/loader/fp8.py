"""Block-scaled FP8 weights as DeepSeek-V3/V4 checkpoints store them.

A weight of shape [..., R, C] is stored as float8_e4m3fn next to a scale grid of
shape [..., ceil(R/bm), ceil(C/bn)] holding one multiplier per (bm x bn) block
(`weight_scale_inv` in V3 naming, `scale` in V4 naming); edge blocks are partial.
Dequantizing multiplies every element by its block's scale; backends without FP8
matmuls load the result in their compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK = (128, 128)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32: fp32/bf16 values, float8_e8m0fnu powers of two, or raw uint8 E8M0 exponents."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale-grid shape for a weight of `shape` split into `block` tiles (edge tiles partial)."""
    rows, cols = shape[-2], shape[-1]
    return (*shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def block_for(shape: tuple[int, ...], grid: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int] | None:
    """The tile size that maps a weight of `shape` onto a scale grid of shape `grid`, or None if none fits.

    The configured `block` wins when it produces `grid`; otherwise an exact split of
    the weight is accepted (DeepSeek-V4's FP4 experts use 1 x 32 tiles while its FP8
    linears use 128 x 128 in the same checkpoint).
    """
    if len(shape) < 2 or len(grid) != len(shape) or tuple(grid[:-2]) != tuple(shape[:-2]):
        return None
    if tuple(scale_grid(shape, block)) == tuple(grid):
        return block
    rows, cols, grid_rows, grid_cols = shape[-2], shape[-1], grid[-2], grid[-1]
    if grid_rows > 0 and grid_cols > 0 and rows % grid_rows == 0 and cols % grid_cols == 0:
        return rows // grid_rows, cols // grid_cols
    return None


def dequantize_blockwise(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 `values` [..., R, C] times their block's scale from `scale` [..., ceil(R/bm), ceil(C/bn)]."""
    rows, cols = values.shape[-2], values.shape[-1]
    s = scale_to_float(scale)
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :cols]
    return values.to(torch.float32) * s


def dequantize_fp8_blockwise(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """Dequantize a block-scaled FP8 weight to float32."""
    return dequantize_blockwise(w_fp8.to(torch.float32), scale_inv, block)


def quantize_fp8_blockwise(
    w: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `w` [..., R, C] to float8_e4m3fn with one float32 scale per block.

    Returns `(w_fp8, scale_inv)` with `w ~= w_fp8.float() * scale_inv` broadcast over
    blocks; each block's absolute maximum maps to the e4m3 maximum (448). All-zero
    blocks get scale 1.
    """
    if w.ndim < 2:
        raise ValueError(f"quantize_fp8_blockwise needs a tensor with at least 2 dims, got shape {tuple(w.shape)}")
    bm, bn = block
    rows, cols = w.shape[-2], w.shape[-1]
    grid_rows, grid_cols = math.ceil(rows / bm), math.ceil(cols / bn)
    x = w.detach().to(torch.float32)
    padded = F.pad(x, (0, grid_cols * bn - cols, 0, grid_rows * bm - rows))
    tiles = padded.reshape(*x.shape[:-2], grid_rows, bm, grid_cols, bn)
    amax = tiles.abs().amax(dim=(-3, -1))
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    scale_inv = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    quantized = (tiles / scale_inv[..., :, None, :, None]).clamp(-fp8_max, fp8_max)
    quantized = quantized.reshape(padded.shape)[..., :rows, :cols].to(torch.float8_e4m3fn)
    return quantized.contiguous(), scale_inv.contiguous()

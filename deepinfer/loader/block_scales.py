"""Block-quantized tensors in a checkpoint: which dtypes carry codes, which tile a scale grid stands for,
and dequantizing one (through ``QuantizedWeight``, the decoding the kernels use too).

A weight ``[..., R, C]`` is stored as FP8 codes (or FP4 pairs packed in a byte)
next to a scale grid ``[..., ceil(R/bm), ceil(C/bn)]`` (``weight_scale_inv`` in
V3 naming, ``scale`` in V4 naming); edge tiles are partial.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import QuantizedWeight
from deepinfer_interfaces.quant import grid_shape

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: packed e2m1 pairs: torch's own dtype, or the bytes as DeepSeek's release stores them (``I8``)
FP4_DTYPES = (torch.float4_e2m1fn_x2, torch.int8, torch.uint8)
DEFAULT_BLOCK = (128, 128)


def block_for(shape: tuple[int, ...], grid: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int] | None:
    """The tile that maps a weight of (logical) ``shape`` onto a scale grid ``grid``, or None if none fits.

    The configured ``block`` wins when it produces ``grid``; otherwise an exact split of
    the weight is accepted (DeepSeek-V4's FP4 experts use 1 x 32 tiles while its FP8
    linears use 128 x 128 in the same checkpoint).
    """
    if len(shape) < 2 or len(grid) != len(shape) or tuple(grid[:-2]) != tuple(shape[:-2]):
        return None
    if grid_shape(tuple(shape), block) == tuple(grid):
        return block
    rows, cols, grid_rows, grid_cols = shape[-2], shape[-1], grid[-2], grid[-1]
    if grid_rows > 0 and grid_cols > 0 and rows % grid_rows == 0 and cols % grid_cols == 0:
        return rows // grid_rows, cols // grid_cols
    return None


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A stored FP8 or packed-FP4 weight and its block scales as float32 values."""
    if codes.dtype in FP8_DTYPES:
        return QuantizedWeight(codes, scale, block, "e4m3").dequantize()
    return QuantizedWeight(codes.view(torch.uint8), scale, block, "e2m1").dequantize()

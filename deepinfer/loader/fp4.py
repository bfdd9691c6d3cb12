"""Packed FP4 (e2m1) weights with block scales, as DeepSeek-V4 stores its routed experts.

Two e2m1 values share a byte, the first in the low nibble; the checkpoint stores the
bytes as float4_e2m1fn_x2 (or int8), with a scale grid of one multiplier per tile
(1 x 32 in DeepSeek-V4-Flash, E8M0 powers of two).
"""

from __future__ import annotations

import torch

from .fp8 import dequantize_blockwise

FP4_DTYPES = (torch.float4_e2m1fn_x2, torch.int8, torch.uint8)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., C] to float32 values [..., 2C] (low nibble first)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = packed.contiguous().view(torch.uint8)
    low = table[(codes & 0x0F).long()]
    high = table[(codes >> 4).long()]
    return torch.stack((low, high), dim=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])


def dequantize_fp4_blockwise(packed: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Dequantize a packed FP4 weight with its block scales to float32 [..., R, 2C]."""
    return dequantize_blockwise(unpack_fp4(packed), scale, block)

"""Rotary tables: one angle per interleaved pair, plain or YaRN-scaled."""

from __future__ import annotations

import math

import torch

from .config import RopeParams


def inverse_frequencies(params: RopeParams, rope_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """``[rope_dim/2]`` fp32 inverse frequencies and the factor cos/sin are scaled by."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    if params.rope_type == "default":
        return 1.0 / (params.rope_theta**exponents), 1.0
    factor = params.factor
    original = params.original_max_position_embeddings or max_position_embeddings
    if factor is None:
        factor = max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.attention_factor
    if attention_factor is None:
        if params.mscale and params.mscale_all_dim:
            attention_factor = mscale(factor, params.mscale) / mscale(factor, params.mscale_all_dim)
        else:
            attention_factor = mscale(factor)
    beta_fast = params.beta_fast or 32
    beta_slow = params.beta_slow or 1
    base = params.rope_theta

    def correction_dim(rotations: float) -> float:
        return (rope_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base**exponents
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


class Rotary:
    """cos/sin of ``position · inv_freq`` for any positions, in fp32."""

    def __init__(self, params: RopeParams, rope_dim: int, max_position_embeddings: int, device: torch.device | str):
        inv, self.attention_scaling = inverse_frequencies(params, rope_dim, max_position_embeddings)
        self.inv_freq = inv.to(device)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` each ``[*positions.shape, rope_dim/2]``."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

"""The KV rounding DeepSeek-V4 and V4.1 were trained with, written from the published formulas for the oracles.

Independent of the engine (nothing from ``deepinfer`` or ``deepinfer_interfaces``):
each function takes float rows and returns them as they read back after the
rounding, in the input's dtype. Per block of ``block`` channels (one block per
row when the row is narrower)::

    FP8 e4m3 (DeepSeek's act_quant):      amax = max(max|x|, 1e-4)
                                          ue8m0: s = 2^ceil(log2(amax / 448))   fp32: s = amax / 448
                                          x ≈ e4m3(clamp(x / s, ±448)) · s
    FP4 e2m1 (DeepSeek's fp4_act_quant):  ue8m0 scales: amax = max(max|x|, 6·2^-126), s = 2^ceil(log2(amax / 6))
                                          e4m3 scales:  amax = max(max|x|, 6·2^-9),   s = e4m3(amax / 6)
                                          x ≈ nearest of ±{0, .5, 1, 1.5, 2, 3, 4, 6} to clamp(x / s, ±6)
                                              (a midpoint goes to the even code: .25→0, .75→1, 1.25→1,
                                              1.75→2, 2.5→2, 3.5→4, 5→4) · s

The quantities are computed in fp32, as the published kernels compute them.
"""

from __future__ import annotations

import math

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` ``[..., d]`` (fp32) as ``[..., d // b, b]`` with ``b`` = ``block`` or the row, when narrower."""
    d = x.shape[-1]
    b = min(block, d)
    if d % b:
        raise ValueError(f"{d} channels do not split into blocks of {b}")
    return x.reshape(*x.shape[:-1], d // b, b)


def _power_of_two_at_least(ratio: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(ratio))`` (fp64 logarithm, so an exact power of two keeps its exponent)."""
    return torch.pow(2.0, torch.ceil(torch.log2(ratio.double()))).float()


def e4m3_round(x: torch.Tensor, block: int, scale: str = "ue8m0", keep: int = 0) -> torch.Tensor:
    """FP8 e4m3 rounding of the leading ``d - keep`` channels in blocks of ``block`` (``scale``: ``ue8m0``
    power-of-two scales or ``fp32`` ones); the trailing ``keep`` channels (V4's rotary ones) as bf16, the
    precision the published model keeps them in."""
    d = x.shape[-1]
    head, tail = x[..., : d - keep].float(), x[..., d - keep :]
    blocks = _blocks(head, block)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    s = _power_of_two_at_least(amax / E4M3_MAX) if scale == "ue8m0" else amax / E4M3_MAX
    codes = (blocks / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    out = (codes * s).reshape(head.shape).to(x.dtype)
    return torch.cat([out, tail.to(torch.bfloat16).to(x.dtype)], dim=-1) if keep else out


def e2m1_nearest(y: torch.Tensor) -> torch.Tensor:
    """``y`` (within ±6) at the nearest e2m1 value, a midpoint going to the even code. The grid's spacing is
    0.5 below 2, 1 up to 4 and 2 up to 6, so within each span it is ``round(|y| / step) · step`` with
    round-half-to-even, whose even multiples of the step are the even codes."""
    mag = y.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.copysign(torch.round(mag / step) * step, y)


def e2m1_round(x: torch.Tensor, block: int, scale: str = "ue8m0") -> torch.Tensor:
    """FP4 e2m1 rounding in blocks of ``block`` with ``ue8m0`` or ``e4m3`` scales."""
    blocks = _blocks(x.float(), block)
    amax = blocks.abs().amax(-1, keepdim=True)
    if scale == "ue8m0":
        s = _power_of_two_at_least(amax.clamp(min=E2M1_MAX * 2.0**-126) / E2M1_MAX)
    elif scale == "e4m3":
        s = (amax.clamp(min=E2M1_MAX * 2.0**-9) / E2M1_MAX).to(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"FP4 scales are ue8m0 or e4m3, not {scale!r}")
    codes = e2m1_nearest((blocks / s).clamp(-E2M1_MAX, E2M1_MAX))
    return (codes * s).reshape(x.shape).to(x.dtype)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., d]`` times the orthonormal Walsh–Hadamard matrix ``H_d / √d`` (Sylvester's order:
    ``H_2n = [[H_n, H_n], [H_n, −H_n]]``), in fp64, returned in ``x.dtype``; ``d`` a power of two."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"a Walsh–Hadamard rotation needs a power-of-two width, not {d}")
    y = x.double().reshape(-1, d)
    h = 1
    while h < d:  # the butterfly: pairs (i, i + h) within each run of 2h channels become (a + b, a − b)
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], dim=2).reshape(-1, d)
        h *= 2
    return (y / math.sqrt(d)).reshape(x.shape).to(x.dtype)

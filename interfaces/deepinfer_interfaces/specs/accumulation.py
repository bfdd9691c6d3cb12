"""Inputs on which a sum kept in 16 bits misses by many times the tolerance, for the accumulation cases.

A 16-bit accumulator rounds at the scale of its running sum (2^-9 of it in bf16,
2^-12 in fp16), the tolerance is at the scale of the result. So each builder
makes the running sum much larger than the result: rows that first push the sum
up and then bring it back (``rise_then_fall``), or one outlier term that the
later, smaller terms cannot move once it is in (``outlier_first``). A kernel that
sums in fp32 loses nothing measurable on them; 16-bit operands lose nothing
either (the inputs are already rounded to the dtype under test, and the softmax
weights are exactly 1).
"""

from __future__ import annotations

import torch

from .spec import randn

#: the dtypes the accumulation cases run in: the rule is about 16-bit sums (in fp32 they would measure the
#: fp32 reference against the fp64 oracle on a result far smaller than its terms)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
#: the magnitude of the rows that push the running sum up and back down (a sum of 1024 of them stays inside
#: fp16's range)
AMPLITUDE = 32.0


def rise_then_fall(rows: int, channels: int, gen: torch.Generator, amplitude: float = AMPLITUDE) -> torch.Tensor:
    """``[rows, channels]``: the first half ``+amplitude``, the second ``-amplitude``, each with noise of 1/64 of it.

    Summed in order, the running sum climbs to ``rows/2 · amplitude`` and returns to
    about zero; a bf16 accumulator rounds by ~``rows/2 · amplitude · 2^-9`` at the top.
    """
    sign = torch.ones(rows)
    sign[rows // 2 :] = -1.0
    return sign[:, None] * amplitude + randn(rows, channels, gen=gen, scale=amplitude / 64)


def outlier_first(rows: int, channels: int, gen: torch.Generator, outlier: float = 128.0) -> torch.Tensor:
    """``[rows, channels]``: channel 0 an outlier (an LLM's massive activation), the rest ±0.99.

    Its square, 16,384, leaves a bf16 sum of squares a rounding step of 128: the
    rest add 0.98 each, under half a step even 64 at a time, so they never count.
    """
    signs = torch.where(torch.rand(rows, channels, generator=gen) < 0.5, -1.0, 1.0)
    x = 0.99 * signs
    x[:, 0] = outlier
    return x

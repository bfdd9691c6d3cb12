"""RMSNorm cases: plain, unweighted, tiny magnitudes where eps dominates, squares past fp16's range,
one row, V4-Flash's widths (a hidden row of 4096, 64 query heads of 512), empty batch. A relative-RMS
limit catches a mean of squares kept in 16 bits over the wide rows; the accumulation case (an outlier
channel first) fails it outright."""

import torch

from .accumulation import SIXTEEN_BIT, outlier_first
from .shapes import HEAD_DIM, HEADS, HIDDEN
from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded


def _cases() -> list[Case]:
    g = seeded(0)
    return [
        Case("t7_d64", dict(x=randn(7, 64, gen=g), weight=randn(64, gen=g) + 1, eps=1e-6)),
        Case("t1_d8_unweighted", dict(x=randn(1, 8, gen=g), weight=None, eps=1e-6)),
        Case("t3_h4_d32_3d", dict(x=randn(3, 4, 32, gen=g), weight=randn(32, gen=g), eps=1e-6)),
        Case("tiny_values_eps_dominates", dict(x=randn(5, 128, gen=g, scale=1e-2), weight=torch.ones(128), eps=1e-3)),
        Case("empty_batch", dict(x=torch.empty(0, 16), weight=torch.ones(16), eps=1e-6)),
        Case("squares_past_fp16_range", dict(x=randn(3, 256, gen=g, scale=400.0), weight=randn(256, gen=g) + 1, eps=1e-6)),
        Case("one_row_d1", dict(x=randn(1, 1, gen=g), weight=torch.tensor([2.0]), eps=1e-6)),
        Case("one_row_hidden_4096", dict(x=randn(1, HIDDEN, gen=g), weight=randn(HIDDEN, gen=g) * 0.1 + 1, eps=1e-6)),
        Case("t4_hidden_4096", dict(x=randn(4, HIDDEN, gen=g, scale=3.0), weight=randn(HIDDEN, gen=g) * 0.1 + 1, eps=1e-6)),
        Case("t2_h64_d512_q_heads_unweighted", dict(x=randn(2, HEADS, HEAD_DIM, gen=g), weight=None, eps=1e-6)),
        Case("accumulation_t4_hidden_4096_outlier_channel_first",
             dict(x=outlier_first(4, HIDDEN, seeded(100)), weight=torch.ones(HIDDEN), eps=1e-6), dtypes=SIXTEEN_BIT, accumulation=True),
    ]


register(OpSpec(
    op="rms_norm", cases=_cases, cast=("x",), rms_limits=RMS_LIMITS,
    rms_reason="a mean of up to 4096 squares: kept in bf16 it drifts by many roundings and scales the whole row",
    accumulation="the sum of squares over the row, in fp32",
))

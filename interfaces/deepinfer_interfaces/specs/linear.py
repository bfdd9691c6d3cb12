"""Dense linear cases: one token (a decode step), a batch wider than a tile, 3-D input (tokens × heads),
an LM-head-like wide output, K=4096 real hidden width (also over several tiles into a narrow output), an
empty batch. A relative-RMS limit catches a product accumulated in 16 bits over the long rows."""

import torch

from .shapes import HIDDEN
from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded


def _cases() -> list[Case]:
    g = seeded(60)
    return [
        Case("t1_k128_n64_decode", dict(x=randn(1, 128, gen=g), weight=randn(64, 128, gen=g, scale=128**-0.5))),
        Case("t37_k96_n80_past_one_tile", dict(x=randn(37, 96, gen=g), weight=randn(80, 96, gen=g, scale=96**-0.5))),
        Case("t3_h4_k32_n16_3d", dict(x=randn(3, 4, 32, gen=g), weight=randn(16, 32, gen=g, scale=32**-0.5))),
        Case("t5_k64_n2048_head_like", dict(x=randn(5, 64, gen=g), weight=randn(2048, 64, gen=g, scale=0.125))),
        Case("t2_k4096_n64_real_hidden", dict(x=randn(2, HIDDEN, gen=g), weight=randn(64, HIDDEN, gen=g, scale=HIDDEN**-0.5))),
        # several tiles of long rows into a narrow output: a lone tile's long reduction is what a BLAS splits
        # across threads, so a batch-invariant product must not compute a row alone differently
        Case("t40_k4096_n8_tiles_of_long_rows", dict(x=randn(40, HIDDEN, gen=g), weight=randn(8, HIDDEN, gen=g, scale=HIDDEN**-0.5))),
        Case("empty_batch", dict(x=torch.empty(0, 32), weight=randn(8, 32, gen=g))),
    ]


register(OpSpec(
    op="linear", cases=_cases, cast=("x", "weight"), rms_limits=RMS_LIMITS,
    rms_reason="a dot product over up to 4096 columns: kept in bf16 it drifts by many roundings",
))

"""RMSNorm cases: plain, unweighted, tiny magnitudes where eps dominates, empty batch."""

import torch

from .spec import Case, OpSpec, randn, register, seeded


def _cases() -> list[Case]:
    g = seeded(0)
    return [
        Case("t7_d64", dict(x=randn(7, 64, gen=g), weight=randn(64, gen=g) + 1, eps=1e-6)),
        Case("t1_d8_unweighted", dict(x=randn(1, 8, gen=g), weight=None, eps=1e-6)),
        Case("t3_h4_d32_3d", dict(x=randn(3, 4, 32, gen=g), weight=randn(32, gen=g), eps=1e-6)),
        Case("tiny_values_eps_dominates", dict(x=randn(5, 128, gen=g, scale=1e-2), weight=torch.ones(128), eps=1e-3)),
        Case("empty_batch", dict(x=torch.empty(0, 16), weight=torch.ones(16), eps=1e-6)),
    ]


register(OpSpec(op="rms_norm", cases=_cases, cast=("x",)))

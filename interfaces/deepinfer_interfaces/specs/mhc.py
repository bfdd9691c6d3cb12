"""Hyper-connection cases: 4 and 2 streams, full and single Sinkhorn iteration, empty batch."""

import torch

from .spec import Case, OpSpec, randn, register, seeded


def _pre(g: torch.Generator, t: int, n: int, d: int, iters: int) -> dict:
    return dict(
        x=randn(t, n, d, gen=g),
        fn=randn((2 + n) * n, n * d, gen=g, scale=0.1),
        base=randn((2 + n) * n, gen=g, scale=0.5),
        scale=torch.rand(3, generator=g) + 0.5,
        norm_eps=1e-6,
        hc_eps=1e-6,
        sinkhorn_iters=iters,
    )


def _pre_cases() -> list[Case]:
    g = seeded(15)
    return [
        Case("t5_n4_d16_20_iters", _pre(g, 5, 4, 16, 20)),
        Case("t3_n2_d8_one_iter", _pre(g, 3, 2, 8, 1)),
        Case("empty_batch", _pre(g, 0, 4, 8, 20)),
    ]


def _stochastic(g: torch.Generator, t: int, n: int) -> torch.Tensor:
    c = torch.rand(t, n, n, generator=g) + 0.1
    return c / c.sum(-2, keepdim=True)


def _post_cases() -> list[Case]:
    g = seeded(16)
    return [
        Case("t5_n4_d16", dict(y=randn(5, 16, gen=g), x=randn(5, 4, 16, gen=g), post=torch.rand(5, 4, generator=g) * 2, comb=_stochastic(g, 5, 4))),
        Case("t2_n2_d8", dict(y=randn(2, 8, gen=g), x=randn(2, 2, 8, gen=g), post=torch.rand(2, 2, generator=g) * 2, comb=_stochastic(g, 2, 2))),
        Case("empty_batch", dict(y=torch.empty(0, 8), x=torch.empty(0, 4, 8), post=torch.empty(0, 4), comb=torch.empty(0, 4, 4))),
    ]


def _head(g: torch.Generator, t: int, n: int, d: int) -> dict:
    return dict(x=randn(t, n, d, gen=g), fn=randn(n, n * d, gen=g, scale=0.1), base=randn(n, gen=g, scale=0.5),
                scale=torch.rand(1, generator=g) + 0.5, norm_eps=1e-6, hc_eps=1e-6)


def _head_cases() -> list[Case]:
    g = seeded(17)
    return [Case("t5_n4_d16", _head(g, 5, 4, 16)), Case("t1_n2_d8", _head(g, 1, 2, 8)), Case("empty_batch", _head(g, 0, 4, 8))]


register(OpSpec(op="mhc_pre", cases=_pre_cases, cast=("x",)))
register(OpSpec(op="mhc_post", cases=_post_cases, cast=("y", "x")))
register(OpSpec(op="mhc_head", cases=_head_cases, cast=("x",)))

"""Hyper-connection cases: 4 and 2 streams, full and single Sinkhorn iteration, one token, empty
batch, V4-Flash's width (4 streams of 4096) for every op and V4.1's (4 streams of 5120) for the
mixes and the collapse it calls apart. The wide rows get a relative-RMS limit: the norm and the
projection sum over n·D = 16384 or 20480 values."""

import torch

from .shapes import HC_MULT, HIDDEN
from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded

#: fn scaled by 1/sqrt(n·D) at the real widths, so the logits stay O(1) and sigmoid/softmax do not saturate
V4_FN_SCALE = (HC_MULT * HIDDEN) ** -0.5


def _pre(g: torch.Generator, t: int, n: int, d: int, iters: int, fn_scale: float = 0.1) -> dict:
    return dict(
        x=randn(t, n, d, gen=g),
        fn=randn((2 + n) * n, n * d, gen=g, scale=fn_scale),
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
        Case("one_token", _pre(g, 1, 4, 16, 20)),
        Case("t2_n4_d4096_v4_width", _pre(g, 2, HC_MULT, HIDDEN, 20, fn_scale=V4_FN_SCALE)),
    ]


#: DeepSeek-V4.1's hyper-connections: 4 streams of its hidden size 5120
V41_STREAMS, V41_HIDDEN = 4, 5120


def _mix_cases() -> list[Case]:
    g = seeded(18)
    # fn scaled by 1/sqrt(n·D) at the real width, so the logits stay O(1) and sigmoid/softmax do not saturate
    wide = (V41_STREAMS * V41_HIDDEN) ** -0.5
    return [
        Case("t5_n4_d16_20_iters", _pre(g, 5, 4, 16, 20)),
        Case("t3_n2_d8_one_iter", _pre(g, 3, 2, 8, 1)),
        Case("t1_n4_d24_one_token", _pre(g, 1, 4, 24, 20)),
        Case("t3_n4_d5120_v41_width", _pre(g, 3, V41_STREAMS, V41_HIDDEN, 20, fn_scale=wide)),
        Case("empty_batch", _pre(g, 0, 4, 8, 20)),
        Case("one_token_n4_d4096_v4_width", _pre(g, 1, HC_MULT, HIDDEN, 20, fn_scale=V4_FN_SCALE)),
    ]


def _collapse(g: torch.Generator, t: int, n: int, d: int) -> dict:
    """Streams and positive weights, as ``mhc_mix``'s ``pre`` (sigmoid + eps) has them."""
    return dict(x=randn(t, n, d, gen=g), pre=torch.rand(t, n, generator=g) + 1e-6)


def _collapse_cases() -> list[Case]:
    g = seeded(19)
    one_hot = dict(x=randn(2, 4, 16, gen=g), pre=torch.tensor([[1.0, 0.0, 0.0, 0.0]] * 2))
    return [
        Case("t5_n4_d16", _collapse(g, 5, 4, 16)),
        Case("t3_n2_d8", _collapse(g, 3, 2, 8)),
        Case("t2_n4_d16_one_hot_stream0", one_hot),
        Case("t1_n4_d24_one_token", _collapse(g, 1, 4, 24)),
        Case("t3_n4_d5120_v41_width", _collapse(g, 3, V41_STREAMS, V41_HIDDEN)),
        Case("t2_n4_d4096_v4_width", _collapse(g, 2, HC_MULT, HIDDEN)),
        Case("empty_batch", dict(x=torch.empty(0, 4, 8), pre=torch.empty(0, 4))),
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
        Case("one_token_n4_d4096", _post(g, 1, HC_MULT, HIDDEN)),
        Case("t2_n4_d5120_v41_width", _post(g, 2, V41_STREAMS, V41_HIDDEN)),
    ]


def _post(g: torch.Generator, t: int, n: int, d: int) -> dict:
    return dict(y=randn(t, d, gen=g), x=randn(t, n, d, gen=g), post=torch.rand(t, n, generator=g) * 2, comb=_stochastic(g, t, n))


def _head(g: torch.Generator, t: int, n: int, d: int) -> dict:
    return dict(x=randn(t, n, d, gen=g), fn=randn(n, n * d, gen=g, scale=0.1), base=randn(n, gen=g, scale=0.5),
                scale=torch.rand(1, generator=g) + 0.5, norm_eps=1e-6, hc_eps=1e-6)


def _head_cases() -> list[Case]:
    g = seeded(17)
    real = dict(_head(g, 2, HC_MULT, HIDDEN), fn=randn(HC_MULT, HC_MULT * HIDDEN, gen=g, scale=V4_FN_SCALE))
    return [Case("t5_n4_d16", _head(g, 5, 4, 16)), Case("t1_n2_d8", _head(g, 1, 2, 8)), Case("empty_batch", _head(g, 0, 4, 8)),
            Case("t2_n4_d4096_v4_width", real)]


_WIDE = "the norm and the projection each sum over n·D = 16384 (V4) or 20480 (V4.1) values; kept in bf16 they lose many roundings"
_STREAMS = "sums over only n = 4 streams: the limit holds a kernel to one rounding of its output"
register(OpSpec(op="mhc_pre", cases=_pre_cases, cast=("x",), rms_limits=RMS_LIMITS, rms_reason=_WIDE))
register(OpSpec(op="mhc_mix", cases=_mix_cases, cast=("x",), rms_limits=RMS_LIMITS, rms_reason=_WIDE))
register(OpSpec(op="mhc_collapse", cases=_collapse_cases, cast=("x",), rms_limits=RMS_LIMITS, rms_reason=_STREAMS))
register(OpSpec(op="mhc_post", cases=_post_cases, cast=("y", "x"), rms_limits=RMS_LIMITS, rms_reason=_STREAMS))
register(OpSpec(op="mhc_head", cases=_head_cases, cast=("x",), rms_limits=RMS_LIMITS, rms_reason=_WIDE))

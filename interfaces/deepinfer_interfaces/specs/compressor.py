"""KV-compressor cases: plain and overlapping windows, the first window without a
predecessor, partially and fully absent windows, a slot absent in the middle of a window,
gates that overflow exp without the max taken out, one row, V4-Flash's windows (128 tokens of
512 channels, overlapping windows of 4 over 2 × 512), empty batch. A relative-RMS limit
catches sums kept in 16 bits over the 128-token windows; the accumulation case (equal gates,
windows whose pooled sum climbs and returns) fails them outright."""

import torch

from .accumulation import SIXTEEN_BIT, rise_then_fall
from .shapes import CSA_RATIO, HCA_RATIO, HEAD_DIM
from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded


def _windows(starts: list[int], m: int) -> torch.Tensor:
    idx = torch.tensor(starts)[:, None] + torch.arange(m)[None, :]
    return torch.where(torch.tensor(starts)[:, None] >= 0, idx, torch.full_like(idx, -1))


def _cases() -> list[Case]:
    g = seeded(14)
    m = 4
    part = _windows([0, 4], m)
    part[1, 2:] = -1
    return [
        Case("hca_m4_c8", dict(kv=randn(16, 8, gen=g), gate=randn(16, 8, gen=g), position_bias=randn(m, 8, gen=g), indices=_windows([0, 4, 8, 12], m), prev_indices=None)),
        Case(
            "csa_overlap_m4_c16_first_window_alone",
            dict(kv=randn(16, 16, gen=g), gate=randn(16, 16, gen=g), position_bias=randn(m, 16, gen=g),
                 indices=_windows([0, 4, 8, 12], m), prev_indices=_windows([-1, 0, 4, 8], m)),
        ),
        Case("partially_absent_window", dict(kv=randn(8, 6, gen=g), gate=randn(8, 6, gen=g, scale=3.0), position_bias=randn(m, 6, gen=g), indices=part, prev_indices=None)),
        Case(
            "fully_absent_rows_are_zero",
            dict(kv=randn(8, 8, gen=g), gate=randn(8, 8, gen=g), position_bias=randn(m, 8, gen=g),
                 indices=_windows([-1, 4, -1], m), prev_indices=_windows([-1, 0, -1], m)),
        ),
        Case("empty_batch", dict(kv=randn(4, 8, gen=g), gate=randn(4, 8, gen=g), position_bias=randn(m, 8, gen=g), indices=torch.empty(0, m, dtype=torch.int64), prev_indices=None)),
        Case("absent_slot_mid_window", dict(kv=randn(8, 6, gen=g), gate=randn(8, 6, gen=g), position_bias=randn(m, 6, gen=g), indices=torch.tensor([[0, -1, 2, 3], [-1, 5, -1, 7]]), prev_indices=None)),
        Case("large_gates_overflow_exp", dict(kv=randn(8, 6, gen=g), gate=randn(8, 6, gen=g, scale=60.0), position_bias=randn(m, 6, gen=g), indices=_windows([0, 4], m), prev_indices=None)),
        Case("one_row_overlap", dict(kv=randn(8, 16, gen=g), gate=randn(8, 16, gen=g), position_bias=randn(m, 16, gen=g), indices=_windows([4], m), prev_indices=_windows([0], m))),
        Case("hca_one_row_m128_c512", _real(g, [0], HCA_RATIO, HEAD_DIM, overlap=False)),
        Case("hca_e2_m128_c512_partial", dict(_real(g, [0, 128], HCA_RATIO, HEAD_DIM, overlap=False), indices=_partial(_windows([0, 128], HCA_RATIO), 1, 77))),
        Case("csa_e3_m4_c1024_overlap", _real(g, [0, 4, 8], CSA_RATIO, 2 * HEAD_DIM, overlap=True)),
        _accumulation_case(),
    ]


def _accumulation_case() -> Case:
    """Two V4-Flash HCA windows (128 tokens of 512 channels) with zero gates and bias: every weight exactly 1,
    a pooled sum that climbs to 64 · 32 over each window's first half and returns near zero over the second."""
    g = seeded(102)
    m, c = HCA_RATIO, HEAD_DIM
    kv = torch.cat([rise_then_fall(m, c, g), rise_then_fall(m, c, g).flip(0)])
    return Case(
        "accumulation_hca_e2_m128_c512_rise_then_fall",
        dict(kv=kv, gate=torch.zeros(2 * m, c), position_bias=torch.zeros(m, c), indices=_windows([0, m], m), prev_indices=None),
        dtypes=SIXTEEN_BIT, accumulation=True,
    )


def _partial(idx: torch.Tensor, row: int, filled: int) -> torch.Tensor:
    """``idx`` with row ``row``'s window filled only to ``filled`` tokens (a window still open)."""
    idx = idx.clone()
    idx[row, filled:] = -1
    return idx


def _real(g: torch.Generator, starts: list[int], m: int, c: int, overlap: bool) -> dict:
    n = starts[-1] + m
    prev = _windows([s - m for s in starts], m) if overlap else None
    if prev is not None:
        prev[torch.tensor(starts) < m] = -1
    return dict(kv=randn(n, c, gen=g), gate=randn(n, c, gen=g), position_bias=randn(m, c, gen=g), indices=_windows(starts, m), prev_indices=prev)


register(OpSpec(
    op="compress_kv", cases=_cases, cast=("kv", "gate"), rms_limits=RMS_LIMITS,
    rms_reason="softmax-weighted sums over windows of 128 tokens: kept in bf16 they lose several roundings",
    accumulation="the softmax normaliser and the weighted sum over each window's slots (both series of an overlapping window), in fp32",
))

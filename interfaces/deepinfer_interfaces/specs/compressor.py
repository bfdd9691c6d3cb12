"""KV-compressor cases: plain and overlapping windows, the first window without a
predecessor, partially and fully absent windows, empty batch."""

import torch

from .spec import Case, OpSpec, randn, register, seeded


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
    ]


register(OpSpec(op="compress_kv", cases=_cases, cast=("kv", "gate")))

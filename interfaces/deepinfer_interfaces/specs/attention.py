"""Sparse-attention cases: gathered windows, -1 padding, windows longer than the
sequence, fully masked rows (sink only), dominant sinks, no candidates, empty batch."""

import torch

from .spec import Case, OpSpec, randn, register, seeded


def _window(positions: list[int], width: int) -> torch.Tensor:
    """Pool rows of a causal window: row ``p - j`` for ``j < width``, -1 before the start."""
    p = torch.tensor(positions)[:, None] - torch.arange(width)[None, :]
    return torch.where(p >= 0, p, torch.full_like(p, -1))


def _cases() -> list[Case]:
    g = seeded(11)
    d = 32
    scale = d**-0.5
    rand_idx = torch.randint(0, 20, (5, 7), generator=g)
    rand_idx[1, 3:] = -1
    rand_idx[3, ::2] = -1
    masked = torch.randint(0, 10, (4, 6), generator=g)
    masked[2] = -1
    return [
        Case("t5_h4_d32_random_rows_padded", dict(q=randn(5, 4, d, gen=g), kv=randn(20, d, gen=g), indices=rand_idx, sinks=randn(4, gen=g), scale=scale)),
        Case("window_longer_than_sequence", dict(q=randn(6, 2, d, gen=g), kv=randn(6, d, gen=g), indices=_window([0, 1, 2, 3, 4, 5], 8), sinks=randn(2, gen=g), scale=scale)),
        Case("fully_masked_row_sink_only", dict(q=randn(4, 3, d, gen=g), kv=randn(10, d, gen=g), indices=masked, sinks=randn(3, gen=g), scale=scale)),
        Case("large_sinks", dict(q=randn(3, 2, 16, gen=g), kv=randn(8, 16, gen=g), indices=_window([7, 5, 2], 4), sinks=torch.tensor([6.0, -6.0]), scale=0.25)),
        Case("no_candidates", dict(q=randn(3, 2, 16, gen=g), kv=randn(4, 16, gen=g), indices=torch.empty(3, 0, dtype=torch.int64), sinks=randn(2, gen=g), scale=0.25)),
        Case("empty_batch", dict(q=torch.empty(0, 2, 16), kv=randn(4, 16, gen=g), indices=torch.empty(0, 5, dtype=torch.int64), sinks=randn(2, gen=g), scale=0.25)),
    ]


register(OpSpec(op="sparse_attention", cases=_cases, cast=("q", "kv")))

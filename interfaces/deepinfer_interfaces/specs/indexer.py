"""Lightning-indexer cases: scores with -1 padded and fully invalid rows; top-k with
padding, k beyond the candidates and invalid picks; empty batches."""

import torch

from .spec import Case, OpSpec, randn, register, seeded


def _score_cases() -> list[Case]:
    g = seeded(12)
    idx = torch.randint(0, 12, (6, 9), generator=g)
    idx[0, 4:] = -1
    idx[2] = -1
    return [
        Case("t6_h4_d16_padded", dict(q=randn(6, 4, 16, gen=g), weights=randn(6, 4, gen=g), keys=randn(12, 16, gen=g), indices=idx, scale=0.25)),
        Case("single_head", dict(q=randn(3, 1, 8, gen=g), weights=randn(3, 1, gen=g), keys=randn(5, 8, gen=g), indices=torch.randint(0, 5, (3, 5), generator=g), scale=8**-0.5)),
        Case("no_candidates", dict(q=randn(2, 2, 8, gen=g), weights=randn(2, 2, gen=g), keys=randn(3, 8, gen=g), indices=torch.empty(2, 0, dtype=torch.int64), scale=1.0)),
        Case("empty_batch", dict(q=torch.empty(0, 2, 8), weights=torch.empty(0, 2), keys=randn(3, 8, gen=g), indices=torch.empty(0, 4, dtype=torch.int64), scale=1.0)),
    ]


def _distinct_scores(g: torch.Generator, t: int, k: int) -> torch.Tensor:
    """Integer-valued scores, distinct per row, exact in every float dtype (so no ties)."""
    return torch.stack([torch.randperm(k, generator=g) for _ in range(t)]).float() - k / 2


def _topk_cases() -> list[Case]:
    g = seeded(13)
    s = _distinct_scores(g, 5, 12)
    s[1, 6:] = float("-inf")
    s[4] = float("-inf")
    vals = torch.randint(0, 1000, (5, 12), generator=g)
    return [
        Case("t5_k12_pick4_with_invalid", dict(scores=s, values=vals, k=4)),
        Case("pick_all", dict(scores=_distinct_scores(g, 3, 6), values=torch.randint(0, 50, (3, 6), generator=g), k=6)),
        Case("k_beyond_candidates", dict(scores=_distinct_scores(g, 2, 3), values=torch.randint(0, 50, (2, 3), generator=g), k=5)),
        Case("no_candidates", dict(scores=torch.empty(3, 0), values=torch.empty(3, 0, dtype=torch.int64), k=2)),
        Case("empty_batch", dict(scores=torch.empty(0, 4), values=torch.empty(0, 4, dtype=torch.int64), k=2)),
    ]


register(OpSpec(op="indexer_scores", cases=_score_cases, cast=("q", "weights", "keys")))
register(OpSpec(op="topk_select", cases=_topk_cases, cast=("scores",), exact=True))

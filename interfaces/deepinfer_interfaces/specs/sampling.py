"""Sampling cases: greedy, each filter alone and together, a mixed batch, an empty batch; the filtered
distribution; rejection sampling of drafts (all accepted, none, a rejection in the middle, greedy rows,
rows with fewer drafts than the widest, a uniform draw equal to the ratio, drafts the target
rules out); one row and V4-Flash's vocabulary for each; greedy rows whose logits tie (lowest id).

Token choices are compared exactly: given the same logits and the same exponential noise, every
backend must pick the same tokens. Logits are spread wide so that no two
candidates sit within rounding of each other.
"""

import torch

from .shapes import VOCAB
from .spec import Case, OpSpec, register, seeded


def _batch(g: torch.Generator, b: int, v: int, **params: list) -> dict:
    logits = torch.randperm(v * b, generator=g).float().view(b, v) / (v * b) * 12.0
    noise = torch.empty(b, v).exponential_(generator=g)
    full = dict(temperature=[1.0] * b, top_k=[0] * b, top_p=[1.0] * b, min_p=[0.0] * b)
    full.update(params)
    return dict(
        logits=logits,
        temperature=torch.tensor(full["temperature"], dtype=torch.float32),
        top_k=torch.tensor(full["top_k"], dtype=torch.int64),
        top_p=torch.tensor(full["top_p"], dtype=torch.float32),
        min_p=torch.tensor(full["min_p"], dtype=torch.float32),
        noise=noise,
    )


def _cases() -> list[Case]:
    g = seeded(2)
    return [
        Case("greedy", _batch(g, 4, 50, temperature=[0.0] * 4)),
        Case("temperature_only", _batch(g, 4, 50, temperature=[0.5, 1.0, 1.5, 2.0])),
        Case("top_k", _batch(g, 4, 50, top_k=[1, 3, 10, 50])),
        Case("top_p", _batch(g, 4, 50, top_p=[0.1, 0.5, 0.9, 1.0])),
        Case("min_p", _batch(g, 4, 50, min_p=[0.0, 0.05, 0.3, 0.9])),
        Case(
            "mixed_batch",
            _batch(g, 5, 300, temperature=[0.0, 0.7, 1.0, 1.3, 0.9], top_k=[0, 20, 0, 5, 40],
                   top_p=[1.0, 0.8, 0.95, 1.0, 0.6], min_p=[0.0, 0.0, 0.1, 0.0, 0.02]),
        ),
        Case("vocab_not_multiple_of_32", _batch(g, 3, 77, temperature=[0.8, 1.0, 0.0], top_k=[7, 0, 0])),
        Case("empty_batch", _batch(g, 0, 16)),
        Case("greedy_ties_lowest_id", dict(_batch(g, 4, 40, temperature=[0.0] * 4), logits=torch.randint(0, 3, (4, 40), generator=g).float())),
        Case("mixed_batch_greedy_ties", dict(_batch(g, 3, 40, temperature=[0.0, 1.0, 0.0]), logits=torch.randint(0, 3, (3, 40), generator=g).float() * 4)),
        Case("one_row_greedy", _batch(g, 1, 64, temperature=[0.0])),
        Case("one_row_sampled", _batch(g, 1, 64, temperature=[0.8], top_k=[10], top_p=[0.9])),
        Case("b2_vocab_129280", _batch(g, 2, VOCAB, temperature=[0.0, 1.0], top_k=[0, 50], min_p=[0.0, 0.05])),
    ]


register(
    OpSpec(
        op="sample",
        cases=_cases,
        cast=("logits",),
        dtypes=(torch.float32,),
        exact=True,
        fp64_oracle=False,
    )
)


def _probs_cases() -> list[Case]:
    g = seeded(3)
    cases = []
    for c in _cases():
        kw = {k: v for k, v in c.kwargs.items() if k != "noise"}
        cases.append(Case(c.name, kw))
    return cases


register(
    OpSpec(
        op="sampling_probs",
        cases=_probs_cases,
        cast=("logits",),
        dtypes=(torch.float32,),
    )
)


def _rejection_batch(g: torch.Generator, n: int, k: int, v: int, drafts: list[int], greedy: list[bool], agree: float) -> dict:
    """Target and draft distributions over ``v`` tokens; drafts drawn from the draft's; a share ``agree``
    of the draft's rows equal the target's (every draft token then survives)."""
    def dist(shape):
        logits = torch.randperm(int(torch.tensor(shape).prod()), generator=g).float().view(*shape) / shape[-1] * 0.7
        return torch.softmax(logits, dim=-1)

    p = dist((n, k + 1, v))
    q = dist((n, k, v))
    same = torch.rand(n, k, generator=g) < agree
    q = torch.where(same[..., None], p[:, :k], q)
    for i, gr in enumerate(greedy):
        if gr:
            p[i] = torch.zeros_like(p[i]).scatter_(-1, p[i].argmax(-1, keepdim=True), 1.0)
    tokens = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(n, k)
    for i, gr in enumerate(greedy):
        if gr:  # a greedy draft: its argmax, with a one-hot distribution
            tokens[i] = torch.where(torch.rand(k, generator=g) < 0.7, p[i, :k].argmax(-1), tokens[i])
            q[i] = torch.zeros_like(q[i]).scatter_(-1, tokens[i][:, None], 1.0)
    return dict(
        target_probs=p, draft_probs=q, draft_tokens=tokens, num_drafts=torch.tensor(drafts, dtype=torch.int64),
        uniform=torch.rand(n, k, generator=g), noise=torch.empty(n, k + 1, v).exponential_(generator=g),
    )


def _rejection_cases() -> list[Case]:
    g = seeded(4)
    return [
        Case("all_accepted", _rejection_batch(g, 3, 4, 40, [4, 4, 4], [False] * 3, agree=1.0)),
        Case("mostly_rejected", _rejection_batch(g, 4, 5, 60, [5, 5, 5, 5], [False] * 4, agree=0.0)),
        Case("mixed_lengths_and_greedy", _rejection_batch(g, 5, 5, 77, [5, 0, 3, 1, 5], [True, False, True, False, False], agree=0.5)),
        Case("empty_batch", _rejection_batch(g, 0, 3, 16, [], [], agree=0.5)),
        Case("uniform_equal_to_ratio_rejects", _boundary()),
        Case("one_row", _rejection_batch(g, 1, 5, 40, [5], [False], agree=0.5)),
        Case("one_row_greedy", _rejection_batch(g, 1, 5, 40, [5], [True], agree=0.5)),
        Case("one_row_no_drafts", _rejection_batch(g, 1, 5, 40, [0], [False], agree=0.5)),
        Case("one_row_vocab_129280_five_drafts", _rejection_batch(g, 1, 5, VOCAB, [5], [False], agree=0.6)),
    ]


def _boundary() -> dict:
    """Exact dyadic probabilities over 4 tokens: row 0's first draft has ``uniform == p/q`` (rejected:
    the test is strict), row 1's first draft is accepted just below the ratio, then its second draft
    names a token the target gives 0 (always rejected)."""
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25]]).repeat(2, 3, 1)
    p[1, 1] = torch.tensor([0.5, 0.0, 0.25, 0.25])
    q = torch.tensor([[0.5, 0.125, 0.125, 0.25]]).repeat(2, 2, 1)
    q[1, 1] = torch.tensor([0.25, 0.25, 0.25, 0.25])
    return dict(
        target_probs=p, draft_probs=q, draft_tokens=torch.tensor([[0, 1], [0, 1]]), num_drafts=torch.tensor([2, 2]),
        uniform=torch.tensor([[0.5, 0.1], [0.4999, 0.1]]), noise=torch.empty(2, 3, 4).exponential_(generator=seeded(5)),
    )


register(
    OpSpec(
        op="rejection_sample",
        cases=_rejection_cases,
        cast=("target_probs", "draft_probs"),
        dtypes=(torch.float32,),
        exact=True,
        fp64_oracle=False,
    )
)

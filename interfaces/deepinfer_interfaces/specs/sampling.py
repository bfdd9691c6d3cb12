"""Sampling cases: greedy, each filter alone and together, a mixed batch, an empty batch.

Compared exactly: given the same logits and the same exponential noise, every
backend must pick the same tokens. Logits are spread wide so that no two
candidates sit within rounding of each other.
"""

import torch

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

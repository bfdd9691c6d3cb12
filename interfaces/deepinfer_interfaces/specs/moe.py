"""MoE cases: routing per scoring function with and without bias and renormalisation,
hash routing, clamped SwiGLU past the limit, grouped experts with -1 and foreign ids,
empty batches. Router logits are spread so no two experts tie in any dtype."""

import torch

from .spec import Case, OpSpec, randn, register, seeded


def _spread_logits(g: torch.Generator, t: int, e: int) -> torch.Tensor:
    """Distinct logits per row on a 0.375 grid (exact in fp16/bf16), so the choice has no ties."""
    return torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).float() * 0.375 - e * 0.375 / 2


def _route_cases() -> list[Case]:
    g = seeded(18)
    out = []
    for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
        out.append(Case(f"t6_e8_k2_{scoring}_bias", dict(logits=_spread_logits(g, 6, 8), bias=torch.randperm(8, generator=g).float() * 0.01, top_k=2, routed_scaling=1.5, scoring=scoring, renormalize=True)))
    out.append(Case("no_bias_no_renormalize", dict(logits=_spread_logits(g, 4, 6), bias=None, top_k=3, routed_scaling=1.0, scoring="sqrtsoftplus", renormalize=False)))
    out.append(Case("bias_changes_choice", dict(logits=_spread_logits(g, 3, 4), bias=torch.tensor([2.0, 0.0, -2.0, 0.5]), top_k=2, routed_scaling=2.0, scoring="sqrtsoftplus", renormalize=True)))
    out.append(Case("empty_batch", dict(logits=torch.empty(0, 8), bias=torch.zeros(8), top_k=2, routed_scaling=1.5, scoring="sqrtsoftplus", renormalize=True)))
    return out


def _hash_cases() -> list[Case]:
    g = seeded(19)
    table = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(32)])
    return [
        Case("t6_v32_e8_k2", dict(logits=randn(6, 8, gen=g), token_ids=torch.randint(0, 32, (6,), generator=g), tid2eid=table, routed_scaling=1.5, scoring="sqrtsoftplus", renormalize=True)),
        Case("sigmoid_no_renormalize", dict(logits=randn(3, 8, gen=g), token_ids=torch.tensor([0, 31, 0]), tid2eid=table, routed_scaling=1.0, scoring="sigmoid", renormalize=False)),
        Case("empty_batch", dict(logits=torch.empty(0, 8), token_ids=torch.empty(0, dtype=torch.int64), tid2eid=table, routed_scaling=1.5, scoring="sqrtsoftplus", renormalize=True)),
    ]


def _swiglu_cases() -> list[Case]:
    g = seeded(20)
    return [
        Case("t5_i16_some_past_limit", dict(gate=randn(5, 16, gen=g, scale=4.0), up=randn(5, 16, gen=g, scale=4.0), limit=3.0)),
        Case("no_limit", dict(gate=randn(3, 8, gen=g), up=randn(3, 8, gen=g), limit=None)),
        Case("empty_batch", dict(gate=torch.empty(0, 8), up=torch.empty(0, 8), limit=10.0)),
    ]


def _experts(g: torch.Generator, t: int, d: int, i: int, e: int, ids: torch.Tensor, limit: float | None) -> dict:
    return dict(
        x=randn(t, d, gen=g),
        topk_ids=ids,
        topk_weights=torch.rand(t, ids.shape[1], generator=g),
        w13=randn(e, 2 * i, d, gen=g, scale=0.5),
        w2=randn(e, d, i, gen=g, scale=0.5),
        limit=limit,
    )


def _expert_cases() -> list[Case]:
    g = seeded(21)
    ids = torch.randint(0, 6, (7, 2), generator=g)
    foreign = torch.tensor([[0, -1], [3, 9], [-1, -1], [2, 2]])
    return [
        Case("t7_d16_i8_e6_k2_clamped", _experts(g, 7, 16, 8, 6, ids, 1.0)),
        Case("minus_one_and_foreign_ids_skipped", _experts(g, 4, 8, 4, 4, foreign, 10.0)),
        Case("no_limit", _experts(g, 3, 8, 4, 3, torch.tensor([[0, 1], [1, 2], [2, 0]]), None)),
        Case("empty_batch", _experts(g, 0, 8, 4, 3, torch.empty(0, 2, dtype=torch.int64), 10.0)),
    ]


register(OpSpec(op="moe_route", cases=_route_cases, cast=("logits",)))
register(OpSpec(op="hash_route", cases=_hash_cases, cast=("logits",)))
register(OpSpec(op="swiglu", cases=_swiglu_cases, cast=("gate", "up")))
register(OpSpec(op="moe_experts", cases=_expert_cases, cast=("x", "w13", "w2")))

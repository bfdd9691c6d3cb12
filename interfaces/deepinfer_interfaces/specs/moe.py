"""MoE cases: routing per scoring function with and without bias and renormalisation,
hash routing, clamped SwiGLU past the limit, grouped experts with -1 and foreign ids,
empty batches. Router logits are spread so no two experts tie in any dtype, except in the
cases about equal scores (integer logits: exact ties, taken in expert order). One token and
V4-Flash's sizes (256 experts, top-6, hidden 4096, intermediate 2048) for every op; the experts
get a relative-RMS limit for their 4096- and 2048-long sums."""

import torch

from .accumulation import SIXTEEN_BIT, rise_then_fall
from .shapes import EXPERTS, HIDDEN, MOE_INTER, ROUTED_SCALING, TOP_K, VOCAB
from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded


def _fine_logits(g: torch.Generator, t: int, e: int) -> torch.Tensor:
    """Distinct logits per row on a 1/16 grid over [-8, 8) (exact in bf16/fp16): no ties among 256 experts."""
    return torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).float() / 16 - e / 32


def _real_route(g: torch.Generator, t: int, scoring: str = "sqrtsoftplus") -> dict:
    bias = torch.randperm(EXPERTS, generator=g).float() * 2**-12  # far below the score gaps: no near ties
    return dict(logits=_fine_logits(g, t, EXPERTS), bias=bias, top_k=TOP_K, routed_scaling=ROUTED_SCALING, scoring=scoring, renormalize=True)


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
    ties = torch.randint(-2, 2, (5, 12), generator=g).float()
    out.append(Case("equal_scores_in_expert_order", dict(logits=ties, bias=None, top_k=4, routed_scaling=1.0, scoring="sqrtsoftplus", renormalize=True)))
    out.append(Case("equal_scores_equal_bias", dict(logits=ties[:3], bias=torch.full((12,), 0.5), top_k=3, routed_scaling=1.0, scoring="sigmoid", renormalize=False)))
    out.append(Case("softmax_over_all_experts_no_renormalize", dict(logits=_spread_logits(g, 3, 8), bias=None, top_k=2, routed_scaling=1.0, scoring="softmax", renormalize=False)))
    out.append(Case("one_token_e256_k6", _real_route(g, 1)))
    out.append(Case("t3_e256_k6_sigmoid", _real_route(g, 3, "sigmoid")))
    out.append(Case("one_token_e256_k6_ties", dict(logits=torch.randint(-3, 3, (1, EXPERTS), generator=g).float(), bias=None, top_k=TOP_K, routed_scaling=ROUTED_SCALING, scoring="sqrtsoftplus", renormalize=True)))
    return out


def _hash_cases() -> list[Case]:
    g = seeded(19)
    table = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(32)])
    real_table = torch.randint(0, EXPERTS, (VOCAB, TOP_K), generator=g)
    return [
        Case("t6_v32_e8_k2", dict(logits=randn(6, 8, gen=g), token_ids=torch.randint(0, 32, (6,), generator=g), tid2eid=table, routed_scaling=1.5, scoring="sqrtsoftplus", renormalize=True)),
        Case("sigmoid_no_renormalize", dict(logits=randn(3, 8, gen=g), token_ids=torch.tensor([0, 31, 0]), tid2eid=table, routed_scaling=1.0, scoring="sigmoid", renormalize=False)),
        Case("empty_batch", dict(logits=torch.empty(0, 8), token_ids=torch.empty(0, dtype=torch.int64), tid2eid=table, routed_scaling=1.5, scoring="sqrtsoftplus", renormalize=True)),
        Case("softmax_over_all_experts_no_renormalize", dict(logits=randn(3, 8, gen=g), token_ids=torch.tensor([5, 6, 5]), tid2eid=table, routed_scaling=1.0, scoring="softmax", renormalize=False)),
        Case("one_token", dict(logits=randn(1, 8, gen=g), token_ids=torch.tensor([17]), tid2eid=table, routed_scaling=1.5, scoring="sqrtsoftplus", renormalize=True)),
        Case("one_token_v129280_e256_k6", dict(logits=randn(1, EXPERTS, gen=g), token_ids=torch.tensor([VOCAB - 1]), tid2eid=real_table, routed_scaling=ROUTED_SCALING, scoring="sqrtsoftplus", renormalize=True)),
        Case("t4_v129280_e256_k6_repeated_token", dict(logits=randn(4, EXPERTS, gen=g), token_ids=torch.tensor([0, 99, 0, 129000]), tid2eid=real_table, routed_scaling=ROUTED_SCALING, scoring="sqrtsoftplus", renormalize=True)),
    ]


def _swiglu_cases() -> list[Case]:
    g = seeded(20)
    return [
        Case("t5_i16_some_past_limit", dict(gate=randn(5, 16, gen=g, scale=4.0), up=randn(5, 16, gen=g, scale=4.0), limit=3.0)),
        Case("no_limit", dict(gate=randn(3, 8, gen=g), up=randn(3, 8, gen=g), limit=None)),
        Case("empty_batch", dict(gate=torch.empty(0, 8), up=torch.empty(0, 8), limit=10.0)),
        Case("gate_clamped_above_only", dict(gate=torch.tensor([[-20.0, -12.0, -10.5, 10.5, 12.0, 0.5]]), up=torch.tensor([[1.0, -12.0, 11.0, -11.0, 1.0, 20.0]]), limit=10.0)),
        Case("one_row_i2048", dict(gate=randn(1, MOE_INTER, gen=g, scale=6.0), up=randn(1, MOE_INTER, gen=g, scale=6.0), limit=10.0)),
        Case("t4_i2048", dict(gate=randn(4, MOE_INTER, gen=g, scale=6.0), up=randn(4, MOE_INTER, gen=g, scale=6.0), limit=10.0)),
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
        Case("one_token", _experts(g, 1, 16, 8, 4, torch.tensor([[3, 1]]), 1.0)),
        Case("one_token_d4096_i2048_k6_real_width", _real_experts(g), dtypes=(torch.float32, torch.bfloat16)),
        Case("accumulation_t2_d4096_i16_k2_rise_then_fall", _accumulation_experts(), dtypes=SIXTEEN_BIT, accumulation=True),
    ]


def _accumulation_experts() -> dict:
    """Two tokens of ones through both of two experts at V4-Flash's hidden size, each gate/up row +1 over the first
    2048 channels and -1 over the rest (noise of 1/64): every 4096-long dot climbs to 2048 and returns to about 1."""
    g = seeded(103)
    e, i = 2, 16
    w13 = torch.stack([rise_then_fall(HIDDEN, 2 * i, g, amplitude=1.0).t() for _ in range(e)])
    return dict(x=torch.ones(2, HIDDEN), topk_ids=torch.tensor([[0, 1], [1, 0]]), topk_weights=torch.tensor([[0.75, 0.25], [0.5, 0.5]]),
                w13=w13, w2=randn(e, HIDDEN, i, gen=g, scale=i**-0.5), limit=10.0)


def _real_experts(g: torch.Generator) -> dict:
    """One token at V4-Flash's width on the one expert of this rank it picked; its other 5 picks are -1 or foreign.
    Weights of std 1/sqrt(fan-in): unit-scale activations, as a trained model has. fp32 and bf16 only
    (the case costs ~1 s a dtype; fp16's 16-bit sums are the bf16 mutant's, 8 times smaller)."""
    ids = torch.tensor([[EXPERTS - 1, 0, -1, 7, 3, 1]])
    return dict(x=randn(1, HIDDEN, gen=g), topk_ids=ids, topk_weights=torch.rand(1, TOP_K, generator=g),
                w13=randn(1, 2 * MOE_INTER, HIDDEN, gen=g, scale=HIDDEN**-0.5), w2=randn(1, HIDDEN, MOE_INTER, gen=g, scale=MOE_INTER**-0.5), limit=10.0)


register(OpSpec(op="moe_route", cases=_route_cases, cast=("logits",)))
register(OpSpec(op="hash_route", cases=_hash_cases, cast=("logits",)))
register(OpSpec(op="swiglu", cases=_swiglu_cases, cast=("gate", "up")))
register(OpSpec(
    op="moe_experts", cases=_expert_cases, cast=("x", "w13", "w2"),
    rms_limits={**RMS_LIMITS, torch.bfloat16: 1e-2},
    rms_reason=("two GEMMs of 4096- and 2048-long dots: partial sums kept in bf16 between K tiles lose several roundings "
                "(1.6e-2 at the real width); bf16 allows 1e-2 because a backend may round the SwiGLU activation to bf16 "
                "before the down projection (up to 7e-3 measured)"),
    accumulation=("the gate/up and down projections' dot products and the weighted sum over a token's experts, in fp32 "
                  "(each expert's output may be rounded to x's dtype before that sum, as grouped GEMMs store it)"),
))

"""Mixture of experts: router scoring, learned and hash routing, clamped SwiGLU experts."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .base import acc_dtype, op
from .invariant import INVARIANT_EXPERT_TILE, elementwise

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def router_scores(logits: torch.Tensor, scoring: str, invariant: bool = False) -> torch.Tensor:
    """Per-expert scores from router logits, in fp32 (fp64 for fp64 logits); ``invariant``: batch-invariant."""
    z = logits.to(acc_dtype(logits))
    if scoring == "sqrtsoftplus":
        return elementwise(torch.nn.functional.softplus, invariant, z).sqrt()
    if scoring == "sigmoid":
        return elementwise(torch.sigmoid, invariant, z)
    if scoring == "softmax":
        return torch.softmax(z, dim=-1)
    raise ValueError(f"unknown router scoring function {scoring!r}; expected one of {', '.join(SCORING_FUNCS)}")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None, invariant: bool = False) -> torch.Tensor:
    """``silu(min(gate, limit)) · clamp(up, −limit, limit)`` in the inputs' dtype; ``invariant``: batch-invariant."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return elementwise(torch.nn.functional.silu, invariant, gate) * up


def _weights(scores: torch.Tensor, ids: torch.Tensor, routed_scaling: float, renormalize: bool) -> torch.Tensor:
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling


class MoEOps:
    @op(rows=("logits",))
    def moe_route(
        self,
        logits: torch.Tensor,
        bias: torch.Tensor | None,
        top_k: int,
        routed_scaling: float,
        scoring: str = "sqrtsoftplus",
        renormalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert choice per token from router logits ``[T, E]``.

        ``scores = f(logits)`` with ``f`` the scoring function (``sqrtsoftplus``:
        ``sqrt(softplus(z))``; ``sigmoid``; ``softmax`` over experts). The
        experts are the ``top_k`` largest ``scores + bias`` (``bias`` ``[E]`` is
        the load-balancing correction, used for the choice only), in descending
        order, ties taken in expert order. Their weights are the unbiased
        scores, divided by their sum ``+ 1e-20`` when ``renormalize``, times
        ``routed_scaling``.

        Returns ``(weights [T, top_k]`` in fp32 (fp64 for fp64 logits),
        ``ids [T, top_k]`` int64).
        """
        scores = router_scores(logits, scoring, self.batch_invariant)
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
        return _weights(scores, ids, routed_scaling, renormalize), ids

    @op(rows=("logits", "token_ids"))
    def hash_route(
        self,
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        tid2eid: torch.Tensor,
        routed_scaling: float,
        scoring: str = "sqrtsoftplus",
        renormalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert choice by a frozen token-id table; weights from the router.

        The experts of token ``t`` are ``tid2eid[token_ids[t]]`` (``tid2eid`` is
        ``[V, top_k]``); the weights are computed from ``logits`` ``[T, E]``
        exactly as in ``moe_route``. Returns ``(weights [T, top_k]`` fp32,
        ``ids [T, top_k]`` int64).
        """
        scores = router_scores(logits, scoring, self.batch_invariant)
        ids = tid2eid[token_ids].to(torch.int64)
        return _weights(scores, ids, routed_scaling, renormalize), ids

    @op(rows=("gate", "up"))
    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
        """Clamped SwiGLU: ``silu(min(gate, limit)) · clamp(up, −limit, limit)``.

        ``limit=None`` clamps nothing. Computed in fp32 (fp64 for fp64 inputs),
        returned in ``gate.dtype``.
        """
        acc = acc_dtype(gate)
        return clamped_swiglu(gate.to(acc), up.to(acc), limit, self.batch_invariant).to(gate.dtype)

    @op(rows=("x", "topk_ids", "topk_weights"))
    def moe_experts(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        limit: float | None,
    ) -> torch.Tensor:
        """Weighted sum of each token's chosen experts, grouped clamped-SwiGLU MLPs.

        ``x`` ``[T, D]``; ``topk_ids`` ``[T, k]`` local expert ids, ``-1`` (or
        any id outside ``[0, E)``, e.g. an expert held by another rank) skipped;
        ``topk_weights`` ``[T, k]``; ``w13`` ``[E, 2I, D]`` holds each expert's
        gate rows then up rows, ``w2`` ``[E, D, I]``::

            out[t] = Σ_k w[t,k] · w2[e] · swiglu(w13[e, :I] · x[t], w13[e, I:] · x[t], limit),  e = ids[t,k]

        Computed in fp32 (fp64 for fp64 x), returned in ``x.dtype``. Nothing
        here waits for the device: small problems run every expert on every
        token and keep the chosen results, larger ones run the (token, expert)
        pairs grouped by expert in fixed-size tiles. In batch-invariant mode
        every problem takes the grouped path, in tiles of a fixed row count.
        """
        acc = acc_dtype(x)
        return expert_mlp(x, topk_ids, topk_weights, w13, w2, limit, lambda w, index: w[index].to(acc), self.batch_invariant)


#: token x expert rows up to which running every expert on every token is cheaper than grouping
_DENSE_ROWS = 1024
#: the largest tile of (token, expert) pairs in the grouped path
_MAX_TILE = 256
#: weight elements one step of the grouped or dense path decodes at most (bounds memory for big experts)
_STEP_ELEMENTS = 1 << 24

#: ``fetch(weight, index)``: the experts ``index`` (a slice or an index tensor) of a stacked weight, in fp32/fp64
ExpertFetch = Callable[[Any, Any], torch.Tensor]


def expert_mlp(x, topk_ids, topk_weights, w13, w2, limit, fetch: ExpertFetch, invariant: bool = False) -> torch.Tensor:
    """``moe_experts`` for any storage of the stacked weights; ``fetch`` decodes the experts a step needs.

    Nothing here waits for the device: small problems run every expert on every
    token and keep the chosen results, larger ones run the (token, expert) pairs
    grouped by expert in fixed-size tiles. Either way at most about
    ``_STEP_ELEMENTS`` weight elements are decoded at a time. ``invariant``
    (batch-invariant mode) always groups, in tiles of ``INVARIANT_EXPERT_TILE``
    pairs: a token's products then have one shape whatever the batch, and its
    experts' outputs are summed in expert order.
    """
    t, d = x.shape
    num_experts = w13.shape[0]
    if t == 0 or num_experts == 0 or topk_ids.shape[1] == 0:
        return x.new_zeros(t, d)
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    step = max(1, _STEP_ELEMENTS // max(w13.shape[1] * w13.shape[2], 1))
    if t * num_experts <= _DENSE_ROWS and not invariant:
        out = _dense_experts(x, topk_ids, topk_weights, valid, w13, w2, limit, fetch, step)
    else:
        out = _grouped_experts(x, topk_ids, topk_weights, valid, w13, w2, limit, fetch, step, invariant)
    return out.to(x.dtype)


def _dense_experts(x, ids, weights, valid, w13, w2, limit, fetch: ExpertFetch, step: int) -> torch.Tensor:
    """Every expert on every token; each token keeps its chosen experts' outputs, weighted."""
    acc = acc_dtype(x)
    t, d = x.shape
    e, two_i = w13.shape[0], w13.shape[1]
    safe = torch.where(valid, ids, 0)
    route = torch.zeros(t, e, dtype=acc, device=x.device).scatter_add_(1, safe, torch.where(valid, weights.to(acc), 0))
    chosen = torch.zeros(t, e, dtype=torch.int32, device=x.device).scatter_add_(1, safe, valid.to(torch.int32)) > 0
    xf = x.to(acc)
    out = None
    for a in range(0, e, step):
        b = min(a + step, e)
        h = (xf @ fetch(w13, slice(a, b)).reshape((b - a) * two_i, d).t()).view(t, b - a, two_i)
        act = clamped_swiglu(h[..., : two_i // 2], h[..., two_i // 2 :], limit)
        act = torch.where(chosen[:, a:b, None], act * route[:, a:b, None], 0)
        y = torch.bmm(act.transpose(0, 1), fetch(w2, slice(a, b)).transpose(1, 2)).sum(0)
        out = y if out is None else out + y
    return out


def _grouped_experts(x, ids, weights, valid, w13, w2, limit, fetch: ExpertFetch, step: int, invariant: bool = False) -> torch.Tensor:
    """The pairs sorted by expert, each expert's run padded to whole tiles, one batched matmul per projection.

    The tile count is bounded by ``pairs / tile + experts`` whatever the routing,
    so every shape is known before the routing is.
    """
    acc = acc_dtype(x)
    t, d = x.shape
    e, two_i = w13.shape[0], w13.shape[1]
    k = ids.shape[1]
    pairs = t * k
    # each tile copies one expert's weights and each expert's run wastes about half a tile:
    # tiles near sqrt(pairs / experts) (times the copy-to-compute cost ratio) balance the two
    tile = INVARIANT_EXPERT_TILE if invariant else min(_MAX_TILE, 1 << max(0, math.isqrt(40 * pairs // e).bit_length() - 1))
    expert = torch.where(valid, ids, e).flatten()  # skipped pairs sort after every expert
    order = torch.argsort(expert, stable=True)
    counts = torch.zeros(e + 1, dtype=torch.int64, device=x.device).scatter_add_(0, expert, torch.ones_like(expert))[:e]
    padded = (counts + tile - 1) // tile * tile
    run_start = torch.cumsum(counts, 0) - counts
    tile_start = torch.cumsum(padded, 0) - padded
    sorted_expert = expert[order]
    own = sorted_expert.clamp(max=e - 1)
    rank = torch.arange(pairs, device=x.device) - run_start[own]
    tiles = (pairs + e * (tile - 1)) // tile + 1
    rows = tiles * tile
    dest = torch.where(sorted_expert < e, tile_start[own] + rank, rows)  # skipped pairs land past the end
    pair_at = torch.full((rows + 1,), -1, dtype=torch.int64, device=x.device).index_copy_(0, dest, order)[:rows]
    tile_expert = torch.bucketize(torch.arange(tiles, device=x.device) * tile, torch.cumsum(padded, 0), right=True).clamp(max=e - 1)
    used = pair_at >= 0
    token = torch.where(used, pair_at // k, 0)
    w = torch.where(used, weights.to(acc).flatten()[pair_at.clamp(min=0)], 0)
    xf = x.to(acc)
    out = torch.zeros(t, d, dtype=acc, device=x.device)
    for a in range(0, tiles, step):
        b = min(a + step, tiles)
        rows_ab = slice(a * tile, b * tile)
        experts_ab = tile_expert[a:b]
        h = _tile_products(xf[token[rows_ab]].view(b - a, tile, d), fetch(w13, experts_ab).transpose(1, 2), invariant)
        act = clamped_swiglu(h[..., : two_i // 2], h[..., two_i // 2 :], limit, invariant)
        act = torch.where(used[rows_ab].view(b - a, tile, 1), act * w[rows_ab].view(b - a, tile, 1), 0)
        y = _tile_products(act, fetch(w2, experts_ab).transpose(1, 2), invariant).view((b - a) * tile, d)
        out.index_add_(0, token[rows_ab], y)
    return out


def _tile_products(a: torch.Tensor, b: torch.Tensor, invariant: bool) -> torch.Tensor:
    """``a[i] @ b[i]`` for every tile ``i``: one batched product, or in batch-invariant mode one product per
    tile, so that a BLAS splits each tile's work the same way however many tiles the step has (a lone
    product's long reduction may be split across threads, a batch's is not)."""
    if not invariant:
        return torch.bmm(a, b)
    return torch.stack([a[i] @ b[i] for i in range(a.shape[0])])

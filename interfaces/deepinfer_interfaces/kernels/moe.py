"""Mixture of experts: router scoring, learned and hash routing, clamped SwiGLU experts."""

from __future__ import annotations

import torch

from .base import acc_dtype, op

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def router_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Per-expert scores from router logits, in fp32 (fp64 for fp64 logits)."""
    z = logits.to(acc_dtype(logits))
    if scoring == "sqrtsoftplus":
        return torch.nn.functional.softplus(z).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(z)
    if scoring == "softmax":
        return torch.softmax(z, dim=-1)
    raise ValueError(f"unknown router scoring function {scoring!r}; expected one of {', '.join(SCORING_FUNCS)}")


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(gate, limit)) · clamp(up, −limit, limit)`` in the inputs' dtype."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def _weights(scores: torch.Tensor, ids: torch.Tensor, routed_scaling: float, renormalize: bool) -> torch.Tensor:
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling


class MoEOps:
    @op
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
        scores = router_scores(logits, scoring)
        choice = scores if bias is None else scores + bias.to(scores.dtype)
        ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
        return _weights(scores, ids, routed_scaling, renormalize), ids

    @op
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
        scores = router_scores(logits, scoring)
        ids = tid2eid[token_ids].to(torch.int64)
        return _weights(scores, ids, routed_scaling, renormalize), ids

    @op
    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
        """Clamped SwiGLU: ``silu(min(gate, limit)) · clamp(up, −limit, limit)``.

        ``limit=None`` clamps nothing. Computed in fp32 (fp64 for fp64 inputs),
        returned in ``gate.dtype``.
        """
        acc = acc_dtype(gate)
        return clamped_swiglu(gate.to(acc), up.to(acc), limit).to(gate.dtype)

    @op
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

        Computed in fp32 (fp64 for fp64 x), returned in ``x.dtype``.
        """
        acc = acc_dtype(x)
        t, d = x.shape
        num_experts, two_i, _ = w13.shape
        out = torch.zeros(t, d, dtype=acc, device=x.device)
        if t == 0:
            return out.to(x.dtype)
        valid = (topk_ids >= 0) & (topk_ids < num_experts)
        xf = x.to(acc)
        for e in torch.unique(topk_ids[valid]).tolist():
            tok, slot = torch.nonzero(valid & (topk_ids == e), as_tuple=True)
            h = xf[tok] @ w13[e].to(acc).t()
            act = clamped_swiglu(h[:, : two_i // 2], h[:, two_i // 2 :], limit)
            y = act @ w2[e].to(acc).t()
            out.index_add_(0, tok, y * topk_weights[tok, slot].to(acc)[:, None])
        return out.to(x.dtype)

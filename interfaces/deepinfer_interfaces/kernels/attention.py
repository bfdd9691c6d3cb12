"""Sparse attention over gathered K=V rows with per-head attention sinks."""

from __future__ import annotations

import torch

from .base import acc_dtype, op


def take_rows(pool: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``pool[indices]`` with ``-1`` rows read as some finite row: for callers that give those rows
    zero weight themselves (a masked score), which saves a pass over the gathered rows."""
    if pool.shape[0] == 0 or indices.numel() == 0:
        return pool.new_zeros((*indices.shape, *pool.shape[1:]))
    return pool[indices.clamp(min=0)]


class AttentionOps:
    @op
    def sparse_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Multi-query attention of each token over its own list of K=V rows.

        ``q`` is ``[T, H, D]``; ``kv`` ``[N, D]`` is the pool that serves as both
        key and value (one shared head); ``indices`` ``[T, K]`` int64 names the
        rows token ``t`` attends to, ``-1`` marking padding. ``sinks`` ``[H]``
        adds one extra logit per head that takes probability mass but
        contributes no value. For token ``t`` and head ``h``::

            s_j = scale · q[t,h] · kv[indices[t,j]]          (valid j only)
            p   = softmax([s_valid..., sinks[h]])
            out = Σ_j p_j · kv[indices[t,j]]                 (the sink's share is dropped)

        A row with no valid index puts all mass on the sink and returns zeros.
        Computed in fp32 (fp64 for fp64 inputs); returned in ``q.dtype``.
        """
        t, h, d = q.shape
        if t == 0 or indices.shape[1] == 0:
            return q.new_zeros(t, h, d)
        acc = acc_dtype(q)
        rows = take_rows(kv, indices).to(acc)  # [T, K, D]; padded rows get zero probability below
        scores = torch.einsum("thd,tkd->thk", q.to(acc), rows) * scale
        scores = scores.masked_fill((indices < 0)[:, None, :], float("-inf"))
        sink = sinks.to(acc)[None, :, None].expand(t, h, 1)
        logits = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
        return torch.einsum("thk,tkd->thd", probs, rows).to(q.dtype)

"""The lightning indexer of compressed sparse attention: scores and top-k selection."""

from __future__ import annotations

import torch

from .attention import take_rows
from .base import acc_dtype, op


class IndexerOps:
    @op
    def indexer_scores(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        indices: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Relevance of each candidate compressed entry to each query token.

        ``q`` is ``[T, H, D]`` indexer queries, ``weights`` ``[T, H]`` per-head
        weights, ``keys`` ``[N, D]`` the pool of indexer keys and ``indices``
        ``[T, K]`` the candidate rows per token (``-1`` = no candidate)::

            score[t, j] = scale · Σ_h weights[t,h] · relu(q[t,h] · keys[indices[t,j]])

        and ``-inf`` where ``indices[t, j] == -1``. Returned in fp32 (fp64 for
        fp64 inputs) whatever the input dtype, since only the ranking is used.
        """
        t, k = indices.shape
        acc = acc_dtype(q)
        if t == 0 or k == 0:
            return torch.empty(t, k, dtype=acc, device=q.device)
        rows = take_rows(keys, indices).to(acc)  # [T, K, D]; padded columns are masked below
        dots = torch.relu(torch.einsum("thd,tkd->thk", q.to(acc), rows))
        scores = torch.einsum("thk,th->tk", dots, weights.to(acc)) * scale
        return scores.masked_fill(indices < 0, float("-inf"))

    @op
    def topk_select(self, scores: torch.Tensor, values: torch.Tensor, k: int) -> torch.Tensor:
        """The ``values`` at the ``k`` highest ``scores`` of each row.

        ``scores`` and ``values`` are ``[T, K]`` (``values`` int64). Output
        ``[T, k]`` int64 in descending score order, equal scores taken in column
        order; a pick whose score is ``-inf`` (an invalid candidate) and the
        columns beyond ``K`` when ``k > K`` are ``-1``.
        """
        t, n = scores.shape
        out = torch.full((t, k), -1, dtype=torch.int64, device=scores.device)
        take = min(k, n)
        if t == 0 or take == 0:
            return out
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :take]
        picked = values.gather(1, order).to(torch.int64)
        finite = scores.gather(1, order) > float("-inf")
        out[:, :take] = torch.where(finite, picked, torch.full_like(picked, -1))
        return out

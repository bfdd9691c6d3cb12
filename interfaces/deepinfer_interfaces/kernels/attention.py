"""Sparse attention over gathered K=V rows with per-head attention sinks."""

from __future__ import annotations

import torch

from .base import acc_dtype, op
from .invariant import INVARIANT_TILE_ROWS
from .tiles import TILE_ELEMENTS, TILE_TOKENS, TileScratch, entry_tiles, take_rows, token_tiles


class AttentionOps:
    @op(rows=("q", "indices"))
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
        # token tiles keep the gathered rows [tt, K, D] within a fixed bound however many tokens a chunk has
        per_tile = max(1, TILE_ELEMENTS // max(indices.shape[1] * max(d, h), 1))
        if self.batch_invariant:
            # every product has the same batch of tokens (the last tile padded with tokens that attend to
            # nothing): a BLAS splits a lone product's long reduction across threads, a batch's it does not
            per_tile = min(per_tile, INVARIANT_TILE_ROWS)
            pad = -t % per_tile
            q = torch.cat([q, q.new_zeros(pad, h, d)])
            indices = torch.cat([indices, indices.new_full((pad, indices.shape[1]), -1)])
        outs = []
        for t0 in range(0, q.shape[0], per_tile):
            idx = indices[t0 : t0 + per_tile]
            rows = take_rows(kv, idx).to(acc)  # [tt, K, D]; padded rows get zero probability below
            scores = torch.bmm(q[t0 : t0 + per_tile].to(acc), rows.transpose(1, 2)) * scale
            scores = scores.masked_fill((idx < 0)[:, None, :], float("-inf"))
            sink = sinks.to(acc)[None, :, None].expand(idx.shape[0], h, 1)
            logits = torch.cat([scores, sink], dim=-1)
            probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
            outs.append(torch.bmm(probs, rows))
        return torch.cat(outs)[:t].to(q.dtype)

    @op(rows=("q", "indices", "token_seq", "visible"))
    def entry_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        table: torch.Tensor,
        token_seq: torch.Tensor,
        visible: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """``sparse_attention`` over a token's listed rows and every compressed entry it sees.

        ``q`` ``[T, H, D]``, ``kv`` ``[P, D]``, ``indices`` ``[T, K]`` listed rows
        (the sliding window; ``-1`` padding), ``sinks`` ``[H]`` and ``scale`` as in
        ``sparse_attention``. Token ``t`` also attends to the entries
        ``j < visible[t]`` of its sequence: the rows ``table[token_seq[t], j]`` of
        ``kv`` (``table`` ``[B, N]``; ``-1`` names no row and is skipped). Equal to
        ``sparse_attention`` over the listed rows followed by those entry rows.

        Walks the entries in tiles with a running softmax (running max, sum and
        weighted rows), so its memory is bounded whatever ``N``: heavily
        compressed attention over a million-token context never gathers
        ``[T, N, D]``. Computed in fp32 (fp64 for fp64 inputs); returned in ``q.dtype``.
        """
        t, h, d = q.shape
        if t == 0:
            return q.new_zeros(t, h, d)
        acc = acc_dtype(q)
        out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
        run = RunningSoftmax(sinks.to(acc), min(t, TILE_TOKENS), d)
        scratch = TileScratch(q.device)
        for t0, t1 in token_tiles(t):
            qt = q[t0:t1].to(acc)
            run.start(t1 - t0)
            idx = indices[t0:t1]
            if idx.shape[1]:
                rows = take_rows(kv, idx).to(acc)
                scores = torch.bmm(qt, rows.transpose(1, 2)).mul_(scale)
                run.absorb(scores.masked_fill_((idx < 0)[:, None, :], float("-inf")), lambda p: torch.bmm(p, rows))
            tiles = entry_tiles(kv, table, token_seq[t0:t1], visible[t0:t1], h, acc, scratch=scratch, invariant=self.batch_invariant)
            for tile in tiles:
                scores = tile.dots(qt, scratch).mul_(scale)
                run.absorb(scores.masked_fill_(tile.invalid[:, None, :], float("-inf")), tile.weighted_rows)
            out[t0:t1] = run.result().to(q.dtype)
        return out


class RunningSoftmax:
    """A softmax-weighted sum of rows taken in tiles: the running maximum, sum and weighted rows per token
    and head. The sink starts it (maximum = sink, sum = 1, no value), so it needs no special case.

    Its state is allocated once for up to ``tokens`` tokens and updated in place, tile after tile: nothing
    it keeps is born between two tiles' large intermediates, so their freed memory stays whole for the next."""

    def __init__(self, sinks: torch.Tensor, tokens: int, dim: int) -> None:
        self.sinks = sinks
        self._top = torch.empty(tokens, sinks.shape[0], dtype=sinks.dtype, device=sinks.device)
        self._total = torch.empty_like(self._top)
        self._acc = torch.empty(tokens, sinks.shape[0], dim, dtype=sinks.dtype, device=sinks.device)
        self.start(tokens)

    def start(self, tokens: int) -> None:
        """Begin a new tile of ``tokens`` tokens (at most the ``tokens`` it was made for)."""
        self.top, self.total, self.acc = self._top[:tokens], self._total[:tokens], self._acc[:tokens]
        self.top.copy_(self.sinks[None, :].expand(tokens, -1))
        self.total.fill_(1.0)
        self.acc.zero_()

    def absorb(self, scores: torch.Tensor, weigh) -> None:
        """Take in ``scores`` ``[t, H, n]`` (``-inf``: no row), overwriting them with their weights;
        ``weigh(p)`` gives ``Σ_n p · row``."""
        top = torch.maximum(self.top, scores.amax(-1))
        keep = torch.exp(self.top - top)
        p = scores.sub_(top[..., None]).exp_()
        self.total.mul_(keep).add_(p.sum(-1))
        self.acc.mul_(keep[..., None]).add_(weigh(p))
        self.top.copy_(top)

    def result(self) -> torch.Tensor:
        return self.acc / self.total[..., None]

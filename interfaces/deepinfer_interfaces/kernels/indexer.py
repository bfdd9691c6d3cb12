"""The lightning indexer of compressed sparse attention: scores, top-k selection, and
V4.1's candidate blocks (the first level of its two-level top-k)."""

from __future__ import annotations

import torch

from .running_topk import running_topk
from .tiles import TILE_TOKENS, EntryTile, TileScratch, entry_tiles, take_rows, token_tiles
from .base import acc_dtype, op


class IndexerOps:
    @op(rows=("q", "weights", "indices"))
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
        In batch-invariant mode both contractions are per-token batched
        products (one shape per token, whatever the batch).
        """
        t, k = indices.shape
        acc = acc_dtype(q)
        if t == 0 or k == 0:
            return torch.empty(t, k, dtype=acc, device=q.device)
        rows = take_rows(keys, indices).to(acc)  # [T, K, D]; padded columns are masked below
        if self.batch_invariant:
            dots = torch.bmm(q.to(acc), rows.transpose(1, 2)).relu_()
            scores = torch.bmm(weights.to(acc)[:, None, :], dots).squeeze(1) * scale
        else:
            dots = torch.relu(torch.einsum("thd,tkd->thk", q.to(acc), rows))
            scores = torch.einsum("thk,th->tk", dots, weights.to(acc)) * scale
        return scores.masked_fill(indices < 0, float("-inf"))

    @op(rows=("scores", "values"))
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

    @op(rows=("q", "weights", "token_seq", "visible"))
    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        table: torch.Tensor,
        token_seq: torch.Tensor,
        visible: torch.Tensor,
        scale: float,
        k: int,
    ) -> torch.Tensor:
        """The ``k`` entries of highest indexer score each token sees: ``indexer_scores`` and
        ``topk_select`` fused, over per-sequence tables instead of per-token lists.

        ``q`` ``[T, H, D]``, ``weights`` ``[T, H]``, ``keys`` ``[P, D]`` and ``scale``
        as in ``indexer_scores``. Token ``t`` sees the entries ``j < visible[t]`` of
        its sequence, whose keys are the rows ``table[token_seq[t], j]`` of ``keys``
        (``table`` ``[B, N]``; ``-1`` names no row: not a candidate). Returns
        ``[T, k]`` int64 entry numbers ``j`` in descending score order, equal scores
        by the lower ``j`` (``topk_select``'s column order), ``-1`` past the
        candidates a token has.

        Scores one tile of entries at a time and merges it into a running top-k,
        so its memory is bounded whatever ``N`` (a million-token context's
        ``[T, N]`` scores never exist).
        """
        t = q.shape[0]
        out = torch.full((t, k), -1, dtype=torch.int64, device=q.device)
        if t == 0 or k == 0 or table.shape[1] == 0:
            return out
        acc = acc_dtype(q)
        heads = q.shape[1]
        scratch = TileScratch(q.device)
        best = running_topk(min(t, TILE_TOKENS), k, acc, q.device, scratch)
        for t0, t1 in token_tiles(t):
            qt, wt = q[t0:t1].to(acc), weights[t0:t1].to(acc)[:, None, :]
            best.start(t1 - t0)
            tiles = entry_tiles(keys, table, token_seq[t0:t1], visible[t0:t1], heads, acc, scratch=scratch,
                                invariant=self.batch_invariant)
            for tile in tiles:
                best.merge(tile_scores(tile, qt, wt, scale, scratch), tile.start)
            out[t0:t1] = best.entries()
        return out

    @op(rows=("q", "weights", "token_seq", "visible"))
    def indexer_block_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        table: torch.Tensor,
        token_seq: torch.Tensor,
        visible: torch.Tensor,
        scale: float,
        topk_blocks: int,
        block_size: int,
    ) -> torch.Tensor:
        """V4.1's candidate blocks over per-sequence tables: ``candidate_blocks`` of the indexer scores,
        as a list of blocks instead of a ``[T, N]`` mask.

        Inputs as in ``indexer_topk``. Block ``b`` covers a token's entries
        ``[b·block_size, (b+1)·block_size)``; its score is the highest indexer score
        among them (``-inf`` with no candidate). The block holding entry
        ``visible[t] − 1`` is pinned (kept, ranked first); then the highest-scoring
        blocks, equal scores to the lower block; a ``-inf`` block is never kept
        unless pinned. Returns ``[T, topk_blocks]`` int64 block numbers in
        ascending order, ``-1`` after the kept ones. Scored in tiles of whole
        blocks with a running top-k, so its memory is bounded whatever ``N``.
        """
        if topk_blocks < 1 or block_size < 1:
            raise ValueError(f"indexer_block_topk: topk_blocks and block_size must be >= 1, got {topk_blocks} and {block_size}")
        t = q.shape[0]
        out = torch.full((t, topk_blocks), -1, dtype=torch.int64, device=q.device)
        if t == 0 or table.shape[1] == 0:
            return out
        acc = acc_dtype(q)
        heads = q.shape[1]
        scratch = TileScratch(q.device)
        best = running_topk(min(t, TILE_TOKENS), topk_blocks, acc, q.device, scratch)
        for t0, t1 in token_tiles(t):
            qt, wt = q[t0:t1].to(acc), weights[t0:t1].to(acc)[:, None, :]
            pinned = torch.div(visible[t0:t1] - 1, block_size, rounding_mode="floor").masked_fill(visible[t0:t1] <= 0, -1)
            best.start(t1 - t0)
            tiles = entry_tiles(keys, table, token_seq[t0:t1], visible[t0:t1], heads, acc, align=block_size, scratch=scratch,
                                invariant=self.batch_invariant)
            for tile in tiles:
                scores = tile_scores(tile, qt, wt, scale, scratch)
                blocks = -(-scores.shape[1] // block_size)
                padded = torch.nn.functional.pad(scores, (0, blocks * block_size - scores.shape[1]), value=float("-inf"))
                maxima = padded.view(t1 - t0, blocks, block_size).amax(-1)
                first = tile.start // block_size
                ids = torch.arange(first, first + blocks, device=q.device)
                best.merge(maxima.masked_fill_(ids[None, :] == pinned[:, None], float("inf")), first)
            kept = best.entries()
            last = torch.iinfo(torch.int64).max  # -1 sorts after every kept block
            ordered = torch.sort(kept.masked_fill(kept < 0, last), dim=1).values
            out[t0:t1] = ordered.masked_fill(ordered == last, -1)
        return out

    @op(rows=("scores", "visible"))
    def candidate_blocks(self, scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
        """The columns of the ``topk_blocks`` best blocks of each row (V4.1's candidate source).

        ``scores`` ``[T, N]``: column ``j`` is compressed entry ``j`` of the
        query's sequence, ``-inf`` where it is not a valid candidate (entries
        ``j >= visible[t]`` always are); ``visible`` ``[T]`` int64. Block ``b``
        covers columns ``[b·block_size, (b+1)·block_size)`` (the last may be
        partial); its score is the max over its columns. When ``visible[t] > 0``
        the block holding entry ``visible[t] − 1`` (the newest, partly filled)
        is pinned: always kept, ranked above every other block. The
        ``topk_blocks`` highest-ranked blocks are kept, ties going to the lower
        block index; a block whose score is ``-inf`` is never kept unless pinned.

        Returns ``[T, N]`` bool, True at every column of a kept block (its
        ``-inf`` columns included); later indexers mask their scores with it
        (``scores.masked_fill(~mask, -inf)``). With ``topk_blocks`` at least the
        number of blocks every finite block is kept: the dense selection.
        """
        if topk_blocks < 1 or block_size < 1:
            raise ValueError(f"candidate_blocks: topk_blocks and block_size must be >= 1, got {topk_blocks} and {block_size}")
        t, n = scores.shape
        if t == 0 or n == 0:
            return torch.zeros(t, n, dtype=torch.bool, device=scores.device)
        nb = -(-n // block_size)
        padded = torch.nn.functional.pad(scores, (0, nb * block_size - n), value=float("-inf"))
        best = padded.view(t, nb, block_size).amax(dim=-1)
        ids = torch.arange(nb, device=scores.device)
        pinned = (visible[:, None] > 0) & (ids[None, :] == torch.div(visible[:, None] - 1, block_size, rounding_mode="floor"))
        # rank by score (stable: equal scores in block order), then move the pinned block first (stable again)
        order = torch.sort(best, dim=-1, descending=True, stable=True).indices
        order = order.gather(1, torch.sort(pinned.gather(1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices)
        rank = torch.empty_like(order).scatter_(1, order, ids.expand(t, nb).contiguous())
        kept = (rank < topk_blocks) & (pinned | (best > float("-inf")))
        return kept.repeat_interleave(block_size, dim=1)[:, :n]


def tile_scores(
    tile: EntryTile, q: torch.Tensor, weights: torch.Tensor, scale: float, scratch: TileScratch | None = None
) -> torch.Tensor:
    """``[tt, n]`` indexer scores of a tile's entries (``-inf``: not a candidate) for ``q`` ``[tt, H, D]``
    and ``weights`` ``[tt, 1, H]`` (in ``scratch``'s ``"scores"`` buffer when given, valid until the next tile)."""
    tt, n = q.shape[0], tile.end - tile.start
    out = scratch.take("scores", (tt, 1, n), q.dtype) if scratch is not None else None
    scores = torch.bmm(weights, tile.dots(q, scratch).relu_(), out=out).squeeze(1).mul_(scale)
    return scores.masked_fill_(tile.invalid, float("-inf"))

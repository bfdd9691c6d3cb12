"""The tiled reference ops equal the untiled ops they fuse, across many tiles of tokens and entries.

``indexer_topk`` must pick what ``topk_select(indexer_scores(...))`` picks over
per-token lists, ties included; ``entry_attention`` must equal ``sparse_attention``
over the window followed by every visible entry. The shapes put several token tiles
and entry tiles in one call, on both paths of ``tiles.entry_tiles`` (keys shared by
few sequences, and each token's own rows).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_interfaces import Kernels
from deepinfer_interfaces.kernels.tiles import SHARED_KEY_SEQS, TILE_TOKENS, entry_tile

K = Kernels()


def _problem(seqs: int, entries: int, tokens: int, heads: int, dim: int, integer: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    make = (lambda *s: torch.randint(-1, 2, s, generator=g).float()) if integer else (lambda *s: torch.randn(*s, generator=g))
    pool = seqs * entries + 50
    table = torch.randperm(pool, generator=g)[: seqs * entries].view(seqs, entries).clone()
    table[0, entries // 3 : entries // 3 + 7] = -1  # blocks not yet written
    seq = torch.randint(0, seqs, (tokens,), generator=g)
    visible = torch.randint(0, entries + 1, (tokens,), generator=g)
    visible[:3] = torch.tensor([0, entries, 1])
    return dict(q=make(tokens, heads, dim), weights=make(tokens, heads).abs() + integer, keys=make(pool, dim), table=table,
                token_seq=seq, visible=visible)


def _per_token(table: torch.Tensor, seq: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    cols = torch.arange(table.shape[1])
    return torch.where(cols[None, :] < visible[:, None], table[seq], -1)


@pytest.mark.parametrize("seqs", [1, SHARED_KEY_SEQS + 2])
@pytest.mark.parametrize("integer", [False, True], ids=["random", "integer_ties"])
def test_indexer_topk_picks_what_scores_then_topk_pick(seqs, integer):
    p = _problem(seqs, 2200, TILE_TOKENS + 40, 16, 16, integer)
    assert entry_tile(TILE_TOKENS, seqs, 16, 16, 2200) < 2200 / 2  # at least three entry tiles
    per_token = _per_token(p["table"], p["token_seq"], p["visible"])
    scores = K.indexer_scores(p["q"], p["weights"], p["keys"], per_token, 0.5)
    entry_ids = torch.arange(2200).expand_as(per_token).contiguous()
    for dtype in (torch.float32, torch.float64):
        cast = {n: (v.to(dtype) if n in ("q", "weights", "keys") else v) for n, v in p.items()}
        want = K.topk_select(scores.to(dtype) if dtype == torch.float64 else scores, entry_ids, 24)
        if dtype == torch.float64:
            want = K.topk_select(K.indexer_scores(cast["q"], cast["weights"], cast["keys"], per_token, 0.5), entry_ids, 24)
        got = K.indexer_topk(**cast, scale=0.5, k=24)
        assert torch.equal(got, want), dtype
    assert (got[0] == -1).all() and (got[2, 1:] == -1).all()  # nothing visible; one entry visible


def test_indexer_topk_k_beyond_the_candidates_pads_with_minus_one():
    p = _problem(1, 10, 5, 2, 8, False)
    got = K.indexer_topk(**p, scale=1.0, k=16)
    assert got.shape == (5, 16)
    assert ((got >= 0).sum(1) == torch.minimum(p["visible"], torch.tensor(10)) - ((p["table"][0][None, :] < 0)
            & (torch.arange(10)[None, :] < p["visible"][:, None])).sum(1)).all()


@pytest.mark.parametrize("seqs", [1, SHARED_KEY_SEQS + 2])
def test_entry_attention_equals_sparse_attention_over_window_and_entries(seqs):
    p = _problem(seqs, 1500, TILE_TOKENS + 17, 16, 32, False, seed=3)
    assert entry_tile(TILE_TOKENS, seqs, 16, 32, 1500) < 1500
    g = torch.Generator().manual_seed(4)
    pool = p["keys"]
    window = torch.randint(-1, pool.shape[0], (p["q"].shape[0], 6), generator=g)
    sinks = torch.randn(16, generator=g)
    for dtype, atol in ((torch.float32, 2e-6), (torch.float64, 1e-12)):
        q, kv = p["q"].to(dtype), pool.to(dtype)
        rows = torch.cat([window, _per_token(p["table"], p["token_seq"], p["visible"])], dim=1)
        want = K.sparse_attention(q, kv, rows, sinks, 0.2)
        got = K.entry_attention(q, kv, window, p["table"], p["token_seq"], p["visible"], sinks, 0.2)
        assert (got - want).abs().max().item() <= atol, dtype


def test_entry_attention_with_nothing_to_attend_returns_zeros():
    q = torch.randn(3, 2, 8)
    out = K.entry_attention(q, torch.randn(4, 8), torch.full((3, 2), -1), torch.zeros(1, 3, dtype=torch.int64),
                            torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.randn(2), 1.0)
    assert torch.equal(out, torch.zeros_like(q))


@pytest.mark.parametrize("seqs", [1, SHARED_KEY_SEQS + 2])
@pytest.mark.parametrize("integer", [False, True], ids=["random", "integer_ties"])
def test_indexer_block_topk_keeps_the_blocks_candidate_blocks_masks(seqs, integer):
    """V4.1's candidate source as a block list, tiled: the blocks ``candidate_blocks`` keeps over every score."""
    p = _problem(seqs, 2200, TILE_TOKENS + 9, 16, 16, integer, seed=5)
    per_token = _per_token(p["table"], p["token_seq"], p["visible"])
    scores = K.indexer_scores(p["q"], p["weights"], p["keys"], per_token, 0.5)
    for topk_blocks, block_size in ((6, 8), (40, 4)):
        mask = K.candidate_blocks(scores, p["visible"], topk_blocks, block_size)
        got = K.indexer_block_topk(**p, scale=0.5, topk_blocks=topk_blocks, block_size=block_size)
        for row, kept in zip(mask, got.tolist()):
            blocks = sorted(set((torch.nonzero(row).flatten() // block_size).tolist()))
            assert kept == blocks + [-1] * (topk_blocks - len(blocks))

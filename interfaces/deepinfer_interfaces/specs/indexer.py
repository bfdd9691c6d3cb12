"""Lightning-indexer cases: scores with -1 padded and fully invalid rows; top-k with
padding, k beyond the candidates and invalid picks; candidate blocks (V4.1's two-level
top-k) with ties, the pinned newest block, a partial last block, nothing visible, rows
of -inf, every block kept, and a real-shape row; empty batches. Every op has one-token
cases and V4-Flash's sizes (64 indexer heads of 128, 512 picks); scores get a long
candidate list and a relative-RMS limit, top-k equal scores (their column order is the rule); scores also
read keys from packed pools (V4's and V4.1's FP4 records, narrow rows)."""

import torch

from ..kv_format import KVFormat
from .kv_formats import SMALL_INDEX, V4_INDEX, V41_INDEX, packed_pool
from .shapes import INDEX_HEAD_DIM, INDEX_HEADS, INDEX_TOPK
from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded


NEG = float("-inf")


def _rows(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _real_scores(g: torch.Generator, t: int, pool: int, k: int) -> dict:
    """V4-Flash's indexer: 64 heads of 128 over ``k`` candidates of a pool (the last quarter of row 0 -1)."""
    idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)])
    idx[0, k - k // 4 :] = -1
    return dict(q=randn(t, INDEX_HEADS, INDEX_HEAD_DIM, gen=g), weights=randn(t, INDEX_HEADS, gen=g, scale=INDEX_HEADS**-0.5),
                keys=randn(pool, INDEX_HEAD_DIM, gen=g), indices=idx, scale=INDEX_HEAD_DIM**-0.5)


def _score_cases() -> list[Case]:
    g = seeded(12)
    idx = torch.randint(0, 12, (6, 9), generator=g)
    idx[0, 4:] = -1
    idx[2] = -1
    return [
        Case("t6_h4_d16_padded", dict(q=randn(6, 4, 16, gen=g), weights=randn(6, 4, gen=g), keys=randn(12, 16, gen=g), indices=idx, scale=0.25)),
        Case("single_head", dict(q=randn(3, 1, 8, gen=g), weights=randn(3, 1, gen=g), keys=randn(5, 8, gen=g), indices=torch.randint(0, 5, (3, 5), generator=g), scale=8**-0.5)),
        Case("no_candidates", dict(q=randn(2, 2, 8, gen=g), weights=randn(2, 2, gen=g), keys=randn(3, 8, gen=g), indices=torch.empty(2, 0, dtype=torch.int64), scale=1.0)),
        Case("empty_batch", dict(q=torch.empty(0, 2, 8), weights=torch.empty(0, 2), keys=randn(3, 8, gen=g), indices=torch.empty(0, 4, dtype=torch.int64), scale=1.0)),
        Case("one_token_h64_d128", _real_scores(g, 1, 700, 600)),
        Case("t2_h64_d128_long_list_4096", _real_scores(g, 2, 5000, 4096)),
        Case("packed_v4_index_keys_t2_h64_d128", _packed_scores(g, 2, INDEX_HEADS, 300, 200, V4_INDEX)),
        Case("one_token_packed_v41_index_keys_h8_d128", _packed_scores(g, 1, 8, 100, 64, V41_INDEX)),
        Case("packed_small_index_keys_t6_h4_d16", _packed_scores(g, 6, 4, 12, 9, SMALL_INDEX)),
    ]


def _packed_scores(g: torch.Generator, t: int, heads: int, pool: int, k: int, fmt: KVFormat) -> dict:
    """Scores of ``k`` candidates (a quarter -1) among ``pool`` keys stored as ``fmt`` records."""
    idx = torch.randint(0, pool, (t, k), generator=g)
    idx[torch.rand(t, k, generator=g) < 0.25] = -1
    return dict(q=randn(t, heads, fmt.dim, gen=g), weights=randn(t, heads, gen=g, scale=heads**-0.5),
                keys=packed_pool(g, [(pool, fmt)]), indices=idx, scale=fmt.dim**-0.5)


def _distinct_scores(g: torch.Generator, t: int, k: int) -> torch.Tensor:
    """Integer-valued scores, distinct per row, exact in every float dtype (so no ties)."""
    return torch.stack([torch.randperm(k, generator=g) for _ in range(t)]).float() - k / 2


def _topk_cases() -> list[Case]:
    g = seeded(13)
    s = _distinct_scores(g, 5, 12)
    s[1, 6:] = float("-inf")
    s[4] = float("-inf")
    vals = torch.randint(0, 1000, (5, 12), generator=g)
    return [
        Case("t5_k12_pick4_with_invalid", dict(scores=s, values=vals, k=4)),
        Case("pick_all", dict(scores=_distinct_scores(g, 3, 6), values=torch.randint(0, 50, (3, 6), generator=g), k=6)),
        Case("k_beyond_candidates", dict(scores=_distinct_scores(g, 2, 3), values=torch.randint(0, 50, (2, 3), generator=g), k=5)),
        Case("no_candidates", dict(scores=torch.empty(3, 0), values=torch.empty(3, 0, dtype=torch.int64), k=2)),
        Case("empty_batch", dict(scores=torch.empty(0, 4), values=torch.empty(0, 4, dtype=torch.int64), k=2)),
        Case("equal_scores_in_column_order", dict(scores=_few_values(g, 4, 16, 4), values=torch.randperm(64, generator=g).view(4, 16), k=6)),
        Case("ties_across_the_cut_and_with_inf", dict(scores=_rows([2, 1, 2, NEG, 1, 2, 1, NEG], [NEG, 3, NEG, 3, 0, 3, 3, NEG]), values=torch.arange(16).view(2, 8) * 10, k=5)),
        Case("one_row", dict(scores=_few_values(g, 1, 9, 3), values=torch.randint(0, 99, (1, 9), generator=g), k=4)),
        Case("one_token_n4096_pick512_ties", dict(scores=_few_values(g, 1, 4096, 300), values=torch.randperm(4096, generator=g)[None], k=INDEX_TOPK)),
        Case("t2_n2048_pick512_random", dict(scores=randn(2, 2048, gen=g), values=torch.randperm(4096, generator=g).view(2, 2048), k=INDEX_TOPK)),
    ]


def _few_values(g: torch.Generator, t: int, k: int, levels: int) -> torch.Tensor:
    """Integer scores from ``levels`` values (exact in every float dtype): equal scores everywhere."""
    return torch.randint(0, levels, (t, k), generator=g).float() - levels // 2


def _visible_only(scores: torch.Tensor, visible: list[int]) -> dict:
    """``scores`` with every entry a query cannot see set to ``-inf``, and its ``visible`` counts."""
    vis = torch.tensor(visible, dtype=torch.int64)
    cols = torch.arange(scores.shape[1])
    return dict(scores=scores.masked_fill(cols[None, :] >= vis[:, None], NEG), visible=vis)


def _candidate_cases() -> list[Case]:
    """Integer scores (exact in every float dtype) so that every tie is a tie in bf16 too."""
    g = seeded(14)
    few_values = torch.randint(0, 3, (4, 32), generator=g).float()  # block maxima tie almost everywhere
    # block size 3, 6 blocks: the pinned block scores lowest (row 0), is all -inf (row 1), is also the best (row 2)
    pin = _rows(
        [9, 1, 0, 8, 2, 2, 7, 0, 1, 6, 6, 6, 5, 0, 0, 1, 0, NEG],
        [9, 1, 0, 8, 2, 2, 7, 0, 1, 6, 6, 6, NEG, NEG, NEG, NEG, NEG, NEG],
        [1, 1, 0, 8, 2, 2, 7, 0, 1, 6, 6, 6, 5, 0, 0, 1, 9, NEG],
    )
    partial = torch.randint(-20, 20, (3, 37), generator=g).float()  # block 8: 4 full blocks and one of 5 columns
    holes = torch.randint(-50, 50, (3, 24), generator=g).float()
    holes[:, 4:8] = NEG  # an invalid block between valid ones
    holes[1, 12:16] = NEG
    real = torch.randn(3, 3000, generator=g)
    real[torch.rand(3, 3000, generator=g) < 0.1] = NEG
    nothing = torch.full((3, 20), NEG)
    nothing[1, :7] = torch.tensor([3.0, 1, 4, 1, 5, 9, 2])
    return [
        Case("ties_between_blocks", dict(_visible_only(few_values, [32, 32, 19, 27]), topk_blocks=3, block_size=4)),
        Case("pinned_newest_block", dict(_visible_only(pin, [17, 17, 17]), topk_blocks=3, block_size=3)),
        Case("partial_last_block", dict(_visible_only(partial, [37, 33, 30]), topk_blocks=2, block_size=8)),
        Case("visible_zero", dict(_visible_only(nothing, [0, 7, 0]), topk_blocks=2, block_size=4)),
        Case("all_neg_inf_rows", dict(scores=torch.full((3, 20), NEG), visible=torch.tensor([20, 5, 1]), topk_blocks=2, block_size=4)),
        Case("topk_beyond_blocks_is_dense", dict(_visible_only(holes, [24, 22, 9]), topk_blocks=8, block_size=4)),
        Case("one_token", dict(_visible_only(torch.randint(-5, 5, (1, 29), generator=g).float(), [26]), topk_blocks=2, block_size=4)),
        Case("t3_n3000_block8_top64", dict(_visible_only(real, [3000, 2500, 1001]), topk_blocks=64, block_size=8)),
        Case("one_token_n4096_block64_top8_ties", dict(_visible_only(torch.randint(0, 4, (1, 4096), generator=g).float(), [4000]), topk_blocks=8, block_size=64)),
        Case("no_entries", dict(scores=torch.empty(2, 0), visible=torch.zeros(2, dtype=torch.int64), topk_blocks=4, block_size=8)),
        Case("empty_batch", dict(scores=torch.empty(0, 16), visible=torch.empty(0, dtype=torch.int64), topk_blocks=2, block_size=8)),
    ]


register(OpSpec(
    op="indexer_scores", cases=_score_cases, cast=("q", "weights", "keys"), rms_limits=RMS_LIMITS,
    rms_reason="64 heads of 128-long dots per candidate, up to 4096 candidates: the fp32 scores a kernel keeps in bf16 lose their ranking",
))
register(OpSpec(op="topk_select", cases=_topk_cases, cast=("scores",), exact=True))
register(OpSpec(op="candidate_blocks", cases=_candidate_cases, cast=("scores",), exact=True))

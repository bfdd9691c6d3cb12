"""Cases of the ops that read every entry a token sees through per-sequence tables (``indexer_topk``,
``indexer_block_topk``, ``entry_attention``): -1 table rows, nothing visible, k beyond the candidates, more sequences
than share their keys, integer inputs whose equal scores test the tie rule, one-token decodes
at V4-Flash's sizes, and long contexts (32,768 CSA entries and 8,192 HCA entries: a
million tokens at ratios 4 and 128, far more entries than one tile holds); empty batches; keys and K=V rows
in packed pools (V4's one FP8 region, V4.1's FP4 entries before its FP8 window rows, FP4 indexer keys)."""

from __future__ import annotations

import torch

from ..kv_format import KVFormat
from .kv_formats import SMALL_ENTRY, SMALL_INDEX, SMALL_WINDOW, V4_INDEX, V4_KV, V41_ENTRY, V41_INDEX, V41_WINDOW, packed_pool, pool_rows
from .shapes import HEAD_DIM, HEADS, INDEX_HEAD_DIM, INDEX_HEADS, INDEX_TOPK, WINDOW
from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded


def _tables(g: torch.Generator, seqs: int, entries: int, pool: int, holes: int = 0) -> torch.Tensor:
    """``[seqs, entries]`` distinct pool rows, the last ``holes`` of sequence 0 -1 (no block yet)."""
    table = torch.randperm(pool, generator=g)[: seqs * entries].view(seqs, entries).clone()
    if holes:
        table[0, entries - holes :] = -1
    return table


def _topk_args(g, tokens: int, heads: int, dim: int, seqs: int, entries: int, k: int, holes: int = 0, visible=None) -> dict:
    pool = seqs * entries + 7
    seq = torch.arange(tokens) % seqs
    vis = torch.randint(0, entries + 1, (tokens,), generator=g) if visible is None else torch.tensor(visible)
    return dict(q=randn(tokens, heads, dim, gen=g), weights=randn(tokens, heads, gen=g, scale=heads**-0.5), keys=randn(pool, dim, gen=g),
                table=_tables(g, seqs, entries, pool, holes), token_seq=seq, visible=vis, scale=dim**-0.5, k=k)


def _packed_keys(g: torch.Generator, args: dict, fmt: KVFormat) -> dict:
    """``args`` with its keys replaced by as many random keys stored as ``fmt`` records."""
    return {**args, "keys": packed_pool(g, [(args["keys"].shape[0], fmt)])}


def _integer(g: torch.Generator, *shape: int, low: int = -1, high: int = 2) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=g).float()


def _topk_cases() -> list[Case]:
    g = seeded(21)
    ties = _topk_args(g, 6, 2, 4, 2, 40, 9)
    ties.update(q=_integer(g, 6, 2, 4), weights=_integer(g, 6, 2, low=1, high=3), keys=_integer(g, ties["keys"].shape[0], 4), scale=0.5)
    return [
        Case("t9_b2_holes_and_nothing_visible", _topk_args(g, 9, 3, 8, 2, 30, 6, holes=5, visible=[0, 30, 1, 12, 29, 30, 7, 0, 26])),
        Case("k_beyond_candidates", _topk_args(g, 4, 2, 8, 1, 5, 8, visible=[5, 3, 0, 5])),
        Case("b6_each_token_its_rows", _topk_args(g, 12, 2, 8, 6, 50, 10)),
        Case("integer_inputs_equal_scores_in_entry_order", ties),
        Case("one_token_decode_h64_d128", _topk_args(g, 1, INDEX_HEADS, INDEX_HEAD_DIM, 1, 700, INDEX_TOPK, visible=[690])),
        Case("t2_long_context_32768_entries", _topk_args(g, 2, 4, 16, 1, 32768, 64, visible=[32768, 20000])),
        Case("no_entries", dict(_topk_args(g, 3, 2, 8, 1, 4, 2), table=torch.empty(1, 0, dtype=torch.int64), visible=torch.zeros(3, dtype=torch.int64))),
        Case("empty_batch", dict(q=torch.empty(0, 2, 8), weights=torch.empty(0, 2), keys=randn(5, 8, gen=g), table=torch.zeros(1, 4, dtype=torch.int64),
                                 token_seq=torch.empty(0, dtype=torch.int64), visible=torch.empty(0, dtype=torch.int64), scale=1.0, k=2)),
        Case("packed_v4_index_keys_t4_b2_h8_d128", _packed_keys(g, _topk_args(g, 4, 8, INDEX_HEAD_DIM, 2, 60, 16, holes=3), V4_INDEX)),
        Case("one_token_packed_v41_index_keys_h8_d128", _packed_keys(g, _topk_args(g, 1, 8, INDEX_HEAD_DIM, 1, 100, 32, visible=[90]), V41_INDEX)),
        Case("packed_small_index_keys_t6_b2_d16", _packed_keys(g, _topk_args(g, 6, 2, 16, 2, 30, 6), SMALL_INDEX)),
    ]


def _picked_scores(kwargs: dict, picks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fp64 scores of each row's picks (``-inf`` at -1, and at a pick the token cannot see).

    A kernel may order near-equal scores differently in 16 bits, so the scores of
    the picks are compared, not the entry numbers; with integer inputs every dtype
    scores exactly and the entry numbers themselves are compared too (the tie rule).
    """
    from ..kernels import Kernels

    f64 = lambda name: kwargs[name].detach().to("cpu", torch.float64)  # noqa: E731
    q, weights, keys = f64("q"), f64("weights"), pool_rows(kwargs["keys"])
    table, seq, visible = (kwargs[n].detach().cpu() for n in ("table", "token_seq", "visible"))
    picks = picks.detach().cpu()
    seen = (picks >= 0) & (picks < visible[:, None]) & (picks < table.shape[1])
    rows = torch.full_like(picks, -1)
    if table.numel():
        rows = torch.where(seen, table[seq[:, None].expand_as(picks), picks.clamp(0, table.shape[1] - 1)], rows)
    scores = Kernels().indexer_scores(q, weights, keys, rows, float(kwargs["scale"]))
    exact = all(bool(torch.equal(t, t.round())) for t in (q, weights, keys))
    return (scores, picks) if exact else (scores,)


def _block_cases() -> list[Case]:
    g = seeded(23)
    ties = _topk_args(g, 6, 2, 4, 2, 40, 0)
    ties.update(q=_integer(g, 6, 2, 4), weights=_integer(g, 6, 2, low=1, high=3), keys=_integer(g, ties["keys"].shape[0], 4), scale=0.5)

    def blocks(args: dict, topk_blocks: int, block_size: int) -> dict:
        return {**{n: v for n, v in args.items() if n != "k"}, "topk_blocks": topk_blocks, "block_size": block_size}

    return [
        Case("t9_b2_holes_pinned_and_nothing_visible", blocks(_topk_args(g, 9, 3, 8, 2, 37, 0, holes=6, visible=[0, 37, 1, 12, 29, 33, 7, 0, 26]), 3, 4)),
        Case("every_block_kept", blocks(_topk_args(g, 4, 2, 8, 1, 20, 0, visible=[20, 13, 4, 1]), 8, 4)),
        Case("b6_each_token_its_rows", blocks(_topk_args(g, 12, 2, 8, 6, 50, 0), 4, 8)),
        Case("integer_inputs_equal_scores_lower_block", blocks(ties, 3, 4)),
        Case("one_token_v41_h64_d128_block8_top64", blocks(_topk_args(g, 1, INDEX_HEADS, INDEX_HEAD_DIM, 1, 700, 0, visible=[690]), 64, 8)),
        Case("t2_long_context_32768_entries_block8_top256", blocks(_topk_args(g, 2, 4, 16, 1, 32768, 0, visible=[32768, 20001]), 256, 8)),
        Case("no_entries", blocks(dict(_topk_args(g, 3, 2, 8, 1, 4, 0), table=torch.empty(1, 0, dtype=torch.int64), visible=torch.zeros(3, dtype=torch.int64)), 2, 4)),
        Case("packed_v41_index_keys_t4_b2_h8_d128_block8", blocks(_packed_keys(g, _topk_args(g, 4, 8, INDEX_HEAD_DIM, 2, 60, 0, holes=5), V41_INDEX), 3, 8)),
        Case("one_token_packed_v4_index_keys_h8_d128_block4", blocks(_packed_keys(g, _topk_args(g, 1, 8, INDEX_HEAD_DIM, 1, 90, 0, visible=[77]), V4_INDEX), 4, 4)),
        Case("packed_small_index_keys_t6_b2_d16_block4", blocks(_packed_keys(g, _topk_args(g, 6, 2, 16, 2, 30, 0), SMALL_INDEX), 3, 4)),
    ]


def _picked_blocks(kwargs: dict, picks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each row's kept blocks as their fp64 block scores, highest first (the pinned block as ``+inf``,
    ``-inf`` past the kept ones), so a kernel may keep either of two near-equal blocks; with integer
    inputs the block numbers themselves too (the tie rule)."""
    from ..kernels import Kernels

    f64 = lambda name: kwargs[name].detach().to("cpu", torch.float64)  # noqa: E731
    q, weights, keys = f64("q"), f64("weights"), pool_rows(kwargs["keys"])
    table, seq, visible = (kwargs[n].detach().cpu() for n in ("table", "token_seq", "visible"))
    picks, size = picks.detach().cpu(), int(kwargs["block_size"])
    n = table.shape[1]
    cols = torch.arange(n)
    lists = torch.where(cols[None, :] < visible[:, None], table[seq], -1) if n else torch.empty(len(seq), 0, dtype=torch.int64)
    scores = Kernels().indexer_scores(q, weights, keys, lists, float(kwargs["scale"]))  # [T, N]
    blocks = -(-n // size) if n else 0
    padded = torch.nn.functional.pad(scores, (0, blocks * size - n), value=float("-inf"))
    maxima = padded.view(len(seq), blocks, size).amax(-1) if blocks else padded.new_empty(len(seq), 0)
    pinned = torch.div(visible - 1, size, rounding_mode="floor")
    values = torch.full(picks.shape, float("-inf"), dtype=torch.float64)
    ok = (picks >= 0) & (picks < blocks)
    if blocks:
        values = torch.where(ok, maxima.gather(1, picks.clamp(0, blocks - 1)), values)
    values = torch.where(ok & (picks == pinned[:, None]) & (visible[:, None] > 0), float("inf"), values)
    ranked = values.sort(dim=1, descending=True).values
    exact = all(bool(torch.equal(t, t.round())) for t in (q, weights, keys))
    return (ranked, picks) if exact else (ranked,)


def _attention_args(g, tokens: int, heads: int, dim: int, seqs: int, entries: int, window: int, visible=None, holes: int = 0) -> dict:
    pool = seqs * entries + window * seqs + 3
    seq = torch.arange(tokens) % seqs
    vis = torch.randint(0, entries + 1, (tokens,), generator=g) if visible is None else torch.tensor(visible)
    win = torch.randint(seqs * entries, pool, (tokens, window), generator=g)
    if window:
        win[:, window // 2 :] = torch.where(torch.rand(tokens, window - window // 2, generator=g) < 0.3, -1, win[:, window // 2 :])
    # unit-RMS logits, as the model's normed q and kv give
    return dict(q=randn(tokens, heads, dim, gen=g), kv=randn(pool, dim, gen=g), indices=win, table=_tables(g, seqs, entries, pool - window * seqs - 3, holes),
                token_seq=seq, visible=vis, sinks=randn(heads, gen=g), scale=dim**-0.5)


def _packed_attention(g: torch.Generator, args: dict, entry: KVFormat, window: KVFormat) -> dict:
    """``args`` with its K=V pool replaced by random rows in a packed pool: the rows its table names (the pool's first
    ``max(table) + 1``) as ``entry`` records, the window rows after them as ``window`` records (one region when the
    formats are one)."""
    rows = args["kv"].shape[0]
    entries = int(args["table"].max()) + 1
    parts = [(rows, entry)] if entry == window else [(entries, entry), (rows - entries, window)]
    return {**args, "kv": packed_pool(g, parts)}


def _attention_cases() -> list[Case]:
    g = seeded(22)
    sink_only = _attention_args(g, 3, 2, 16, 1, 6, 4, visible=[0, 0, 0])
    sink_only["indices"] = torch.full((3, 4), -1)
    return [
        Case("t7_b2_window_and_entries_holes", _attention_args(g, 7, 4, 32, 2, 20, 8, visible=[0, 20, 3, 19, 20, 11, 1], holes=4)),
        Case("no_window_entries_only", _attention_args(g, 4, 2, 16, 1, 9, 0, visible=[9, 4, 0, 1])),
        Case("nothing_visible_sink_only", sink_only),
        Case("b6_each_token_its_rows", _attention_args(g, 12, 2, 16, 6, 30, 4)),
        Case("one_token_decode_h64_d512_window128_hca1024", _attention_args(g, 1, HEADS, HEAD_DIM, 1, 1024, WINDOW, visible=[1000])),
        Case("t2_long_context_8192_entries", _attention_args(g, 2, 4, 64, 1, 8192, 16, visible=[8192, 5000])),
        Case("empty_batch", dict(q=torch.empty(0, 2, 16), kv=randn(6, 16, gen=g), indices=torch.empty(0, 3, dtype=torch.int64), table=torch.zeros(1, 2, dtype=torch.int64),
                                 token_seq=torch.empty(0, dtype=torch.int64), visible=torch.empty(0, dtype=torch.int64), sinks=randn(2, gen=g), scale=0.25)),
        Case("packed_v4_kv_d512_t2_h8", _packed_attention(g, _attention_args(g, 2, 8, HEAD_DIM, 1, 64, 32, visible=[64, 40]), V4_KV, V4_KV)),
        Case("packed_v41_d512_entries_and_window_t2_h8",
             _packed_attention(g, _attention_args(g, 2, 8, HEAD_DIM, 1, 64, 32, visible=[64, 23]), V41_ENTRY, V41_WINDOW)),
        Case("one_token_packed_v41_d512_h16",
             _packed_attention(g, _attention_args(g, 1, 16, HEAD_DIM, 1, 96, 32, visible=[90]), V41_ENTRY, V41_WINDOW)),
        Case("packed_small_two_regions_t7_b2",
             _packed_attention(g, _attention_args(g, 7, 4, 32, 2, 20, 8, visible=[0, 20, 3, 19, 20, 11, 1], holes=4), SMALL_ENTRY, SMALL_WINDOW)),
    ]


register(OpSpec(
    op="indexer_topk", cases=_topk_cases, cast=("q", "weights", "keys"), output=_picked_scores, rms_limits=RMS_LIMITS,
    rms_reason="the picks' scores sum 64 heads of 128-long dots: a kernel that keeps them in bf16 ranks by rounded scores",
))
register(OpSpec(
    op="indexer_block_topk", cases=_block_cases, cast=("q", "weights", "keys"), output=_picked_blocks, rms_limits=RMS_LIMITS,
    rms_reason="block scores are maxima of 64-head indexer sums: a kernel that keeps them in bf16 ranks blocks by rounded scores",
))
register(OpSpec(
    op="entry_attention", cases=_attention_cases, cast=("q", "kv"), rms_limits=RMS_LIMITS,
    rms_reason="a softmax over up to 8,192 entries: sums kept in 16 bits across the tiles drift",
))

"""Sparse-attention cases: gathered windows, -1 padding, windows longer than the
sequence, fully masked rows (sink only), dominant sinks, no candidates, repeated rows,
one token, one head, V4-Flash's shapes (64 heads of 512, a window of 128 plus 512
indexer picks) and a long index list; empty batch; packed pools (V4's FP8 rows with bf16
rotary channels, V4.1's FP4 entries and FP8 window rows in one pool, narrow rows). A
relative-RMS limit catches sums kept in 16 bits over the long lists; the accumulation case (2048 rows of
equal weight that push the output sum up and back down) fails them outright."""

import torch

from ..kv_format import KVFormat
from .kv_formats import SMALL_ENTRY, SMALL_KV, SMALL_WINDOW, V4_KV, V41_ENTRY, V41_WINDOW, packed_pool
from .shapes import HEAD_DIM, HEADS, INDEX_TOPK, WINDOW
from .accumulation import SIXTEEN_BIT, rise_then_fall
from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded


def _window(positions: list[int], width: int) -> torch.Tensor:
    """Pool rows of a causal window: row ``p - j`` for ``j < width``, -1 before the start."""
    p = torch.tensor(positions)[:, None] - torch.arange(width)[None, :]
    return torch.where(p >= 0, p, torch.full_like(p, -1))


def _cases() -> list[Case]:
    g = seeded(11)
    d = 32
    scale = d**-0.5
    rand_idx = torch.randint(0, 20, (5, 7), generator=g)
    rand_idx[1, 3:] = -1
    rand_idx[3, ::2] = -1
    masked = torch.randint(0, 10, (4, 6), generator=g)
    masked[2] = -1
    return [
        Case("t5_h4_d32_random_rows_padded", dict(q=randn(5, 4, d, gen=g), kv=randn(20, d, gen=g), indices=rand_idx, sinks=randn(4, gen=g), scale=scale)),
        Case("window_longer_than_sequence", dict(q=randn(6, 2, d, gen=g), kv=randn(6, d, gen=g), indices=_window([0, 1, 2, 3, 4, 5], 8), sinks=randn(2, gen=g), scale=scale)),
        Case("fully_masked_row_sink_only", dict(q=randn(4, 3, d, gen=g), kv=randn(10, d, gen=g), indices=masked, sinks=randn(3, gen=g), scale=scale)),
        Case("large_sinks", dict(q=randn(3, 2, 16, gen=g), kv=randn(8, 16, gen=g), indices=_window([7, 5, 2], 4), sinks=torch.tensor([6.0, -6.0]), scale=0.25)),
        Case("no_candidates", dict(q=randn(3, 2, 16, gen=g), kv=randn(4, 16, gen=g), indices=torch.empty(3, 0, dtype=torch.int64), sinks=randn(2, gen=g), scale=0.25)),
        Case("empty_batch", dict(q=torch.empty(0, 2, 16), kv=randn(4, 16, gen=g), indices=torch.empty(0, 5, dtype=torch.int64), sinks=randn(2, gen=g), scale=0.25)),
        Case("repeated_rows_count_twice", dict(q=randn(2, 2, d, gen=g), kv=randn(6, d, gen=g), indices=torch.tensor([[1, 1, 1, 4], [0, 2, 2, -1]]), sinks=randn(2, gen=g), scale=scale)),
        Case("padding_before_valid_rows", dict(q=randn(2, 2, d, gen=g), kv=randn(6, d, gen=g), indices=torch.tensor([[-1, -1, 3, 5], [-1, 2, -1, 0]]), sinks=randn(2, gen=g), scale=scale)),
        Case("one_token_one_head", dict(q=randn(1, 1, d, gen=g), kv=randn(5, d, gen=g), indices=torch.tensor([[4, 3, 2, -1]]), sinks=randn(1, gen=g), scale=scale)),
        *_real_cases(g),
        *_packed_cases(g),
        _accumulation_case(),
    ]


def _accumulation_case() -> Case:
    """Two tokens over 2048 rows in order (the second in reverse), every score 0 (q = 0): weights of exactly 1,
    an output sum that climbs to 1024 · 32 and returns near zero, a normaliser of 2049."""
    rows, d = 2048, 64
    order = torch.arange(rows)
    return Case(
        "accumulation_t2_h4_d64_2048_rows_rise_then_fall",
        dict(q=torch.zeros(2, 4, d), kv=rise_then_fall(rows, d, seeded(101)), indices=torch.stack([order, order.flip(0)]),
             sinks=torch.zeros(4), scale=d**-0.5),
        dtypes=SIXTEEN_BIT, accumulation=True,
    )


def _packed(g: torch.Generator, tokens: int, heads: int, parts: list[tuple[int, KVFormat]], picks: int) -> dict:
    """Attention over a packed pool of ``parts`` regions: each token's rows drawn from every region, a third -1."""
    kv = packed_pool(g, parts)
    d = kv.dim
    idx = torch.randint(0, kv.shape[0], (tokens, picks), generator=g)
    idx[torch.rand(tokens, picks, generator=g) < 0.3] = -1
    return dict(q=randn(tokens, heads, d, gen=g), kv=kv, indices=idx, sinks=randn(heads, gen=g), scale=d**-0.5)


def _packed_cases(g: torch.Generator) -> list[Case]:
    v41 = [(64, V41_ENTRY), (128, V41_WINDOW)]
    return [
        Case("packed_v4_kv_d512_t2_h8", _packed(g, 2, 8, [(160, V4_KV)], 96)),
        Case("packed_v41_d512_entries_and_window_t2_h8", _packed(g, 2, 8, v41, 96)),
        Case("one_token_packed_v41_d512_h16", _packed(g, 1, 16, v41, 160)),
        Case("packed_small_two_regions_t5_h4", _packed(g, 5, 4, [(20, SMALL_ENTRY), (12, SMALL_WINDOW)], 9)),
        Case("packed_small_kv_rotary_t3_h2", _packed(g, 3, 2, [(16, SMALL_KV)], 7)),
    ]


def _real(g: torch.Generator, positions: list[int], picks: int, pool: int) -> dict:
    """V4-Flash's attention: 64 heads of 512 over its window of 128 (newest first, -1 before the
    start) then ``picks`` compressed rows (indexer picks, -1 padded past the pool)."""
    window = _window(positions, WINDOW)
    chosen = torch.stack([torch.randperm(pool, generator=g)[:picks] for _ in positions]) + WINDOW * 2 if picks else window[:, :0]
    if picks:
        chosen[0, picks - picks // 4 :] = -1
    # unit-RMS logits, as the model's normed q and kv give
    return dict(q=randn(len(positions), HEADS, HEAD_DIM, gen=g), kv=randn(WINDOW * 2 + pool, HEAD_DIM, gen=g),
                indices=torch.cat([window, chosen], dim=1), sinks=randn(HEADS, gen=g), scale=HEAD_DIM**-0.5)


def _real_cases(g: torch.Generator) -> list[Case]:
    return [
        Case("one_token_decode_h64_d512_window128", _real(g, [200], 0, 0)),
        Case("one_token_early_h8_d512_window_padded", dict(_real(g, [5], 0, 0), q=randn(1, 8, HEAD_DIM, gen=g), sinks=randn(8, gen=g))),
        Case("t1_h64_d512_window128_topk512", _real(g, [255], INDEX_TOPK, 1024)),
        Case("t1_h16_d512_long_list_2176", dict(_real(g, [255], 2048, 2048), q=randn(1, 16, HEAD_DIM, gen=g), sinks=randn(16, gen=g))),
    ]


register(OpSpec(
    op="sparse_attention", cases=_cases, cast=("q", "kv"), rms_limits=RMS_LIMITS,
    rms_reason="softmax-weighted sums over up to 2176 rows: a kernel that keeps its output accumulator in bf16 between key tiles loses several roundings' worth",
    accumulation="the softmax normaliser (the sink included) and the weighted sum of rows, in fp32, across every tile of rows",
))

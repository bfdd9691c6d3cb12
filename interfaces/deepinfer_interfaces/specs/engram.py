"""Engram cases: n-gram hashing (padded windows, products that wrap to negative, the V4.1 layout of 4-grams
and 8 heads), table lookups (FP8 codes as e4m3 or raw bytes, uint8 and e8m0 scales, unquantized tables,
repeated rows, output dtypes) and the gated injection (zero and tiny gates, the V4.1 width of 4 streams
of 5120); one token and an empty batch each.

Hash ids are integers and a lookup only decodes and scales by powers of two, which is exact in every output
dtype here, so both compare exactly; the injection is compared with tolerances.
"""

import torch

from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded

#: DeepSeek V4.1's Engram geometry: 2- to 4-grams, 8 heads, 256 channels, 99092 compressed tokens
V41_N, V41_HEADS, V41_HEAD_DIM, V41_VOCAB = 4, 8, 256, 99092
INT64_MAX = 2**63 - 1


def _hash_inputs(g: torch.Generator, t: int, n: int, heads: int, vocab: int, mult_high: int, pad: int) -> dict:
    """Random windows (some look-backs padded) and moduli near the release's 16M (the op does not need primes)."""
    tokens = torch.randint(0, vocab, (t, n), generator=g)
    for row in range(t):  # the first tokens of a sequence see the pad id beyond their start
        tokens[row, min(row + 1, n) :] = pad
    mult = torch.randint(0, mult_high, (n,), generator=g, dtype=torch.int64) * 2 + 1
    primes = torch.randint(16_000_000, 16_001_000, ((n - 1), heads), generator=g, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), primes.flatten().cumsum(0)[:-1]])
    return dict(tokens=tokens, multipliers=mult, primes=primes, offsets=offsets)


def _hash_cases() -> list[Case]:
    g = seeded(60)
    bound = (INT64_MAX // V41_VOCAB) // 2
    wide = _hash_inputs(g, 6, 3, 2, 1000, INT64_MAX // 4, pad=7)  # products overflow: rolling goes negative
    return [
        Case("v41_t7_n4_h8", _hash_inputs(g, 7, V41_N, V41_HEADS, V41_VOCAB, bound, pad=2)),
        Case("wrapping_products_floored_mod", wide),
        Case("bigrams_one_head", _hash_inputs(g, 5, 2, 1, 50, 1 << 20, pad=0)),
        Case("one_token", _hash_inputs(g, 1, V41_N, V41_HEADS, V41_VOCAB, bound, pad=2)),
        Case("empty_batch", _hash_inputs(g, 0, V41_N, V41_HEADS, V41_VOCAB, bound, pad=2)),
    ]


def _fp8_table(g: torch.Generator, rows: int, head_dim: int, raw: bool, e8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes (no NaN codes) and UE8M0 scales near 1 (so the values stay normal in fp16 too)."""
    codes = torch.randint(0, 256, (rows, head_dim), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # the two NaN codes become 1.5
    scales = torch.randint(120, 135, (rows, head_dim // 32), generator=g, dtype=torch.uint8)
    return (codes if raw else codes.view(torch.float8_e4m3fn)), (scales.view(torch.float8_e8m0fnu) if e8m0 else scales)


def _lookup(g: torch.Generator, rows: int, t: int, c: int, head_dim: int, dtype: torch.dtype, raw=False, e8m0=False) -> dict:
    codes, scales = _fp8_table(g, rows, head_dim, raw, e8m0)
    return dict(codes=codes, scales=scales, ids=torch.randint(0, rows, (t, c), generator=g), dtype=dtype)


def _lookup_cases() -> list[Case]:
    g = seeded(61)
    cols = (V41_N - 1) * V41_HEADS
    repeated = _lookup(g, 10, 4, 6, 64, torch.float32)
    repeated["ids"] = torch.tensor([[0, 9, 9, 0, 3, 3]] * 4)
    plain16 = randn(40, 64, gen=g).to(torch.bfloat16)
    return [
        Case("v41_t3_c24_d256_bf16", _lookup(g, 500, 3, cols, V41_HEAD_DIM, torch.bfloat16)),
        Case("raw_bytes_e8m0_scales_fp32", _lookup(g, 200, 4, cols, V41_HEAD_DIM, torch.float32, raw=True, e8m0=True)),
        Case("fp16_output", _lookup(g, 100, 2, 6, 64, torch.float16)),
        Case("repeated_and_edge_rows", repeated),
        Case("unquantized_bf16_table_to_fp32", dict(codes=plain16, scales=None, ids=torch.randint(0, 40, (5, 3), generator=g), dtype=torch.float32)),
        Case("unquantized_fp32_table_to_bf16", dict(codes=randn(30, 32, gen=g), scales=None, ids=torch.randint(0, 30, (2, 4), generator=g), dtype=torch.bfloat16)),
        Case("one_token", _lookup(g, 300, 1, cols, V41_HEAD_DIM, torch.bfloat16)),
        Case("empty_batch", _lookup(g, 50, 0, cols, V41_HEAD_DIM, torch.bfloat16)),
    ]


def _inject(g: torch.Generator, t: int, n: int, d: int, weight_scale: float = 1.0, stream_scale: float = 1.0) -> dict:
    return dict(
        streams=randn(t, n, d, gen=g, scale=stream_scale),
        key=randn(t, n, d, gen=g),
        value=randn(t, d, gen=g),
        weight=randn(n, d, gen=g, scale=weight_scale),
        eps=1e-6,
    )


def _inject_cases() -> list[Case]:
    g = seeded(62)
    zero = _inject(g, 3, 4, 32)
    zero["weight"] = torch.zeros(4, 32)  # dot 0: sign 0, gate exactly 1/2
    real = _inject(g, 3, 4, 5120)
    real["eps"] = 1e-20  # the release's rms_norm_eps
    return [
        Case("t5_n4_d64", _inject(g, 5, 4, 64)),
        Case("t4_n2_d16_large_streams", _inject(g, 4, 2, 16, weight_scale=3.0, stream_scale=50.0)),
        Case("zero_weight_half_gate", zero),
        Case("tiny_dot_clamped", _inject(g, 3, 4, 32, weight_scale=1e-9)),
        Case("v41_t3_n4_d5120", real),
        Case("one_token", _inject(g, 1, 4, 64)),
        Case("empty_batch", _inject(g, 0, 4, 64)),
    ]


register(OpSpec(op="engram_hash", cases=_hash_cases, cast=(), dtypes=(torch.float32,), exact=True))
register(OpSpec(op="engram_lookup", cases=_lookup_cases, cast=(), dtypes=(torch.float32,), exact=True))
register(OpSpec(
    op="engram_inject", cases=_inject_cases, cast=("streams", "key", "value", "weight"), rms_limits=RMS_LIMITS,
    rms_reason="two mean squares and a dot over D = 5120 per stream: kept in bf16 they move every gate",
))

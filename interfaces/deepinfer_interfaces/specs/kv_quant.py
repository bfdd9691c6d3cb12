"""Packed cache records: ``kv_pack`` (bit-exact records), ``kv_unpack`` (exact values) and ``hadamard``.

``kv_pack`` runs every format in use (``kv_formats.FORMATS``) on random rows and
on rows built to sit on the rules' edges: block maxima at exactly a power of two
times the code's largest value and one fp32 step either side of it, below the
format's floor, all-zero blocks, e4m3 scales at ties and in e4m3's subnormal
range, scales that round down so codes saturate, codes at every tie of the code
format (the e2m1 midpoints 0.25 … 5 times the scale, every e4m3 midpoint),
negative zeros, rotary channels at bf16 ties, NaN and ±inf in blocks and in
rotary channels, FP4 nibble order, one row and an empty batch. Records are
compared byte for byte, with one freedom: inside a block whose scale is NaN
every code and every NaN encoding of the scale decode alike (NaN), so those are
compared as written one way (``canonical_records``).

``kv_unpack`` decodes records packed from rows and records of random bytes
(NaN codes, e4m3 scales in the subnormal range, NaN scales, junk padding), exact
in fp32 and in bf16 (one rounding of the fp32 product). ``hadamard`` runs widths
16 to 128 with the default tolerances.
"""

from __future__ import annotations

import torch

from ..kv_format import CODE_MAX, SCALE_BYTES, KVFormat, pack_rows, record_scales, scale_field
from ..quant import decode_table
from .kv_formats import FORMATS, SMALL_KV, V4_KV, V41_ENTRY
from .shapes import INDEX_HEAD_DIM, INDEX_HEADS
from .spec import Case, OpSpec, randn, register, seeded

NAN, INF = float("nan"), float("inf")
#: the e2m1 values halfway between two neighbours (each goes to the even code) and the values themselves
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_EXACT = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: a bf16 NaN as the records hold one
BF16_NAN = 0x7FC0


def canonical_records(records: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``records`` (on the CPU) with what decodes alike written one way: in each block whose scale is NaN the
    codes as zeros and the scale as the format's NaN, and each NaN rotary channel as one bf16 NaN."""
    rec = records.detach().cpu().clone()
    n = rec.shape[0]
    if n == 0 or tuple(rec.shape) != (n, fmt.record_bytes) or rec.dtype != torch.uint8:
        return rec  # the comparison reports the shape or dtype
    bad = torch.isnan(record_scales(rec, fmt))[..., None]  # [n, num_scales, 1]
    codes = rec[:, : fmt.code_bytes].view(n, fmt.num_scales, -1)
    codes.copy_(codes.masked_fill(bad, 0))
    width = SCALE_BYTES[fmt.scale]
    scales = rec[:, fmt.scale_offset : fmt.scale_offset + fmt.scale_bytes].view(n, fmt.num_scales, width)
    nan = scale_field(torch.full((1, 1), NAN), fmt.scale).view(1, 1, width)
    scales.copy_(torch.where(bad, nan, scales))
    if fmt.rope:
        rope = rec[:, fmt.rope_offset : fmt.scale_offset].contiguous().view(torch.int16)
        rope = torch.where(torch.isnan(rope.view(torch.bfloat16)), torch.tensor(BF16_NAN, dtype=torch.int16), rope)
        rec[:, fmt.rope_offset : fmt.scale_offset] = rope.view(torch.uint8)
    return rec


# ----- rows on the rules' edges -----


def _rope(g: torch.Generator, n: int, fmt: KVFormat) -> torch.Tensor:
    """``[n, rope]`` rotary channels: random, with bf16 ties (to even: down at 1 + 2^-8, up at 1 + 3·2^-8)."""
    rope = randn(n, fmt.rope, gen=g)
    ties = torch.tensor([1 + 2**-8, -(1 + 3 * 2**-8), 3 * (1 + 2**-8), 2**-20 * (1 + 3 * 2**-8)])
    k = min(fmt.rope, ties.numel())
    rope[:, :k] = ties[:k]
    return rope


def _rows(g: torch.Generator, fmt: KVFormat, codes: torch.Tensor) -> torch.Tensor:
    """Full rows: the quantized channels ``codes`` ``[n, quantized]`` then rotary channels."""
    return torch.cat([codes, _rope(g, codes.shape[0], fmt)], dim=1) if fmt.rope else codes


def _blocks_at(g: torch.Generator, fmt: KVFormat, amaxes: list[float]) -> torch.Tensor:
    """Rows whose blocks, in order, have exactly the block maxima ``amaxes`` (one element ±amax at a random
    place, the rest uniform within 0.99 of it); the last row's spare blocks random."""
    nb = fmt.num_scales
    n = -(-len(amaxes) // nb)
    amax = torch.rand(n * nb, generator=g) * 4
    amax[: len(amaxes)] = torch.tensor(amaxes, dtype=torch.float32)
    amax = amax.view(n, nb, 1)
    x = (torch.rand(n, nb, fmt.block, generator=g) * 2 - 1) * 0.99 * amax
    pos = torch.randint(0, fmt.block, (n, nb, 1), generator=g)
    sign = torch.where(torch.rand(n, nb, 1, generator=g) < 0.5, -1.0, 1.0)
    x.scatter_(2, pos, sign * amax)
    # no subnormal inputs: whether a kernel flushes them is not a rule under test
    x = torch.where(x.abs() < torch.finfo(torch.float32).tiny, 0.0, x)
    return x.view(n, fmt.quantized)


def _step(values: list[float], toward: float) -> list[float]:
    """Each value one fp32 step toward ``toward``."""
    t = torch.tensor(values, dtype=torch.float32)
    return torch.nextafter(t, torch.full_like(t, toward)).tolist()


def _scale_edges(g: torch.Generator, fmt: KVFormat) -> torch.Tensor:
    """Block maxima on the scale rules' edges (see the module docstring)."""
    q = CODE_MAX[fmt.code]
    floor = float(torch.tensor(fmt.amax_floor, dtype=torch.float32))
    exps = (-9, -7, -3, 0, 4, 8) if fmt.scale == "e4m3" else (-20, -12, -3, 0, 5, 20)
    exact = [q * 2.0**k for k in exps]
    amaxes = exact + _step(exact, INF) + _step(exact, 0.0) + [floor, floor / 3, floor * 1.5, 0.0]
    if fmt.scale == "e4m3":
        # amax / 6 at e4m3 ties (to the even mantissa), in e4m3's subnormal range, and rounding down (codes saturate)
        amaxes += [q * m * 2.0**-3 for m in (1.0625, 1.1875, 1.03, 1.06)] + [q * m * 2.0**-9 for m in (3, 2.5, 3.5, 7.5)]
    return _rows(g, fmt, _blocks_at(g, fmt, amaxes))


def _code_ties(fmt: KVFormat) -> list[float]:
    """Values (before scaling) at every tie of the code format, its exact values, near-ties and zeros."""
    if fmt.code == "e2m1":
        return [*E2M1_TIES, *E2M1_EXACT, 0.26, 0.74, 2.49, 5.01, 0.1, 0.0, -0.0]
    v = decode_table("e4m3", torch.device("cpu"))[:127].tolist()  # the finite non-negative e4m3 values, ascending
    return [(a + b) / 2 for a, b in zip(v, v[1:])] + [2.0**-11, -0.0, 448.0]


def _block_scales(fmt: KVFormat, n: int) -> list[float]:
    """``n`` scales the format chooses exactly from a block maximum of ``Q · s``."""
    if fmt.scale == "e4m3":
        pool = [0.3125, 1.0, 1.75 * 2.0**-5, 3 * 2.0**-9, 1.125 * 4, 2.0**-9 * 6]
    else:
        pool = [2.0**k for k in (-6, -1, 0, 3, 7)]
    return [pool[i % len(pool)] for i in range(n)]


def _ties(g: torch.Generator, fmt: KVFormat) -> torch.Tensor:
    """Blocks of values at the code format's ties times a scale the block's maximum (``Q · s``) selects exactly."""
    ties = _code_ties(fmt)
    per_block = fmt.block - 1
    nb = fmt.num_scales
    blocks = -(-len(ties) // per_block)
    n = -(-blocks // nb)
    scales = _block_scales(fmt, n * nb)
    x = torch.zeros(n * nb, fmt.block)
    for b in range(n * nb):
        vals = [ties[(b * per_block + i) % len(ties)] for i in range(per_block)]
        signs = torch.where(torch.rand(per_block, generator=g) < 0.5, -1.0, 1.0)
        x[b, 0] = CODE_MAX[fmt.code] * scales[b]
        x[b, 1:] = torch.tensor(vals) * signs * scales[b]
    return _rows(g, fmt, x.view(n, fmt.quantized))


def _nonfinite(g: torch.Generator, fmt: KVFormat) -> torch.Tensor:
    """Rows with a NaN, a +inf and a -inf in some block, NaN and inf rotary channels, a row all NaN, an all-zero
    block, and a finite row."""
    x = _rows(g, fmt, randn(7, fmt.quantized, gen=g))
    last = fmt.quantized - fmt.block
    x[0, 3] = NAN
    x[1, last] = INF
    x[2, fmt.block - 1] = -INF
    x[3] = NAN
    x[4, last : fmt.quantized] = 0.0
    if fmt.rope:
        x[5, fmt.quantized] = NAN
        x[6, -1] = -INF
    return x


def _nibbles(g: torch.Generator, fmt: KVFormat) -> torch.Tensor:
    """FP4 rows of known codes: every e2m1 value (both signs) at random places, each block's first channel 6 (scale 1)."""
    table = decode_table("e2m1", torch.device("cpu"))
    x = table[torch.randint(0, 16, (4, fmt.quantized), generator=g)].view(4, fmt.num_scales, fmt.block)
    x[:, :, 0] = 6.0
    return _rows(g, fmt, x.reshape(4, fmt.quantized))


def _random(g: torch.Generator, fmt: KVFormat, n: int) -> torch.Tensor:
    """Random rows, each at its own magnitude."""
    mag = 10.0 ** (torch.rand(n, 1, generator=g) * 6 - 3)
    return randn(n, fmt.dim, gen=g) * mag


def _pack_cases() -> list[Case]:
    g = seeded(60)
    cases = [Case(f"{tag}_random_t5", dict(values=_random(g, fmt, 5), fmt=fmt)) for tag, fmt in FORMATS.items()]
    for tag, fmt in FORMATS.items():
        cases += [
            Case(f"{tag}_scale_edges", dict(values=_scale_edges(g, fmt), fmt=fmt)),
            Case(f"{tag}_code_ties_to_even", dict(values=_ties(g, fmt), fmt=fmt)),
            Case(f"{tag}_nan_inf_zero_blocks", dict(values=_nonfinite(g, fmt), fmt=fmt)),
        ]
        if fmt.code == "e2m1":
            cases.append(Case(f"{tag}_nibble_order", dict(values=_nibbles(g, fmt), fmt=fmt)))
    return cases + [
        Case("one_row_v4_kv_fp8_d512", dict(values=_random(g, V4_KV, 1), fmt=V4_KV)),
        Case("one_row_small_kv_fp8", dict(values=_random(g, SMALL_KV, 1), fmt=SMALL_KV)),
        Case("empty_batch", dict(values=torch.empty(0, V4_KV.dim), fmt=V4_KV)),
    ]


# ----- records to decode -----


def _put(t: torch.Tensor, values: list) -> None:
    """The leading elements of ``t`` (as many as it holds) set to ``values``."""
    k = min(t.numel(), len(values))
    t.view(-1)[:k] = torch.tensor(values[:k], dtype=t.dtype)


def _random_records(g: torch.Generator, fmt: KVFormat, n: int) -> torch.Tensor:
    """Records of random code bytes (NaN e4m3 codes included), scales from across their range (NaN among them,
    e4m3 scales in the subnormal range), random rotary channels and junk padding."""
    rec = torch.randint(0, 256, (n, fmt.record_bytes), generator=g, dtype=torch.uint8)
    if fmt.rope:
        rec[:, fmt.rope_offset : fmt.scale_offset] = randn(n, fmt.rope, gen=g).to(torch.bfloat16).view(torch.uint8)
    shape = (n, fmt.num_scales)
    if fmt.scale == "ue8m0":
        scales = torch.randint(100, 150, shape, generator=g, dtype=torch.uint8)
        _put(scales, [0xFF, 20, 230])
    elif fmt.scale == "e4m3":
        scales = torch.randint(1, 0x7F, shape, generator=g, dtype=torch.uint8)
        _put(scales, [0x7F, 1, 2, 3, 4, 5, 6, 7, 8])  # NaN, the subnormals, the smallest normal
    else:
        values = randn(*shape, gen=g).abs() * 10.0 ** (torch.rand(shape, generator=g) * 6 - 3)
        values.view(-1)[0] = NAN
        scales = scale_field(values, "fp32")
    rec[:, fmt.scale_offset : fmt.scale_offset + fmt.scale_bytes] = scales
    return rec


def _unpack_cases() -> list[Case]:
    g = seeded(61)
    cases = []
    for tag, fmt in FORMATS.items():
        rows = torch.cat([_random(g, fmt, 4), _nonfinite(g, fmt)[:5]])
        cases += [
            Case(f"{tag}_packed_rows", dict(records=pack_rows(rows, fmt), fmt=fmt, dtype=torch.float32)),
            Case(f"{tag}_random_bytes", dict(records=_random_records(g, fmt, 6), fmt=fmt, dtype=torch.float32)),
            Case(f"{tag}_random_bytes_bf16_out", dict(records=_random_records(g, fmt, 3), fmt=fmt, dtype=torch.bfloat16)),
        ]
    subnormal = _random_records(g, V41_ENTRY, 2)
    subnormal[:, V41_ENTRY.scale_offset : V41_ENTRY.scale_offset + V41_ENTRY.scale_bytes] = torch.arange(1, 9, dtype=torch.uint8).repeat(
        V41_ENTRY.num_scales // 8)
    return cases + [
        Case("v41_entry_fp4_d512_subnormal_e4m3_scales", dict(records=subnormal, fmt=V41_ENTRY, dtype=torch.float32)),
        Case("one_row_v4_kv_fp8_d512", dict(records=pack_rows(_random(g, V4_KV, 1), V4_KV), fmt=V4_KV, dtype=torch.float32)),
        Case("empty_batch", dict(records=torch.empty(0, V4_KV.record_bytes, dtype=torch.uint8), fmt=V4_KV, dtype=torch.float32)),
    ]


def _hadamard_cases() -> list[Case]:
    g = seeded(62)
    return [
        Case("t3_d16", dict(x=randn(3, 16, gen=g))),
        Case("t4_d32", dict(x=randn(4, 32, gen=g))),
        Case("t2_h3_d64", dict(x=randn(2, 3, 64, gen=g))),
        Case("one_row_d128", dict(x=randn(1, INDEX_HEAD_DIM, gen=g))),
        Case("t2_h64_d128_indexer_queries", dict(x=randn(2, INDEX_HEADS, INDEX_HEAD_DIM, gen=g))),
        Case("t4_d128_magnitudes", dict(x=randn(4, INDEX_HEAD_DIM, gen=g) * torch.tensor([1e-3, 1e-1, 1.0, 3.0])[:, None])),
        Case("empty_batch", dict(x=torch.empty(0, 64))),
    ]


register(OpSpec(
    op="kv_pack", cases=_pack_cases, cast=("values",), exact=True,
    output=lambda kwargs, result: canonical_records(result, kwargs["fmt"]),
))
register(OpSpec(op="kv_unpack", cases=_unpack_cases, cast=(), dtypes=(torch.float32,), exact=True))
register(OpSpec(op="hadamard", cases=_hadamard_cases, cast=("x",)))

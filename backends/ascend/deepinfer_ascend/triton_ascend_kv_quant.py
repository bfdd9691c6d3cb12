"""Packed cache records (``deepinfer_interfaces.kv_format``) as Triton-Ascend kernels: ``kv_pack`` (and the
packed ``cache_write``, which packs straight into the pool's rows), ``kv_unpack`` (and ``take_rows``, which
decodes the rows a list names, region by region, for ``sparse_attention``), and the row loader the attention
and indexer kernels read packed pools through.

Why not torch_npu's quantize ops: ``npu_dynamic_mx_quant`` (Ascend 950) with ``scale_alg=1`` and
``max_low_bound`` states DeepSeek's FP8 rule on paper (``2^ceil(log2(max(amax, bound) / 448))``), but it takes
fp32 input only in blocks of 32, says nothing of non-finite blocks, derives the scale from exponent bits inside
the kernel, and its zero-block handling with ``maxLowBound`` differed between kernel templates until a fix
(cann/ops-nn#4310); its FP4 rules (``scale_alg`` 0 and 2) are OCP's ``floor(log2 amax) − emax`` variants, not
``ceil``, and it has no e4m3- or fp32-scaled blocks. ``npu_dynamic_block_quant`` (fp32 ``amax / 448`` per block,
``min_scale``) would match the fp32-scaled FP8 rows only if it divides by the scale rather than multiplying by a
rounded reciprocal, which its documents leave open. Bytes that must equal the reference's cannot rest on that,
so every format runs here.

The math is integer wherever the reference's result is exact, so it does not depend on the device's rounding
of anything but IEEE multiply, divide and compare:

- ue8m0 scales: the exponent ``k = ceil(log2(amax / Q))`` from the bits of ``amax``: the reference's fp32
  quotient lands above ``2^j`` exactly when ``amax > Q·2^j`` (the midpoint above ``2^j`` is ``Q·2^(j−24)``
  past ``Q·2^j``, less than an ulp of ``amax`` there), which compares exponent and mantissa with ``Q``'s;
  codes ``x · 2^-k``;
- e4m3 and fp32 scales: ``amax / Q`` and ``x / s`` as IEEE fp32 divisions (Triton's ``/``), as the reference;
- e4m3 bytes: round to nearest even on the fp32 bits, saturating at ±448 (torch's cast), NaN to ``0x7F``
  with its sign; e2m1 nibbles: the seven midpoints compared, ties to the even code;
- a block holding NaN or ±inf: scale NaN (``0xFF``, ``0x7F``, ``0x7FC00000``), codes NaN (``0x7F`` or, for a
  NaN input with its sign bit, ``0xFF``; e2m1 nibbles ``0x7``), as the reference's ``x / NaN`` gives them;
- rope channels: bf16 bits (a bf16 input copied, others rounded to nearest even; a NaN becomes ``0x7FC0``).

Tiles follow the rules of ``triton_ascend_indexer``: a 1-D grid of one program per vector core walking its
share of tiles, no atomics, no 3-D tiles, reductions only along the last axis of a tile at least
``REDUCE_MIN`` wide. A pack tile is ``[BLOCK_P (row, scale block) pairs, BLOCK_W channels]`` (an FP4 block as
its even and its odd channels, two tiles of half the width, so each byte's two nibbles meet without a
reshape); a second loop writes each row's rope channels and zero padding in ``[BLOCK_R, BLOCK_E]`` tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_interfaces import PackedPool
from deepinfer_interfaces.kv_format import CODE_MAX, KVFormat

from .launch import (
    REDUCE_MIN, Tile, TilePlan, UnifiedBuffer, block, fit_blocks, interpreting, next_power_of_2, program_count, require_fit,
    unified_buffer,
)

#: most (row, block) pairs per pack/unpack tile, rows per rope tile, rope channels per step
BLOCK_P_CAP, BLOCK_R_CAP, BLOCK_E_CAP = 64, 64, 64
#: pairs per tile under the interpreter (two tiles per row at V4.1's 32 blocks, several rows per tile of narrow ones)
INTERPRETER_PAIRS = 16
#: the kernels' scale kinds
SCALE_KINDS = {"ue8m0": 0, "e4m3": 1, "fp32": 2}
#: how decoded rows are rounded before use: to the pool dtype, as ``PackedPool.take`` returns them
ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# ---- encoding and decoding, exact ------------------------------------------------------------


@triton.jit
def _e4m3_byte(y):
    """int32 e4m3 bytes of fp32 ``y``: nearest even, saturated at ±448, NaN as ``0x7F`` with its sign."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    e = a >> 23
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960  # rebias 127 -> 7: (127 - 7) << 3
    shift = tl.minimum(tl.maximum(141 - e, 1), 31)  # subnormal e4m3: the value in units of 2^-9
    mant = (a & 0x7FFFFF) | 0x800000
    sub = (mant + ((1 << (shift - 1)) - 1) + ((mant >> shift) & 1)) >> shift
    code = tl.minimum(tl.where(e >= 121, normal, tl.where(e == 0, 0, sub)), 0x7E)
    return tl.where(a > 0x7F800000, 0x7F, code) | sign


@triton.jit
def _e4m3_value(b):
    """fp32 value of int32 e4m3 bytes ``b`` (NaN for ``0x7F``/``0xFF``)."""
    e = (b >> 3) & 0xF
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _e2m1_nibble(y):
    """int32 e2m1 nibbles of finite fp32 ``y``: nearest value, ties to the even code, saturated at ±6."""
    mag = tl.abs(y)
    code = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32) \
        + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32) + (mag > 5.0).to(tl.int32)
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _e2m1_value(n):
    """fp32 value of int32 e2m1 nibbles ``n``."""
    e = (n >> 1) & 3
    m = n & 1
    normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
    return tl.where((n & 8) != 0, -mag, mag)


@triton.jit
def _bf16_bits(v, IS_BF16: tl.constexpr):
    """int32 bf16 bits of loaded values ``v``: a bf16 load's own bits, else fp32 rounded to nearest even on
    the bits (Triton's interpreter truncates a cast to bf16)."""
    if IS_BF16:
        return v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    bits = v.to(tl.float32).to(tl.int32, bitcast=True)
    a = bits & 0x7FFFFFFF
    r = (a + 0x7FFF + ((a >> 16) & 1)) >> 16
    return tl.where(a > 0x7F800000, 0x7FC0, r | ((bits >> 16) & 0x8000))


@triton.jit
def _cast_out(v, OUT_BF16: tl.constexpr, out_ty: tl.constexpr):
    """fp32 ``v`` as ``out_ty`` for a store, rounded to nearest even."""
    if OUT_BF16:
        return _bf16_bits(v, False).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(out_ty)


@triton.jit
def _scale_value(ptr, g, mask, SCALE: tl.constexpr):
    """fp32 scales number ``g`` of the scale field at ``ptr`` (``SCALE``: 0 ue8m0, 1 e4m3, 2 fp32 little endian)."""
    if SCALE == 0:
        b = tl.load(ptr + g, mask=mask, other=0).to(tl.int32)
        v = tl.where(b == 0, 0x400000, b << 23).to(tl.float32, bitcast=True)
        return tl.where(b == 255, float("nan"), v)
    elif SCALE == 1:
        return _e4m3_value(tl.load(ptr + g, mask=mask, other=0).to(tl.int32))
    else:
        b0 = tl.load(ptr + 4 * g, mask=mask, other=0).to(tl.int32)
        b1 = tl.load(ptr + 4 * g + 1, mask=mask, other=0).to(tl.int32)
        b2 = tl.load(ptr + 4 * g + 2, mask=mask, other=0).to(tl.int32)
        b3 = tl.load(ptr + 4 * g + 3, mask=mask, other=0).to(tl.int32)
        return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _decode_channels(
    rec, offs, mask, QUANT: tl.constexpr, ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    FP4: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr, ROPE: tl.constexpr,
):
    """fp32 values of channels ``offs`` of the records at ``rec`` (zeros where not ``mask``): each code's value
    times its block's scale, the rope channels' bf16 as stored."""
    quant = offs < QUANT
    qm = mask & quant
    if FP4:
        byte = tl.load(rec + offs // 2, mask=qm, other=0).to(tl.int32)
        code = _e2m1_value((byte >> ((offs % 2) * 4)) & 0xF)
    else:
        code = _e4m3_value(tl.load(rec + offs, mask=qm, other=0).to(tl.int32))
    value = tl.where(qm, code * _scale_value(rec + SCALE_OFF, offs // BLOCK, qm, SCALE), 0.0)
    if ROPE:
        rm = mask & (offs >= QUANT)
        at = rec + ROPE_OFF + 2 * (offs - QUANT)
        lo = tl.load(at, mask=rm, other=0).to(tl.int32)
        hi = tl.load(at + 1, mask=rm, other=0).to(tl.int32)
        value = tl.where(quant, value, ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True))
    return value


@triton.jit
def _round_to(v, ROUND: tl.constexpr):
    """``v`` rounded to the pool dtype (``ROUND``: 0 fp32, 1 bf16, 2 fp16) and back to fp32."""
    if ROUND == 1:
        return (_bf16_bits(v, False) << 16).to(tl.float32, bitcast=True)
    elif ROUND == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _load_rows(
    ptr, rows, valid, offs_d, d_ok, stride,
    PACKED: tl.constexpr, FP4: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
    ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr, ROPE: tl.constexpr, ROUND: tl.constexpr,
):
    """``[rows, channels]`` fp32: channels ``offs_d`` of pool rows ``rows`` (zeros where not ``valid`` or
    ``d_ok``): a plain pool's elements, or a packed pool's records decoded and rounded to the pool dtype."""
    at = ptr + rows.to(tl.int64)[:, None] * stride
    mask = valid[:, None] & d_ok[None, :]
    if PACKED:
        v = _decode_channels(at, offs_d[None, :], mask, QUANT, ROPE_OFF, SCALE_OFF, FP4, SCALE, BLOCK, ROPE)
        return _round_to(v, ROUND)
    else:
        return tl.load(at + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)


# ---- what a reading kernel needs of a pool ---------------------------------------------------------


@dataclass(frozen=True)
class RowSource:
    """What a kernel reads rows of a pool through: the storage, its row stride, and the loader's constexprs
    (``_load_rows``); a plain tensor or a one-region packed pool."""

    data: torch.Tensor
    stride: int
    layout: dict[str, int | bool]
    #: the decoded record format, None for a plain pool
    format: KVFormat | None = None


def format_layout(fmt: KVFormat, dtype: torch.dtype) -> dict[str, int | bool]:
    """The loader's constexprs for records of ``fmt`` read back in ``dtype``."""
    return dict(
        PACKED=True, FP4=fmt.code == "e2m1", SCALE=SCALE_KINDS[fmt.scale], BLOCK=fmt.block, QUANT=fmt.quantized,
        ROPE_OFF=fmt.rope_offset, SCALE_OFF=fmt.scale_offset, ROPE=fmt.rope > 0, ROUND=ROUNDING[dtype],
    )


def row_source(pool: torch.Tensor | PackedPool) -> RowSource:
    """The row source of a plain pool (its last dim made contiguous) or of a one-region packed pool."""
    if isinstance(pool, PackedPool):
        (region,) = pool.regions
        return RowSource(region.data, region.format.record_bytes, format_layout(region.format, pool.dtype), region.format)
    data = pool if pool.stride(-1) == 1 else pool.contiguous()
    plain = dict(PACKED=False, FP4=False, SCALE=0, BLOCK=1, QUANT=0, ROPE_OFF=0, SCALE_OFF=0, ROPE=False, ROUND=0)
    return RowSource(data, data.stride(0), plain)


def format_label(fmt: KVFormat) -> str:
    """A format as plans name it: its name and scale kind (V4's FP8 rows come with either)."""
    return f"{fmt.name} {fmt.scale}"


def packed_read_tiles(rows: int, channels: int, fmt: KVFormat | None) -> tuple[Tile, ...]:
    """The tiles ``_load_rows`` adds to a ``[rows, channels]`` read of ``fmt`` records (none for a plain pool)."""
    if fmt is None:
        return ()
    shape = (rows, channels)
    tiles = [
        Tile("code bytes", shape, 1, loaded=True), Tile("code ints", shape, 4), Tile("code values", shape, 4),
        Tile("code offsets", shape, 8), Tile("quantized mask", shape, 1), Tile("scale index", shape, 4),
        Tile("scale bytes", shape, 1, loaded=True), Tile("scale values", shape, 4), Tile("decoded", shape, 4),
    ]
    if fmt.scale == "fp32":
        tiles += [Tile(f"scale byte {i}", shape, 1, loaded=True) for i in range(1, 4)]
    if fmt.rope:
        tiles += [Tile("rope low bytes", shape, 1, loaded=True), Tile("rope high bytes", shape, 1, loaded=True),
                  Tile("rope offsets", shape, 8), Tile("rope bits", shape, 4)]
    return tuple(tiles)


# ---- kv_pack / packed cache_write -----------------------------------------------------------------


def _code_block(fmt: KVFormat) -> int:
    """Channels of one block a tile column holds: the whole block (e4m3), or half of it (FP4's even or odd
    channels); padded to at least ``REDUCE_MIN``, the reduced axis."""
    return max(REDUCE_MIN, next_power_of_2(fmt.block // 2 if fmt.code == "e2m1" else fmt.block))


def _q_bits(qmax: float) -> tuple[int, int]:
    """``Q``'s unbiased exponent and 23-bit mantissa field (``Q = (1 + f/2^23) · 2^e``)."""
    mant, exp = math.frexp(qmax)  # qmax = mant · 2^exp, mant in [0.5, 1)
    return exp - 1, int((mant * 2 - 1) * (1 << 23))


@triton.jit
def _block_max(x, mask):
    """Per row of a ``[P, W]`` fp32 tile: (``max|x|`` over its finite lanes in ``mask``, whether any lane in
    ``mask`` is NaN or ±inf)."""
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bad = (a >= 0x7F800000) & mask
    amax = tl.max(tl.where(bad | ~mask, 0.0, tl.abs(x)), axis=1)
    return amax, tl.max(bad.to(tl.int32), axis=1) > 0


@triton.jit
def _kv_pack_kernel(
    x_ptr, slot_ptr, out_ptr,
    N, LO, HI, stride_x, floor,
    RECORD: tl.constexpr, GROUPS: tl.constexpr, QUANT: tl.constexpr, ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    ROPE: tl.constexpr, PAD: tl.constexpr, FP4: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr,
    QMAX: tl.constexpr, Q_EXP: tl.constexpr, Q_MANT: tl.constexpr, X_BF16: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_w = tl.arange(0, BLOCK_W)
    if FP4:
        w_ok = offs_w < BLOCK // 2
    else:
        w_ok = offs_w < BLOCK
    for tile in range(pid, tl.cdiv(N * GROUPS, BLOCK_P), NUM_PROGRAMS):
        p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        r = p // GROUPS
        g = p % GROUPS
        slot = tl.load(slot_ptr + r, mask=p < N * GROUPS, other=-1)
        keep = (p < N * GROUPS) & (slot >= LO) & (slot < HI)
        dst = out_ptr + (slot - LO).to(tl.int64) * RECORD
        src = x_ptr + r.to(tl.int64) * stride_x + g * BLOCK
        m = keep[:, None] & w_ok[None, :]
        if FP4:
            xe = tl.load(src[:, None] + 2 * offs_w[None, :], mask=m, other=0.0).to(tl.float32)
            xo = tl.load(src[:, None] + 2 * offs_w[None, :] + 1, mask=m, other=0.0).to(tl.float32)
            amax_e, bad_e = _block_max(xe, m)
            amax_o, bad_o = _block_max(xo, m)
            amax = tl.maximum(amax_e, amax_o)
            bad = bad_e | bad_o
        else:
            xe = tl.load(src[:, None] + offs_w[None, :], mask=m, other=0.0).to(tl.float32)
            amax, bad = _block_max(xe, m)
        amax = tl.maximum(amax, floor)
        # the scale and its stored form; ``mul``/``div``: what the block is multiplied or divided by
        if SCALE == 0:
            a = amax.to(tl.int32, bitcast=True)
            k = (a >> 23) - 127 - Q_EXP + ((a & 0x7FFFFF) > Q_MANT).to(tl.int32)
            mul = ((127 - k) << 23).to(tl.float32, bitcast=True)[:, None]
            div = 1.0
            stored = tl.where(bad, 255, tl.minimum(tl.maximum(k + 127, 0), 254))
        else:
            s = amax / QMAX
            if SCALE == 1:
                stored = _e4m3_byte(s)
                s = _e4m3_value(stored)
                stored = tl.where(bad, 0x7F, stored)
            else:
                stored = tl.where(bad, 0x7FC00000, s.to(tl.int32, bitcast=True))
            mul = 1.0
            div = s[:, None]
        ye = tl.minimum(tl.maximum(xe * mul / div, -QMAX), QMAX)
        # codes: a non-finite block's are NaN, as x / NaN gives them
        if FP4:
            yo = tl.minimum(tl.maximum(xo * mul / div, -QMAX), QMAX)
            byte = tl.where(bad[:, None], 0x77, _e2m1_nibble(ye) | (_e2m1_nibble(yo) << 4))
            tl.store(dst[:, None] + g[:, None] * (BLOCK // 2) + offs_w[None, :], byte.to(tl.uint8), mask=m)
        else:
            xb = xe.to(tl.int32, bitcast=True)
            nan = 0x7F | tl.where((xb & 0x7FFFFFFF) > 0x7F800000, (xb >> 24) & 0x80, 0)
            byte = tl.where(bad[:, None], nan, _e4m3_byte(ye))
            tl.store(dst[:, None] + g[:, None] * BLOCK + offs_w[None, :], byte.to(tl.uint8), mask=m)
        if SCALE == 2:
            at = dst + SCALE_OFF + 4 * g
            tl.store(at, (stored & 0xFF).to(tl.uint8), mask=keep)
            tl.store(at + 1, ((stored >> 8) & 0xFF).to(tl.uint8), mask=keep)
            tl.store(at + 2, ((stored >> 16) & 0xFF).to(tl.uint8), mask=keep)
            tl.store(at + 3, ((stored >> 24) & 0xFF).to(tl.uint8), mask=keep)
        else:
            tl.store(dst + SCALE_OFF + g, stored.to(tl.uint8), mask=keep)
    # each row's rope channels (bf16) and zero padding
    offs_e = tl.arange(0, BLOCK_E)
    for tile in range(pid, tl.cdiv(N, BLOCK_R), NUM_PROGRAMS):
        r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        slot = tl.load(slot_ptr + r, mask=r < N, other=-1)
        keep = (r < N) & (slot >= LO) & (slot < HI)
        dst = out_ptr + (slot - LO).to(tl.int64) * RECORD
        for e0 in range(0, ROPE, BLOCK_E):
            e = e0 + offs_e
            m = keep[:, None] & (e < ROPE)[None, :]
            v = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + QUANT + e[None, :], mask=m, other=0.0)
            bits = _bf16_bits(v, X_BF16)
            at = dst[:, None] + ROPE_OFF + 2 * e[None, :]
            tl.store(at, (bits & 0xFF).to(tl.uint8), mask=m)
            tl.store(at + 1, ((bits >> 8) & 0xFF).to(tl.uint8), mask=m)
        if PAD > 0:
            e = tl.arange(0, 4)
            zeros = tl.zeros([BLOCK_R, 4], dtype=tl.uint8)
            tl.store(dst[:, None] + (RECORD - PAD) + e[None, :], zeros, mask=keep[:, None] & (e < PAD)[None, :])


def _rope_block(fmt: KVFormat, interpret: bool) -> int:
    return block(fmt.rope, 16 if interpret else BLOCK_E_CAP) if fmt.rope else 1


def plan_kv_pack(fmt: KVFormat, dtype: torch.dtype, ub: UnifiedBuffer, *, interpret: bool = False) -> TilePlan:
    """Blocks of ``_kv_pack_kernel`` for rows of ``dtype`` packed as ``fmt``: ``BLOCK_W`` one block's channels
    (half of them per tile for FP4), ``BLOCK_P`` pairs and ``BLOCK_R`` rope rows shrinking until the tiles fit."""
    bw, be = _code_block(fmt), _rope_block(fmt, interpret)
    xs = torch.empty((), dtype=dtype).element_size()
    halves = 2 if fmt.code == "e2m1" else 1

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bp, br = b["BLOCK_P"], b["BLOCK_R"]
        shape = (bp, bw)
        per_half = (
            Tile("x", shape, xs, loaded=True), Tile("x fp32", shape, 4), Tile("x bits", shape, 4), Tile("non-finite", shape, 1),
            Tile("|x|", shape, 4), Tile("y", shape, 4), Tile("y bits", shape, 4), Tile("code", shape, 4), Tile("x offsets", shape, 8),
        )
        out = list(per_half) * halves + [
            Tile("byte", shape, 4), Tile("out offsets", shape, 8), Tile("mask", shape, 1),
            Tile("slots", (bp,), 8, loaded=True), Tile("amax", (bp,), 4), Tile("scale", (bp,), 4), Tile("stored", (bp,), 4),
            Tile("bad", (bp,), 1), Tile("rows", (bp,), 8),
            Tile("rope", (br, be), xs, loaded=True), Tile("rope bits", (br, be), 4), Tile("rope offsets", (br, be), 8),
            Tile("rope mask", (br, be), 1), Tile("pad", (br, 4), 1), Tile("rope slots", (br,), 8, loaded=True),
        ]
        return tuple(out)

    start = {"BLOCK_P": INTERPRETER_PAIRS if interpret else BLOCK_P_CAP, "BLOCK_W": bw, "BLOCK_R": 4 if interpret else BLOCK_R_CAP,
             "BLOCK_E": be}
    shape = f"{format_label(fmt)}, {str(dtype).removeprefix('torch.')}"
    return fit_blocks("kv_pack", shape, ub, start, {"BLOCK_W": bw, "BLOCK_E": be}, tiles)


def _check_width(what: str, got: int, want: int, fmt: KVFormat, unit: str) -> None:
    if got != want:
        raise ValueError(f"{what}: {fmt.name} takes {want} {unit} a row, got {got}; give rows of the format's width")


def pack_into(records: torch.Tensor, slots: torch.Tensor, start: int, values: torch.Tensor, fmt: KVFormat) -> None:
    """Write ``values[i]`` packed as ``fmt`` into row ``slots[i] − start`` of ``records`` where that row exists
    (``slots[i]`` in ``[start, start + rows)``; others, ``-1`` among them, are skipped)."""
    _check_width("kv_pack", values.shape[-1], fmt.dim, fmt, "channels")
    n = values.shape[0]
    if values.dim() != 2 or slots.shape != (n,):
        raise ValueError(f"cache_write: values [n, {fmt.dim}] and slots [n] must agree, got {tuple(values.shape)} and "
                         f"{tuple(slots.shape)}; give one slot per row")
    if n == 0 or records.shape[0] == 0:
        return
    plan = require_fit(plan_kv_pack(fmt, values.dtype, unified_buffer(values.device), interpret=interpreting()))
    x = values if values.stride(-1) == 1 else values.contiguous()
    q_exp, q_mant = _q_bits(CODE_MAX[fmt.code])
    programs = program_count(values.device)
    _kv_pack_kernel[(programs,)](
        x, slots.to(torch.int64).contiguous(), records,
        n, start, start + records.shape[0], x.stride(0), float(fmt.amax_floor),
        RECORD=fmt.record_bytes, GROUPS=fmt.num_scales, QUANT=fmt.quantized, ROPE_OFF=fmt.rope_offset,
        SCALE_OFF=fmt.scale_offset, ROPE=fmt.rope, PAD=fmt.record_bytes - fmt.scale_offset - fmt.scale_bytes,
        FP4=fmt.code == "e2m1", SCALE=SCALE_KINDS[fmt.scale], BLOCK=fmt.block, QMAX=CODE_MAX[fmt.code],
        Q_EXP=q_exp, Q_MANT=q_mant, X_BF16=x.dtype == torch.bfloat16,
        NUM_PROGRAMS=programs, **plan.blocks,
    )


def kv_pack(values: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``Kernels.kv_pack`` for fp32/fp16/bf16 rows."""
    n = values.shape[0]
    out = torch.empty(n, fmt.record_bytes, dtype=torch.uint8, device=values.device)
    pack_into(out, torch.arange(n, device=values.device), 0, values, fmt)
    return out


# ---- kv_unpack ----------------------------------------------------------------------------------


@triton.jit
def _kv_unpack_kernel(
    rec_ptr, row_ptr, out_ptr,
    N, LO, HI, stride_o,
    RECORD: tl.constexpr, GROUPS: tl.constexpr, QUANT: tl.constexpr, ROPE_OFF: tl.constexpr, SCALE_OFF: tl.constexpr,
    ROPE: tl.constexpr, FP4: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_w = tl.arange(0, BLOCK_W)
    if FP4:
        w_ok = offs_w < BLOCK // 2
    else:
        w_ok = offs_w < BLOCK
    for tile in range(pid, tl.cdiv(N * GROUPS, BLOCK_P), NUM_PROGRAMS):
        p = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        i = p // GROUPS
        g = p % GROUPS
        row = tl.load(row_ptr + i, mask=p < N * GROUPS, other=-1)
        keep = (p < N * GROUPS) & (row >= LO) & (row < HI)
        rec = rec_ptr + (row - LO).to(tl.int64) * RECORD
        scale = _scale_value(rec + SCALE_OFF, g, keep, SCALE)
        m = keep[:, None] & w_ok[None, :]
        out = out_ptr + i.to(tl.int64)[:, None] * stride_o + g[:, None] * BLOCK
        if FP4:
            byte = tl.load(rec[:, None] + g[:, None] * (BLOCK // 2) + offs_w[None, :], mask=m, other=0).to(tl.int32)
            lo = _e2m1_value(byte & 0xF) * scale[:, None]
            hi = _e2m1_value(byte >> 4) * scale[:, None]
            tl.store(out + 2 * offs_w[None, :], _cast_out(lo, OUT_BF16, out_ptr.dtype.element_ty), mask=m)
            tl.store(out + 2 * offs_w[None, :] + 1, _cast_out(hi, OUT_BF16, out_ptr.dtype.element_ty), mask=m)
        else:
            byte = tl.load(rec[:, None] + g[:, None] * BLOCK + offs_w[None, :], mask=m, other=0).to(tl.int32)
            v = _e4m3_value(byte) * scale[:, None]
            tl.store(out + offs_w[None, :], _cast_out(v, OUT_BF16, out_ptr.dtype.element_ty), mask=m)
    offs_e = tl.arange(0, BLOCK_E)
    for tile in range(pid, tl.cdiv(N, BLOCK_R), NUM_PROGRAMS):
        i = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row = tl.load(row_ptr + i, mask=i < N, other=-1)
        keep = (i < N) & (row >= LO) & (row < HI)
        rec = rec_ptr + (row - LO).to(tl.int64) * RECORD
        for e0 in range(0, ROPE, BLOCK_E):
            e = e0 + offs_e
            m = keep[:, None] & (e < ROPE)[None, :]
            at = rec[:, None] + ROPE_OFF + 2 * e[None, :]
            lo = tl.load(at, mask=m, other=0).to(tl.int32)
            hi = tl.load(at + 1, mask=m, other=0).to(tl.int32)
            v = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
            out = out_ptr + i.to(tl.int64)[:, None] * stride_o + QUANT + e[None, :]
            tl.store(out, _cast_out(v, OUT_BF16, out_ptr.dtype.element_ty), mask=m)


def plan_kv_unpack(fmt: KVFormat, dtype: torch.dtype, ub: UnifiedBuffer, *, interpret: bool = False) -> TilePlan:
    """Blocks of ``_kv_unpack_kernel`` for ``fmt`` records read back in ``dtype`` (as ``plan_kv_pack``)."""
    bw, be = _code_block(fmt), _rope_block(fmt, interpret)
    xs = torch.empty((), dtype=dtype).element_size()
    halves = 2 if fmt.code == "e2m1" else 1

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bp, br = b["BLOCK_P"], b["BLOCK_R"]
        shape = (bp, bw)
        per_half = (Tile("value", shape, 4), Tile("out", shape, xs), Tile("out offsets", shape, 8))
        return tuple(list(per_half) * halves + [
            Tile("bytes", shape, 1, loaded=True), Tile("byte ints", shape, 4), Tile("code values", shape, 4),
            Tile("byte offsets", shape, 8), Tile("mask", shape, 1),
            Tile("scale bytes", (bp,), 4 if fmt.scale == "fp32" else 1, loaded=True), Tile("scale", (bp,), 4),
            Tile("rows", (bp,), 8, loaded=True), Tile("record offsets", (bp,), 8), Tile("keep", (bp,), 1),
            Tile("rope rows", (br,), 8, loaded=True), Tile("rope record offsets", (br,), 8),
            Tile("rope low", (br, be), 1, loaded=True), Tile("rope high", (br, be), 1, loaded=True),
            Tile("rope bits", (br, be), 4), Tile("rope out", (br, be), xs), Tile("rope offsets", (br, be), 8),
            Tile("rope mask", (br, be), 1),
        ])

    start = {"BLOCK_P": INTERPRETER_PAIRS if interpret else BLOCK_P_CAP, "BLOCK_W": bw,
             "BLOCK_R": 4 if interpret else BLOCK_R_CAP, "BLOCK_E": be}
    shape = f"{format_label(fmt)}, {str(dtype).removeprefix('torch.')}"
    return fit_blocks("kv_unpack", shape, ub, start, {"BLOCK_W": bw, "BLOCK_E": be}, tiles)


def unpack_into(out: torch.Tensor, records: torch.Tensor, rows: torch.Tensor, start: int, fmt: KVFormat) -> None:
    """``out[i]`` = record ``rows[i] − start`` of ``records`` decoded, for each ``rows[i]`` in ``[start, start +
    len(records))``; other rows of ``out`` are left as they are."""
    n = rows.shape[0]
    if n == 0 or records.shape[0] == 0:
        return
    plan = require_fit(plan_kv_unpack(fmt, out.dtype, unified_buffer(records.device), interpret=interpreting()))
    programs = program_count(records.device)
    _kv_unpack_kernel[(programs,)](
        records, rows.to(torch.int64).contiguous(), out,
        n, start, start + records.shape[0], out.stride(0),
        RECORD=fmt.record_bytes, GROUPS=fmt.num_scales, QUANT=fmt.quantized, ROPE_OFF=fmt.rope_offset,
        SCALE_OFF=fmt.scale_offset, ROPE=fmt.rope, FP4=fmt.code == "e2m1", SCALE=SCALE_KINDS[fmt.scale],
        BLOCK=fmt.block, OUT_BF16=out.dtype == torch.bfloat16, NUM_PROGRAMS=programs, **plan.blocks,
    )


def kv_unpack(records: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """``Kernels.kv_unpack`` for fp32/fp16/bf16 output: ``[..., record_bytes]`` records to ``[..., dim]`` rows."""
    _check_width("kv_unpack", records.shape[-1], fmt.record_bytes, fmt, "bytes")
    lead = records.shape[:-1]
    flat = records.reshape(-1, fmt.record_bytes).contiguous()
    out = torch.empty(flat.shape[0], fmt.dim, dtype=dtype, device=records.device)
    unpack_into(out, flat, torch.arange(flat.shape[0], device=records.device), 0, fmt)
    return out.view(*lead, fmt.dim)


def take_rows(pool: PackedPool, indices: torch.Tensor) -> torch.Tensor:
    """``pool.take(indices)``: ``[*indices.shape, dim]`` the named rows decoded in the pool dtype, region by region
    (``-1`` reads as zeros)."""
    flat = indices.reshape(-1)
    out = torch.zeros(flat.shape[0], pool.dim, dtype=pool.dtype, device=flat.device)
    for region in pool.regions:
        unpack_into(out, region.data, flat, region.start, region.format)
    return out.view(*indices.shape, pool.dim)

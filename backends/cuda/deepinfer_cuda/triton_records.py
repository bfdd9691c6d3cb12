"""Packed cache records (``deepinfer_interfaces.kv_format``) written and read inside Triton kernels.

``kv_pack`` and the packed ``cache_write`` quantize rows into records in one
kernel: a program takes one row, computes each block's ``max|x|`` and scale,
the codes and the bf16 rope channels, and stores the whole record (padding
included) at its row, or at the row its slot names in a region (``-1`` and
slots outside the region store nothing; no host sync). ``kv_unpack`` decodes
records; ``record_values`` is the decoder the attention and indexer kernels
call on gathered rows, and ``pool_rows`` reads rows of a plain pool or of a
packed pool of one or two regions (``pool_operand.PoolOperand``).

The records equal the reference's byte for byte. Every rounding is integer
arithmetic on fp32 bits, because Triton's interpreter rounds some casts
differently from a GPU (it carries no mantissa overflow into the exponent in
fp32 → e4m3, and truncates fp32 → bf16): e4m3 codes and scales as torch's
``float8_e4m3fn`` cast (nearest even, saturated at ±448, ±inf included; NaN
0x7F with the value's sign), e2m1 nibbles by comparison with the midpoints,
ties to the even code, bf16 nearest even. Divisions are IEEE (``tl.div_rn``),
like torch's. Decoding converts e4m3 bytes with the hardware cast (``0x7F`` /
``0xFF`` made NaN explicitly: the interpreter reads them as ±480).

Scales: ``ue8m0`` ``2^ceil(log2(amax / Q))`` from the bits of ``amax / Q``
(its exponent, plus one unless the mantissa is zero); the formats' amax floors
keep ``amax / Q`` at least ``2^-126``, a normal number. A block holding NaN or
±inf gets a NaN scale; a NaN quotient (a NaN scale, or a zero e4m3 scale of
e4m3 codes) gives e2m1 code ``0x7`` and e4m3 ``0x7F`` / ``0xFF`` with the sign
the reference's CPU division gives it. A NaN rope channel is stored as bf16
``0x7FC0`` (torch's vectorized cast writes ``0xFFFF``): both decode to NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_interfaces import KVFormat, PackedPool

from .launch import Tiles, choose, next_power_of_2, num_warps_for, rows
from .pool_operand import format_constants
from .triton_dequant import e2m1_to_float


# ---- codes and scales -----------------------------------------------------------------------


@triton.jit
def e4m3_byte(y):
    """int32 e4m3 bytes of fp32 ``y``, as torch's ``float8_e4m3fn`` cast (and the GPU's ``satfinite`` one):
    nearest even, saturated at ±448 (±inf too), NaN 0x7F; the sign bit kept."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # below 2^-6 (e4m3 subnormals): adding 2^14, whose ulp is 2^-9, rounds to a multiple of 2^-9
    sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    normal = (mag - (120 << 23) + 0x7FFFF + ((mag >> 20) & 1)) >> 20
    code = tl.where(mag < (121 << 23), sub, normal)
    code = tl.where(mag > 0x43E00000, 0x7E, code)  # past 448
    return tl.where(mag > 0x7F800000, 0x7F, code) | sign


@triton.jit
def e4m3_value(b):
    """fp32 values of e4m3 bytes ``b`` (uint8): the hardware conversion, with 0x7F / 0xFF NaN."""
    v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def e2m1_nibble(y):
    """int32 e2m1 nibbles of finite fp32 ``y`` (already within ±6): nearest value, ties to the even code; sign bit 3."""
    mag = tl.abs(y)
    code = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
    code += (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32) + (mag > 5.0).to(tl.int32)
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 0x8)


@triton.jit
def ue8m0_value(b):
    """fp32 scales of ue8m0 bytes: ``2^(b − 127)`` (0 is the subnormal ``2^-127``), NaN for 0xFF."""
    e = b.to(tl.int32)
    v = tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)
    return tl.where(e == 255, float("nan"), v)


@triton.jit
def bf16_bits(x):
    """int32 bf16 bit patterns (0..0xFFFF) of fp32 ``x``, nearest even; NaN is 0x7FC0."""
    bits = x.to(tl.int32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(x != x, 0x7FC0, r)


@triton.jit
def round_to(x, ROWS: tl.constexpr):
    """fp32 ``x`` rounded to ``ROWS`` (nearest even) and back: what the reference's rows in ``ROWS`` hold."""
    if ROWS == tl.bfloat16:
        x = (bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    elif ROWS == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


# ---- reading records ------------------------------------------------------------------------


@triton.jit
def _scale_values(at, mask, SCALE: tl.constexpr):
    """fp32 block scales stored at ``at`` (uint8 pointers): ue8m0, e4m3 or fp32 (four bytes, little endian)."""
    if SCALE == 0:
        s = ue8m0_value(tl.load(at, mask=mask, other=127))
    elif SCALE == 1:
        s = e4m3_value(tl.load(at, mask=mask, other=0))
    else:
        bits = tl.load(at, mask=mask, other=0).to(tl.int32)
        bits |= tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8
        bits |= tl.load(at + 2, mask=mask, other=0).to(tl.int32) << 16
        s = (bits | (tl.load(at + 3, mask=mask, other=0).to(tl.int32) << 24)).to(tl.float32, bitcast=True)
    return s


@triton.jit
def record_values(base, row, ok, d, stride, F: tl.constexpr):
    """fp32 ``[R, BLOCK_D]``: channels ``d`` (``arange(0, BLOCK_D)``) of the records at rows ``row`` (``[R]``) of
    ``base`` (uint8, row stride ``stride``) in format ``F`` (``pool_operand.format_constants``); zeros off ``ok``
    and past the row.

    With a power-of-two ``BLOCK`` (every trained format) the scales are loaded once per block (``[R, BLOCK_D /
    BLOCK]``) and broadcast, and e2m1 bytes once for their two channels; otherwise each channel loads its byte
    and its scale."""
    CODE: tl.constexpr = F[0]
    SCALE: tl.constexpr = F[1]
    BLOCK: tl.constexpr = F[2]
    QUANT: tl.constexpr = F[3]
    ROPE: tl.constexpr = F[4]
    CODE_BYTES: tl.constexpr = F[5]
    SCALE_OFF: tl.constexpr = F[6]
    SB: tl.constexpr = 4 if SCALE == 2 else 1
    R: tl.constexpr = row.shape[0]
    BLOCK_D: tl.constexpr = d.shape[0]
    rec = base + row.to(tl.int64)[:, None] * stride
    if (BLOCK & (BLOCK - 1)) == 0:
        NB: tl.constexpr = BLOCK_D // BLOCK
        nb = tl.arange(0, NB)
        s = _scale_values(rec + SCALE_OFF + (nb * SB)[None, :], ok[:, None] & (nb < QUANT // BLOCK)[None, :], SCALE)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (R, NB, BLOCK)), (R, BLOCK_D))
        if CODE == 0:
            v = e4m3_value(tl.load(rec + d[None, :], mask=ok[:, None] & (d < QUANT)[None, :], other=0))
        else:
            j = tl.arange(0, BLOCK_D // 2)
            b = tl.load(rec + j[None, :], mask=ok[:, None] & (j < QUANT // 2)[None, :], other=0).to(tl.int32)
            v = tl.reshape(tl.join(e2m1_to_float(b & 0xF), e2m1_to_float(b >> 4)), (R, BLOCK_D))
    else:
        quant = ok[:, None] & (d < QUANT)[None, :]
        s = _scale_values(rec + SCALE_OFF + (d // BLOCK * SB)[None, :], quant, SCALE)
        if CODE == 0:
            v = e4m3_value(tl.load(rec + d[None, :], mask=quant, other=0))
        else:
            b = tl.load(rec + (d // 2)[None, :], mask=quant, other=0).to(tl.int32)
            v = e2m1_to_float((b >> ((d & 1) * 4)[None, :]) & 0xF)
    out = v * s
    if ROPE > 0:
        rope = ok[:, None] & ((d >= QUANT) & (d < QUANT + ROPE))[None, :]
        at = rec + CODE_BYTES + (2 * (d - QUANT))[None, :]
        lo = tl.load(at, mask=rope, other=0).to(tl.int32)
        hi = tl.load(at + 1, mask=rope, other=0).to(tl.int32)
        out = tl.where(rope, ((lo | (hi << 8)) << 16).to(tl.float32, bitcast=True), out)
    return out


@triton.jit
def pool_rows(
    kv_ptr, kv2_ptr, row, ok, d, d_ok, stride_kv, stride_kv2, split,
    ROWS: tl.constexpr, REGIONS: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr,
):
    """``[R, BLOCK_D]`` rows ``row`` of a pool (zeros off ``ok`` and past ``d_ok``), as fp32 values of ``ROWS``:
    plain rows (``REGIONS`` 0), or records of one region (format ``F0``) or of two (rows below ``split`` in
    ``kv_ptr`` as ``F0``, the others in ``kv2_ptr`` from its row 0 as ``F1``) decoded and rounded to ``ROWS``."""
    if REGIONS == 0:
        out = tl.load(kv_ptr + row[:, None] * stride_kv + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        out = out.to(tl.float32)
    elif REGIONS == 1:
        out = round_to(record_values(kv_ptr, row, ok, d, stride_kv, F0), ROWS)
    else:
        first = row < split
        a = record_values(kv_ptr, row, ok & first, d, stride_kv, F0)
        b = record_values(kv2_ptr, row - split, ok & (row >= split), d, stride_kv2, F1)
        out = round_to(tl.where(first[:, None], a, b), ROWS)
    return out


@triton.jit
def _kv_unpack_kernel(rec_ptr, out_ptr, n, stride_r, stride_o, F: tl.constexpr, BF16: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (d < F[3] + F[4])[None, :]
    v = record_values(rec_ptr, r, ok, d, stride_r, F)
    at = out_ptr + r.to(tl.int64)[:, None] * stride_o + d[None, :]
    if BF16:
        tl.store(at, bf16_bits(v).to(tl.int16), mask=mask)
    else:
        tl.store(at, v.to(out_ptr.dtype.element_ty), mask=mask)


# ---- writing records ------------------------------------------------------------------------


@triton.jit
def _block_scales(amax, bad, amax_floor, Q: tl.constexpr, SCALE: tl.constexpr):
    """``(scale, field)`` per block: the fp32 scale (NaN for a bad block) and the int32 field (ue8m0 / e4m3
    byte, or fp32 bits)."""
    ratio = tl.div_rn(tl.maximum(amax, amax_floor), Q)
    if SCALE == 0:
        bits = ratio.to(tl.int32, bitcast=True)
        field = tl.minimum((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32), 254)
        field = tl.where(bad, 255, field)
        s = ue8m0_value(field)
    elif SCALE == 1:
        field = tl.where(bad, 0x7F, e4m3_byte(ratio))  # saturated at 448, 0 below 2^-10
        s = e4m3_value(field.to(tl.uint8))
    else:
        s = tl.where(bad, float("nan"), ratio)
        field = tl.where(bad, 0x7FC00000, s.to(tl.int32, bitcast=True))
    return s, field


@triton.jit
def _block_stats(x, amax, bad):
    """The running block ``max|x|`` over finite values and whether a block holds NaN or ±inf (``x`` ``[NB, C]``)."""
    finite = tl.abs(x) < float("inf")
    amax = tl.maximum(amax, tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1))
    return amax, bad | (tl.max(tl.where(finite, 0, 1), axis=1) > 0)


@triton.jit
def _codes(x, s, Q: tl.constexpr, CODE: tl.constexpr):
    """int32 codes of ``x`` ``[NB, C]`` with block scales ``s`` ``[NB]``: e4m3 bytes or e2m1 nibbles."""
    y = tl.div_rn(x, s[:, None])
    nan = y != y
    y = tl.minimum(tl.maximum(y, -Q), Q)
    if CODE == 0:
        # a NaN quotient as the reference's CPU division makes it: a NaN dividend is kept (with its sign),
        # else a NaN scale is (positive), else 0 / 0 gives the default NaN, negative on x86
        x_nan = x != x
        x_neg = x.to(tl.int32, bitcast=True) < 0
        neg = tl.where(x_nan, x_neg, (s == s)[:, None])
        return tl.where(nan, tl.where(neg, 0xFF, 0x7F), e4m3_byte(y))
    return tl.where(nan, 0x7, e2m1_nibble(y))


@triton.jit
def _kv_pack_kernel(
    x_ptr, slots_ptr, out_ptr, stride_x, stride_o, first_row, rows, amax_floor,
    F: tl.constexpr, SCATTER: tl.constexpr, NB_PAD: tl.constexpr, C_PAD: tl.constexpr, R_PAD: tl.constexpr,
):
    CODE: tl.constexpr = F[0]
    SCALE: tl.constexpr = F[1]
    BLOCK: tl.constexpr = F[2]
    QUANT: tl.constexpr = F[3]
    ROPE: tl.constexpr = F[4]
    CODE_BYTES: tl.constexpr = F[5]
    SCALE_OFF: tl.constexpr = F[6]
    NUM_SCALES: tl.constexpr = F[7]
    RECORD: tl.constexpr = F[8]
    SB: tl.constexpr = 4 if SCALE == 2 else 1
    Q: tl.constexpr = 448.0 if CODE == 0 else 6.0
    i = tl.program_id(0).to(tl.int64)
    if SCATTER:
        slot = tl.load(slots_ptr + i) - first_row
        live = (slot >= 0) & (slot < rows)
        dst = out_ptr + tl.where(live, slot, 0) * stride_o
        # a skipped row stores nothing (a scalar limit, not a scalar mask, keeps the interpreter happy)
        keep = tl.where(live, 1, 0)
    else:
        dst = out_ptr + i * stride_o
        keep = 1
    src = x_ptr + i * stride_x
    nb = tl.arange(0, NB_PAD)
    c = tl.arange(0, C_PAD)
    amax = tl.zeros([NB_PAD], tl.float32)
    bad = amax != amax
    if CODE == 0:
        ch = nb[:, None] * BLOCK + c[None, :]
        m = (nb < NUM_SCALES)[:, None] & (c < BLOCK)[None, :]
        x = tl.load(src + ch, mask=m, other=0.0).to(tl.float32)
        amax, bad = _block_stats(x, amax, bad)
        s, field = _block_scales(amax, bad, amax_floor, Q, SCALE)
        byte = _codes(x, s, Q, CODE)
        tl.store(dst + ch, byte.to(tl.uint8), mask=(nb < NUM_SCALES * keep)[:, None] & (c < BLOCK)[None, :])
    else:
        # e2m1: even channels in the low nibble, odd in the high one, BLOCK / 2 bytes per block
        ch = nb[:, None] * BLOCK + 2 * c[None, :]
        m = (nb < NUM_SCALES)[:, None] & (c < BLOCK // 2)[None, :]
        lo = tl.load(src + ch, mask=m, other=0.0).to(tl.float32)
        hi = tl.load(src + ch + 1, mask=m, other=0.0).to(tl.float32)
        amax, bad = _block_stats(lo, amax, bad)
        amax, bad = _block_stats(hi, amax, bad)
        s, field = _block_scales(amax, bad, amax_floor, Q, SCALE)
        byte = _codes(lo, s, Q, CODE) | (_codes(hi, s, Q, CODE) << 4)
        tl.store(dst + ch // 2, byte.to(tl.uint8), mask=(nb < NUM_SCALES * keep)[:, None] & (c < BLOCK // 2)[None, :])
    if ROPE > 0:
        r = tl.arange(0, R_PAD)
        bits = bf16_bits(tl.load(src + QUANT + r, mask=r < ROPE, other=0.0).to(tl.float32))
        r_ok = r < ROPE * keep
        tl.store(dst + CODE_BYTES + 2 * r, (bits & 0xFF).to(tl.uint8), mask=r_ok)
        tl.store(dst + CODE_BYTES + 2 * r + 1, (bits >> 8).to(tl.uint8), mask=r_ok)
    k = tl.arange(0, 4)
    field_bytes = (field[:, None] >> (8 * k)[None, :]) & 0xFF
    tl.store(dst + SCALE_OFF + nb[:, None] * SB + k[None, :], field_bytes.to(tl.uint8),
             mask=(nb < NUM_SCALES * keep)[:, None] & (k < SB)[None, :])
    pad = SCALE_OFF + NUM_SCALES * SB + k
    tl.store(dst + pad, tl.zeros([4], tl.uint8), mask=pad < RECORD * keep)


# ---- launchers ------------------------------------------------------------------------------

def pack_tiles(fmt: KVFormat) -> Tiles:
    """One row per program: the blocks (padded to a power of two) by their channels (bytes for e2m1) and the rope channels."""
    per_block = fmt.block // 2 if fmt.code == "e2m1" else fmt.block
    nb, cp = next_power_of_2(fmt.num_scales), next_power_of_2(per_block)
    return Tiles({"NB_PAD": nb, "C_PAD": cp, "R_PAD": next_power_of_2(max(fmt.rope, 1))},
                 num_warps=choose(num_warps_for(2 * nb * cp), 1))


def unpack_tiles(fmt: KVFormat) -> Tiles:
    """Rows of the whole record width, about 4096 channels (256 under the interpreter) per program."""
    block_d = next_power_of_2(fmt.dim)
    block_r = max(1, choose(4096, 256) // block_d)
    return Tiles({"BLOCK_R": block_r, "BLOCK_D": block_d}, num_warps=choose(num_warps_for(block_r * block_d), 1))


def _check_values(op: str, values: torch.Tensor, fmt: KVFormat) -> None:
    if values.dim() != 2 or values.shape[1] != fmt.dim:
        raise ValueError(f"{op}: values must be [n, {fmt.dim}] for format {fmt.name}; got {tuple(values.shape)}")


def _launch_pack(values: torch.Tensor, fmt: KVFormat, out: torch.Tensor, slots: torch.Tensor | None, first_row: int) -> None:
    vals = rows(values, fmt.dim)
    n = vals.shape[0]
    _kv_pack_kernel[(n,)](
        vals, out if slots is None else slots, out, vals.stride(0), out.stride(0), first_row, out.shape[0], fmt.amax_floor,
        F=format_constants(fmt), SCATTER=slots is not None, **pack_tiles(fmt).kwargs(),
    )


def kv_pack(values: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``Kernels.kv_pack`` on the device for at least one row of fp32, bf16 or fp16 values."""
    _check_values("kv_pack", values, fmt)
    out = torch.empty(values.shape[0], fmt.record_bytes, dtype=torch.uint8, device=values.device)
    _launch_pack(values, fmt, out, None, 0)
    return out


def cache_write_packed(pool: PackedPool, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``Kernels.cache_write`` into a packed pool: one fused quantize-and-scatter launch per non-empty region."""
    n = slots.shape[0]
    if slots.dim() != 1 or values.dim() != 2 or tuple(values.shape) != (n, pool.dim):
        raise ValueError(
            f"cache_write: need slots [n] and values [n, {pool.dim}] for a packed pool; got {tuple(slots.shape)} and {tuple(values.shape)}"
        )
    slots = slots.to(torch.int64).contiguous()
    for region in pool.regions:
        if region.rows:
            _launch_pack(values, region.format, region.data, slots, region.start)


def kv_unpack(records: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """``Kernels.kv_unpack`` on the device for records ``[..., record_bytes]`` read back in fp32, bf16 or fp16."""
    if records.dtype != torch.uint8 or records.dim() < 1 or records.shape[-1] != fmt.record_bytes:
        raise ValueError(f"kv_unpack: records must be uint8 [..., {fmt.record_bytes}] for format {fmt.name}; got "
                         f"{records.dtype} {tuple(records.shape)}")
    lead = records.shape[:-1]
    flat = rows(records, fmt.record_bytes)
    n = flat.shape[0]
    out = torch.empty(n, fmt.dim, dtype=dtype, device=records.device)
    if n:
        tiles = unpack_tiles(fmt)
        bf16 = dtype == torch.bfloat16
        target = out.view(torch.int16) if bf16 else out
        _kv_unpack_kernel[(triton.cdiv(n, tiles.blocks["BLOCK_R"]),)](
            flat, target, n, flat.stride(0), out.stride(0), F=format_constants(fmt), BF16=bf16, **tiles.kwargs(),
        )
    return out.view(*lead, fmt.dim)

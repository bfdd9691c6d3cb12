"""Kernel sets with one bug each in the packed KV cache ops, and a correct set written another way.

Each mutant is a plausible mistake in a vendor's packing, unpacking, rotation
or packed-pool kernel; ``tests/conformance/test_mutants.py`` installs this
module as a plugin next to ``mutants.py`` and checks that op parity fails
exactly the ops each one breaks (``cache_write`` into a packed pool packs
through ``kv_pack``, so a packing bug fails both). This module imports nothing
from the tests, so it can be copied.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer_interfaces import INTERFACE_VERSION, Kernels, PackedPool, PackedRegion
from deepinfer_interfaces.kv_format import (
    CODE_MAX, KVFormat, block_scales, decode_codes, e2m1_codes, record_scales, scale_field,
)


def pack(
    values: torch.Tensor, fmt: KVFormat, *, scales=block_scales, codes=None, rope=None, nibbles_high_first: bool = False,
) -> torch.Tensor:
    """``kv_pack`` with its steps replaceable: ``scales(q, fmt)`` the per-block scales, ``codes(y, fmt)`` uint8 codes of
    the scaled, clamped channels (one per channel), ``rope(x)`` the rotary channels before their bf16 cast."""
    n = values.shape[0]
    out = torch.zeros(n, fmt.record_bytes, dtype=torch.uint8, device=values.device)
    if n == 0:
        return out
    q = values[:, : fmt.quantized].float()
    s = scales(q, fmt)
    qmax = CODE_MAX[fmt.code]
    y = (q.view(n, fmt.num_scales, fmt.block) / s[..., None]).view(n, fmt.quantized).clamp(-qmax, qmax)
    c = codes(y, fmt) if codes else (y.to(torch.float8_e4m3fn).view(torch.uint8) if fmt.code == "e4m3" else e2m1_codes(y))
    if fmt.code == "e2m1":
        lo, hi = (c[:, 1::2], c[:, 0::2]) if nibbles_high_first else (c[:, 0::2], c[:, 1::2])
        c = lo | (hi << 4)
    out[:, : fmt.code_bytes] = c
    if fmt.rope:
        r = values[:, fmt.quantized :].float()
        r = (rope(r) if rope else r).to(torch.bfloat16).contiguous()
        out[:, fmt.rope_offset : fmt.scale_offset] = r.view(torch.uint8).view(n, 2 * fmt.rope)
    out[:, fmt.scale_offset : fmt.scale_offset + fmt.scale_bytes] = scale_field(s, fmt.scale)
    return out


def _first_half_scales(q: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    half = dataclasses.replace(fmt, block=fmt.block // 2, rope=0, dim=fmt.quantized)
    return block_scales(q, half)[:, 0::2]


class KVHalfBlockScaleKernels(Kernels):
    """``kv_pack`` whose amax loop covers 32 channels where the block is 64 (half of each block): the other half's
    codes saturate."""

    name = "mutant-kv-half-block-scale"
    interface_version = INTERFACE_VERSION

    def kv_pack(self, values, fmt):
        return pack(values, fmt, scales=_first_half_scales)


class KVRopeRoundedKernels(Kernels):
    """``kv_pack`` that rounds the rotary channels to e4m3 too before storing them as bf16."""

    name = "mutant-kv-rope-rounded"
    interface_version = INTERFACE_VERSION

    def kv_pack(self, values, fmt):
        return pack(values, fmt, rope=lambda r: r.clamp(-448, 448).to(torch.float8_e4m3fn).float())


def _e4m3_truncated(y: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """e4m3 codes rounded toward zero: the nearest code, one step down where it lies above ``|y|``."""
    code = y.to(torch.float8_e4m3fn).view(torch.uint8)
    over = code.view(torch.float8_e4m3fn).float().abs() > y.abs()
    return torch.where(over & (code & 0x7F > 0), code - 1, code)


class KVFP8TruncatesKernels(Kernels):
    """``kv_pack`` whose FP8 codes truncate toward zero instead of rounding to nearest even."""

    name = "mutant-kv-fp8-truncates"
    interface_version = INTERFACE_VERSION

    def kv_pack(self, values, fmt):
        return pack(values, fmt, codes=_e4m3_truncated if fmt.code == "e4m3" else None)


_E2M1 = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _e2m1_truncated(y: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """e2m1 nibbles rounded toward zero: the count of positive e2m1 values at or below ``|y|``."""
    mag = sum((y.abs() >= v).to(torch.uint8) for v in _E2M1)
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


class KVFP4TruncatesKernels(Kernels):
    """``kv_pack`` whose FP4 codes truncate toward zero instead of rounding to nearest even."""

    name = "mutant-kv-fp4-truncates"
    interface_version = INTERFACE_VERSION

    def kv_pack(self, values, fmt):
        return pack(values, fmt, codes=_e2m1_truncated if fmt.code == "e2m1" else None)


def _unpack_high_first(records: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """``kv_unpack`` reading each byte's high nibble as the even channel."""
    swapped = records.clone()
    if fmt.code == "e2m1":
        c = records[:, : fmt.code_bytes]
        swapped[:, : fmt.code_bytes] = (c >> 4) | (c << 4)
    return Kernels.kv_unpack(Kernels(), swapped, fmt, dtype)


class KVNibblesSwappedKernels(Kernels):
    """FP4 records packed and read with the even channel in the high nibble (consistent with itself, not the format)."""

    name = "mutant-kv-nibbles-swapped"
    interface_version = INTERFACE_VERSION

    def kv_pack(self, values, fmt):
        return pack(values, fmt, nibbles_high_first=True)

    def kv_unpack(self, records, fmt, dtype=torch.float32):
        return _unpack_high_first(records, fmt, dtype)


def _ue8m0_floor_scales(q: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    if fmt.scale != "ue8m0":
        return block_scales(q, fmt)
    amax = q.abs().view(q.shape[0], fmt.num_scales, fmt.block).amax(-1).clamp(min=fmt.amax_floor)
    s = torch.exp2(torch.floor(torch.log2(amax / CODE_MAX[fmt.code])))
    return torch.where(torch.isfinite(amax), s, float("nan"))


class KVScaleRoundedDownKernels(Kernels):
    """``kv_pack`` choosing ue8m0 scales ``2^floor(log2(amax / Q))``: rounded down, so block maxima saturate."""

    name = "mutant-kv-ue8m0-floor"
    interface_version = INTERFACE_VERSION

    def kv_pack(self, values, fmt):
        return pack(values, fmt, scales=_ue8m0_floor_scales)


def _unfloored(q: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    amax = q.abs().view(q.shape[0], fmt.num_scales, fmt.block).amax(-1)
    qmax = CODE_MAX[fmt.code]
    if fmt.scale == "ue8m0":
        s = torch.exp2(torch.ceil(torch.log2(amax / qmax)))
    elif fmt.scale == "e4m3":
        s = (amax / qmax).to(torch.float8_e4m3fn).float()
    else:
        s = amax / qmax
    return torch.where(torch.isfinite(amax), s, float("nan"))


class KVNoAmaxFloorKernels(Kernels):
    """``kv_pack`` without the amax floor: an all-zero block gets a zero scale (codes NaN), a tiny one a tiny scale."""

    name = "mutant-kv-no-amax-floor"
    interface_version = INTERFACE_VERSION

    def kv_pack(self, values, fmt):
        return pack(values, fmt, scales=_unfloored)


def _butterfly(x: torch.Tensor, keep: torch.dtype) -> torch.Tensor:
    """The fast Walsh–Hadamard transform, each stage's sums rounded to ``keep``, scaled by ``d^-1/2`` at the end."""
    d = x.shape[-1]
    y = x.to(keep)
    h = 1
    while h < d:
        pairs = y.view(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).view(*y.shape)
        h *= 2
    return (y.float() * d**-0.5).to(x.dtype)


class HadamardBf16Kernels(Kernels):
    """``hadamard`` as a butterfly whose partial sums stay in bf16 (the spec sums in fp32)."""

    name = "mutant-hadamard-bf16-sums"
    interface_version = INTERFACE_VERSION

    def hadamard(self, x):
        return x.clone() if x.numel() == 0 else _butterfly(x, torch.bfloat16)


class KVUnpackBf16MultiplyKernels(Kernels):
    """``kv_unpack`` multiplying codes by their scales in bf16 (the spec multiplies in fp32, then rounds once)."""

    name = "mutant-kv-unpack-bf16-multiply"
    interface_version = INTERFACE_VERSION

    def kv_unpack(self, records, fmt, dtype=torch.float32):
        lead = records.shape[:-1]
        values = decode_codes(records[..., : fmt.code_bytes], fmt.code).to(torch.bfloat16)
        scales = record_scales(records, fmt).to(torch.bfloat16)
        scaled = (values.view(*lead, fmt.num_scales, fmt.block) * scales[..., None]).view(*lead, fmt.quantized).float()
        rope = records[..., fmt.rope_offset : fmt.scale_offset].contiguous().view(torch.bfloat16).float()
        return torch.cat([scaled, rope], dim=-1).to(dtype) if fmt.rope else scaled.to(dtype)


def _scales_read_as_ue8m0(pool):
    """``pool`` with every region's one-byte scales read as ue8m0 exponents (the V4 window's scale format)."""
    if not isinstance(pool, PackedPool):
        return pool
    regions = tuple(PackedRegion(r.start, r.data, dataclasses.replace(r.format, scale="ue8m0") if r.format.scale == "e4m3" else r.format)
                    for r in pool.regions)
    return PackedPool(regions, pool.dim, pool.dtype)


class PackedAttentionWrongFormatKernels(Kernels):
    """Attention over a packed pool decoding every region with ue8m0 scales: V4.1's FP4 entries (e4m3 scales) come
    out wrong, V4's single FP8 region right."""

    name = "mutant-packed-attention-wrong-format"
    interface_version = INTERFACE_VERSION

    def sparse_attention(self, q, kv, indices, sinks, scale):
        return super().sparse_attention(q, _scales_read_as_ue8m0(kv), indices, sinks, scale)

    def entry_attention(self, q, kv, indices, table, token_seq, visible, sinks, scale):
        return super().entry_attention(q, _scales_read_as_ue8m0(kv), indices, table, token_seq, visible, sinks, scale)


class AlternativeKVKernels(Kernels):
    """Correct another way: a NaN-scaled block written with zero codes and e4m3's other NaN, ue8m0 scales from the
    exponent bits, the Walsh–Hadamard transform as an fp32 butterfly."""

    name = "alternative-kv-correct"
    interface_version = INTERFACE_VERSION

    def kv_pack(self, values, fmt):
        out = super().kv_pack(values, fmt)
        if out.shape[0] == 0:
            return out
        bad = torch.isnan(record_scales(out, fmt))
        codes = out[:, : fmt.code_bytes].view(out.shape[0], fmt.num_scales, -1)
        codes.copy_(codes.masked_fill(bad[..., None], 0))
        if fmt.scale == "e4m3":
            field = out[:, fmt.scale_offset : fmt.scale_offset + fmt.scale_bytes]
            field.copy_(torch.where(bad, torch.tensor(0xFF, dtype=torch.uint8), field))
        return out

    def kv_unpack(self, records, fmt, dtype=torch.float32):
        if fmt.scale != "ue8m0" or records.shape[0] == 0:
            return super().kv_unpack(records, fmt, dtype)
        raw = records[:, fmt.scale_offset : fmt.scale_offset + fmt.scale_bytes].to(torch.int32)
        scales = torch.where(raw == 0xFF, torch.tensor(float("nan")), (raw << 23).view(torch.float32))
        lead = records.shape[0]
        values = decode_codes(records[:, : fmt.code_bytes], fmt.code).view(lead, fmt.num_scales, fmt.block) * scales[..., None]
        rope = records[:, fmt.rope_offset : fmt.scale_offset].contiguous().view(torch.bfloat16).float()
        return torch.cat([values.view(lead, fmt.quantized), rope], dim=-1).to(dtype)

    def hadamard(self, x):
        return x.clone() if x.numel() == 0 else _butterfly(x, torch.float64 if x.dtype == torch.float64 else torch.float32)


#: entry-point name -> class name: kernel sets the suite must fail
MUTANTS = {cls.name: cls.__name__ for cls in (
    KVHalfBlockScaleKernels, KVRopeRoundedKernels, KVFP8TruncatesKernels, KVFP4TruncatesKernels, KVNibblesSwappedKernels,
    KVScaleRoundedDownKernels, KVNoAmaxFloorKernels, HadamardBf16Kernels, KVUnpackBf16MultiplyKernels,
    PackedAttentionWrongFormatKernels,
)}
#: correct kernel sets written differently: the suite must pass them
CORRECT = {AlternativeKVKernels.name: AlternativeKVKernels.__name__}

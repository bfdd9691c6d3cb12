"""Packed cache records: how one row of cached state is stored quantized, and the exact math of it.

A ``KVFormat`` describes one record of a row of ``dim`` channels: the leading
``dim − rope`` channels as codes (FP8 e4m3, one byte each, or FP4 e2m1, two
per byte with the even channel in the low nibble) with one scale per ``block``
channels, and the trailing ``rope`` channels (the rotary ones, which V4 keeps
unrounded) as bf16. Record layout, in bytes::

    [codes][rope channels, bf16 little endian][scales][zero padding to a multiple of 4]

Scales are ``ue8m0`` (one exponent byte ``e``: the scale is ``2^(e − 127)``, the
layout of ``float8_e8m0fnu``), ``e4m3`` (an FP8 value) or ``fp32`` (four bytes,
little endian). Quantizing a block ``x`` of ``block`` channels (in fp32)::

    amax  = max(max|x|, floor)
    ue8m0: s = 2^ceil(log2(amax / Q))    e4m3: s = e4m3(amax / Q) (nearest even)    fp32: s = amax / Q
    code  = round_to_nearest_even(clamp(x / s, ±Q)) in the code's format

with ``Q`` the code's largest value (448 for e4m3, 6 for e2m1) and ``floor`` the
format's: DeepSeek's FP8 rounding floors at 1e-4, its FP4 rounding at the
smallest amax whose scale the scale format can hold (``6·2^-126`` for ue8m0,
``6·2^-9`` for e4m3, so an all-zero block keeps a nonzero scale). A block
holding NaN or ±inf gets a NaN scale and decodes to NaN throughout (as an
unrounded cache would carry it on).

Decoding is exact: ``value = decode(code) · s``. These functions are the definition the
kernels' ``kv_pack`` / ``kv_unpack`` references call and the conformance suite
holds every backend to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .quant import decode_table

#: the smallest block maximum DeepSeek's FP8 rounding chooses a scale for
FP8_AMAX_FLOOR = 1e-4
#: the smallest block maximum its FP4 rounding chooses a scale for, by scale format
FP4_AMAX_FLOOR = {"ue8m0": 6.0 * 2.0**-126, "e4m3": 6.0 * 2.0**-9, "fp32": 6.0 * 2.0**-126}
#: bytes of one scale
SCALE_BYTES = {"ue8m0": 1, "e4m3": 1, "fp32": 4}
#: largest magnitude of each code format
CODE_MAX = {"e4m3": 448.0, "e2m1": 6.0}
#: an ue8m0 byte that is not a scale (the format's NaN)
UE8M0_NAN = 0xFF

#: e2m1 magnitudes by code; between two neighbours a value goes up when past the midpoint, and at the
#: midpoint itself to the even code (round to nearest even)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class KVFormat:
    """The packed record of one cached row (see the module docstring for the layout and the math)."""

    #: a name for reports and file headers
    name: str
    #: channels of the row
    dim: int
    code: Literal["e4m3", "e2m1"]
    #: channels per scale
    block: int
    scale: Literal["ue8m0", "e4m3", "fp32"]
    #: trailing channels kept in bf16 (not rounded)
    rope: int = 0

    def __post_init__(self) -> None:
        if self.code not in CODE_MAX or self.scale not in SCALE_BYTES:
            raise ValueError(f"KVFormat {self.name}: unknown code {self.code!r} or scale {self.scale!r}")
        if not 0 <= self.rope < self.dim or self.quantized % self.block or (self.code == "e2m1" and self.block % 2):
            raise ValueError(f"KVFormat {self.name}: {self.dim - self.rope} quantized channels do not split into blocks of {self.block}")

    @property
    def quantized(self) -> int:
        """Channels stored as codes."""
        return self.dim - self.rope

    @property
    def code_bytes(self) -> int:
        return self.quantized // 2 if self.code == "e2m1" else self.quantized

    @property
    def rope_offset(self) -> int:
        return self.code_bytes

    @property
    def scale_offset(self) -> int:
        return self.code_bytes + 2 * self.rope

    @property
    def num_scales(self) -> int:
        return self.quantized // self.block

    @property
    def scale_bytes(self) -> int:
        return self.num_scales * SCALE_BYTES[self.scale]

    @property
    def amax_floor(self) -> float:
        return FP8_AMAX_FLOOR if self.code == "e4m3" else FP4_AMAX_FLOOR[self.scale]

    @property
    def record_bytes(self) -> int:
        """Bytes of one record, padded to a multiple of 4."""
        return -(-(self.scale_offset + self.scale_bytes) // 4) * 4


# ----- scales -----


def ue8m0_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``2^ceil(log2(amax / qmax))`` (fp32), the smallest power of two that keeps ``amax`` within ``qmax``."""
    ratio = amax.to(torch.float32) / qmax
    mant, exp = torch.frexp(ratio)  # ratio = mant · 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)  # an exact power of two keeps its exponent
    return torch.ldexp(torch.ones_like(ratio), exp)


def ue8m0_byte(scale: torch.Tensor) -> torch.Tensor:
    """The ue8m0 byte of a power-of-two ``scale`` (0xFF, the format's NaN, for a non-finite one)."""
    byte = (torch.frexp(scale)[1] - 1 + 127).clamp(0, 254).to(torch.uint8)
    return torch.where(torch.isfinite(scale), byte, UE8M0_NAN)


def ue8m0_value(byte: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of ue8m0 bytes (NaN for 0xFF)."""
    e = byte.to(torch.int32) - 127
    value = torch.ldexp(torch.ones(byte.shape, dtype=torch.float32, device=byte.device), e)
    return torch.where(byte == UE8M0_NAN, torch.full_like(value, float("nan")), value)


def block_scales(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``[n, num_scales]`` fp32 scales of ``x`` ``[n, quantized]`` (fp32), as the format chooses them."""
    amax = x.abs().view(x.shape[0], fmt.num_scales, fmt.block).amax(-1).clamp(min=fmt.amax_floor)
    qmax = CODE_MAX[fmt.code]
    if fmt.scale == "ue8m0":
        s = ue8m0_scale(amax, qmax)
    elif fmt.scale == "e4m3":
        s = (amax / qmax).to(torch.float8_e4m3fn).to(torch.float32)
    else:
        s = amax / qmax
    return torch.where(torch.isfinite(amax), s, float("nan"))


# ----- codes -----


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 nibbles (sign bit 3) of ``y`` rounded to the nearest e2m1 value, ties to the even code,
    saturated at ±6; NaN encodes as +6 with its sign bit clear (e2m1 has no NaN)."""
    mag = y.abs().nan_to_num(nan=6.0)
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for c in range(len(_E2M1) - 1):
        mid = (_E2M1[c] + _E2M1[c + 1]) / 2
        up = mag > mid if c % 2 == 0 else mag >= mid  # the midpoint goes to the even code
        code += up.to(torch.uint8)
    sign = (torch.signbit(y) & ~torch.isnan(y)).to(torch.uint8) << 3
    return code | sign


def encode_codes(y: torch.Tensor, code: str) -> torch.Tensor:
    """uint8 codes of ``y`` (fp32, already divided by its scale and clamped): e4m3 bytes, or e2m1 nibbles
    packed two per byte (even element low)."""
    if code == "e4m3":
        return y.to(torch.float8_e4m3fn).view(torch.uint8)
    nib = e2m1_codes(y)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def decode_codes(codes: torch.Tensor, code: str) -> torch.Tensor:
    """fp32 values of packed codes (the inverse layout of ``encode_codes``)."""
    table = decode_table(code, codes.device)
    if code == "e4m3":
        return table[codes.long()]
    lo, hi = table[(codes & 0xF).long()], table[(codes >> 4).long()]
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ----- records -----


def pack_rows(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``[n, record_bytes]`` uint8 records of rows ``x`` ``[n, dim]`` (any float dtype)."""
    n = x.shape[0]
    out = torch.zeros(n, fmt.record_bytes, dtype=torch.uint8, device=x.device)
    if n == 0:
        return out
    q = x[:, : fmt.quantized].to(torch.float32)
    scales = block_scales(q, fmt)
    y = (q.view(n, fmt.num_scales, fmt.block) / scales[..., None]).view(n, fmt.quantized)
    y = y.clamp(-CODE_MAX[fmt.code], CODE_MAX[fmt.code])
    out[:, : fmt.code_bytes] = encode_codes(y, fmt.code)
    if fmt.rope:
        rope = x[:, fmt.quantized :].to(torch.bfloat16).contiguous()
        out[:, fmt.rope_offset : fmt.scale_offset] = rope.view(torch.uint8).view(n, 2 * fmt.rope)
    out[:, fmt.scale_offset : fmt.scale_offset + fmt.scale_bytes] = scale_field(scales, fmt.scale)
    return out


def scale_field(scales: torch.Tensor, scale: str) -> torch.Tensor:
    """``[n, num_scales · bytes]`` uint8: fp32 ``scales`` as the record stores them."""
    if scale == "ue8m0":
        return ue8m0_byte(scales)
    if scale == "e4m3":
        return scales.to(torch.float8_e4m3fn).view(torch.uint8)
    return scales.to(torch.float32).contiguous().view(torch.uint8)


def record_scales(records: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``[..., num_scales]`` fp32 scales held by ``records`` ``[..., record_bytes]``."""
    raw = records[..., fmt.scale_offset : fmt.scale_offset + fmt.scale_bytes]
    if fmt.scale == "ue8m0":
        return ue8m0_value(raw)
    if fmt.scale == "e4m3":
        return decode_table("e4m3", raw.device)[raw.long()]
    return raw.contiguous().view(torch.float32)


def unpack_rows(records: torch.Tensor, fmt: KVFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., dim]`` rows in ``dtype`` of records ``[..., record_bytes]`` (exact in fp32)."""
    lead = records.shape[:-1]
    values = decode_codes(records[..., : fmt.code_bytes], fmt.code)
    scaled = (values.view(*lead, fmt.num_scales, fmt.block) * record_scales(records, fmt)[..., None]).view(*lead, fmt.quantized)
    if not fmt.rope:
        return scaled.to(dtype)
    rope = records[..., fmt.rope_offset : fmt.scale_offset].contiguous().view(torch.bfloat16)
    return torch.cat([scaled, rope.to(torch.float32)], dim=-1).to(dtype)


def round_rows(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``x`` as its records decode: what a row read back from the cache holds (also the rounding a
    quantized query gets)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    return unpack_rows(pack_rows(flat, fmt), fmt, x.dtype).view(shape)


def bad_scales(records: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``[...]`` bool: records whose scales are not scales (NaN, infinite, zero or negative)."""
    s = record_scales(records, fmt)
    return ~(torch.isfinite(s) & (s > 0)).all(-1)

"""The packed cache record, one element at a time in plain Python, written from the formulas alone.

Nothing here calls ``kv_format.py`` or torch's float8 casts: code values come
from the bit layouts (sign, exponent, mantissa), rounding is a search for the
nearest value with ties to the even code, and every comparison is exact (a
value of at most 9 significant bits times a power of two or an e4m3 number, or
an fp32 quotient, compared with an fp32 input in float64). Records are byte
strings laid out as ``[codes][rope bf16 LE][scales][zero pad to 4]``.
"""

from __future__ import annotations

import bisect
import functools
import math
import struct
from dataclasses import dataclass

#: largest magnitude of each code format, and the FP8 rounding's amax floor (as the fp32 inputs hold it)
QMAX = {"e4m3": 448.0, "e2m1": 6.0}
FP8_FLOOR = struct.unpack("<f", struct.pack("<f", 1e-4))[0]
FP4_FLOOR = {"ue8m0": 6.0 * 2.0**-126, "e4m3": 6.0 * 2.0**-9, "fp32": 6.0 * 2.0**-126}


def e4m3_value(code: int) -> float:
    """The value of an FP8 e4m3 byte (bias 7, no infinities, S.1111.111 NaN)."""
    sign, exp, man = code >> 7, (code >> 3) & 0xF, code & 7
    if exp == 15 and man == 7:
        return math.nan
    mag = man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return -mag if sign else mag


def e2m1_value(code: int) -> float:
    """The value of an FP4 e2m1 nibble (bias 1, no infinities or NaN)."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
    return -mag if sign else mag


@dataclass(frozen=True)
class CodeTable:
    """The non-negative finite values of a code format, ascending, with their codes; ``sign``: the sign bit."""

    values: tuple[float, ...]
    codes: tuple[int, ...]
    sign: int

    def nearest(self, x: float, s: float = 1.0) -> int:
        """The code nearest to ``x / s``, ties to the even code, saturated at the largest value; the sign bit set
        for a negative ``x`` (-0.0 included). Compares ``|x|`` with the exact ``value · s`` and midpoints."""
        a = abs(x)
        scaled = _scaled(self, s)
        i = bisect.bisect_right(scaled, a) - 1
        if i >= len(scaled) - 1:
            code = self.codes[-1]
        else:
            mid = (self.values[i] + self.values[i + 1]) / 2 * s
            if a < mid:
                code = self.codes[i]
            elif a > mid:
                code = self.codes[i + 1]
            else:
                code = self.codes[i] if self.codes[i] % 2 == 0 else self.codes[i + 1]
        return code | (self.sign if math.copysign(1.0, x) < 0 else 0)


@functools.lru_cache(maxsize=64)
def _scaled(table: CodeTable, s: float) -> list[float]:
    """``table``'s values times ``s`` (exact: at most 4 significant bits times a power of two or an e4m3 number)."""
    return [v * s for v in table.values]


def _table(value, codes: range, sign: int) -> CodeTable:
    pairs = sorted((value(c), c) for c in codes if not math.isnan(value(c)))
    return CodeTable(tuple(v for v, _ in pairs), tuple(c for _, c in pairs), sign)


E4M3 = _table(e4m3_value, range(0x80), 0x80)
E2M1 = _table(e2m1_value, range(8), 0x8)
TABLES = {"e4m3": E4M3, "e2m1": E2M1}


def f32(x: float) -> float:
    """``x`` rounded to fp32 (nearest even; beyond fp32's range, infinity). A float64 product or quotient of fp32
    numbers rounded again is the correctly rounded fp32 one."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def bf16_bits(x: float) -> int:
    """The bf16 bits of fp32 ``x``: the top half of its bits, rounded to nearest even; NaN as 0x7FC0."""
    if math.isnan(x):
        return 0x7FC0
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def ue8m0_exponent(amax: float, qmax: float) -> int:
    """The smallest ``k`` with ``qmax · 2^k >= amax``: the scale ``2^ceil(log2(amax / qmax))``."""
    k = math.frexp(amax)[1] - math.frexp(qmax)[1]
    while math.ldexp(qmax, k - 1) >= amax:
        k -= 1
    while math.ldexp(qmax, k) < amax:
        k += 1
    return k


@dataclass(frozen=True)
class Format:
    """The fields of a record format (the same meaning as ``KVFormat``'s)."""

    dim: int
    code: str
    block: int
    scale: str
    rope: int = 0


def block_record(block: list[float], fmt: Format) -> tuple[list[int], bytes]:
    """The codes and scale bytes of one block (fp32 values as Python floats)."""
    table, qmax = TABLES[fmt.code], QMAX[fmt.code]
    if not all(math.isfinite(v) for v in block):
        nan_code = 0x7F if fmt.code == "e4m3" else 0x7  # e2m1 has no NaN: +6
        nan_scale = {"ue8m0": b"\xff", "e4m3": b"\x7f", "fp32": struct.pack("<f", math.nan)}[fmt.scale]
        return [nan_code] * len(block), nan_scale
    floor = FP8_FLOOR if fmt.code == "e4m3" else FP4_FLOOR[fmt.scale]
    amax = max(max(abs(v) for v in block), floor)
    if fmt.scale == "ue8m0":
        k = ue8m0_exponent(amax, qmax)
        s, scale = math.ldexp(1.0, k), bytes([min(max(k + 127, 0), 254)])
        codes = [table.nearest(v, s) for v in block]
    elif fmt.scale == "e4m3":
        scale_code = E4M3.nearest(amax, qmax)  # e4m3(amax / Q), nearest even
        s, scale = e4m3_value(scale_code), bytes([scale_code])
        codes = [table.nearest(v, s) for v in block]
    else:
        s = f32(amax / qmax)
        scale = struct.pack("<f", s)
        codes = [table.nearest(f32(v / s)) for v in block]
    return codes, scale


def pack_row(row: list[float], fmt: Format) -> bytes:
    """The record of one row."""
    quantized = fmt.dim - fmt.rope
    codes, scales = [], b""
    for b0 in range(0, quantized, fmt.block):
        c, s = block_record(row[b0 : b0 + fmt.block], fmt)
        codes += c
        scales += s
    if fmt.code == "e2m1":
        code_bytes = bytes(codes[i] | (codes[i + 1] << 4) for i in range(0, quantized, 2))
    else:
        code_bytes = bytes(codes)
    rope = b"".join(struct.pack("<H", bf16_bits(v)) for v in row[quantized:])
    body = code_bytes + rope + scales
    return body + bytes(-len(body) % 4)


def unpack_row(record: bytes, fmt: Format) -> list[float]:
    """The fp32 values of one record: each code's value times its block's scale, one fp32 rounding."""
    quantized = fmt.dim - fmt.rope
    code_bytes = quantized // 2 if fmt.code == "e2m1" else quantized
    if fmt.code == "e2m1":
        values = [e2m1_value(n) for b in record[:code_bytes] for n in (b & 0xF, b >> 4)]
    else:
        values = [e4m3_value(b) for b in record[:code_bytes]]
    at = code_bytes + 2 * fmt.rope
    scales = []
    for i in range(quantized // fmt.block):
        if fmt.scale == "ue8m0":
            byte = record[at + i]
            scales.append(math.nan if byte == 0xFF else math.ldexp(1.0, byte - 127))
        elif fmt.scale == "e4m3":
            scales.append(e4m3_value(record[at + i]))
        else:
            scales.append(struct.unpack("<f", record[at + 4 * i : at + 4 * i + 4])[0])
    out = [f32(v * scales[i // fmt.block]) for i, v in enumerate(values)]
    for j in range(fmt.rope):
        (bits,) = struct.unpack("<H", record[code_bytes + 2 * j : code_bytes + 2 * j + 2])
        out.append(struct.unpack("<f", struct.pack("<I", bits << 16))[0])
    return out

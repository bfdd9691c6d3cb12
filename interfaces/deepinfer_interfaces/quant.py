"""Block-scaled quantized weights as DeepSeek checkpoints store them, and how to decode them.

A ``QuantizedWeight`` holds codes and one scale per block of a logical
``[..., N, K]`` weight: ``value[n, k] = decode(codes)[n, k] · scale[n // bn, k // bk]``.

- ``fmt="e4m3"``: FP8 codes, ``codes`` ``[..., N, K]`` as ``float8_e4m3fn`` (or
  their raw bytes as ``uint8``); DeepSeek's linears use 128 × 128 blocks.
- ``fmt="e2m1"``: FP4 codes packed two per byte, the first value in the low
  nibble, ``codes`` ``[..., N, K/2]`` ``uint8``; DeepSeek's routed experts use
  1 × 32 blocks.

``scales`` ``[..., ceil(N/bn), ceil(K/bk)]`` are ``float32`` multipliers or
``uint8`` UE8M0 exponents (the scale is ``2^(byte − 127)``, the layout of
``float8_e8m0fnu``). Edge blocks may be partial. Decoding is exact: every code
maps to one float32 value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FORMATS = ("e4m3", "e2m1")

#: the 16 e2m1 values by nibble: sign bit 3, exponent bits 2-1, mantissa bit 0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _e4m3_table() -> torch.Tensor:
    """float32 value of each of the 256 e4m3 bytes (NaN for the two NaN codes)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def decode_table(fmt: str, device: torch.device) -> torch.Tensor:
    """The float32 lookup table of ``fmt``'s codes on ``device``."""
    key = (fmt, torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        base = _e4m3_table() if fmt == "e4m3" else torch.tensor(E2M1_VALUES, dtype=torch.float32)
        table = _TABLES[key] = base.to(device)
    return table


def grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a logical ``[..., N, K]`` weight cut into ``block`` tiles, partial edge tiles included."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


@dataclass(frozen=True)
class QuantizedWeight:
    """Codes and block scales of one weight (or a stack of experts' weights)."""

    codes: torch.Tensor
    scales: torch.Tensor
    #: rows and columns of the logical weight one scale covers
    block: tuple[int, int]
    fmt: str

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown quantized format {self.fmt!r}; expected one of {', '.join(FORMATS)}")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape ``[..., N, K]``."""
        *lead, n, k = self.codes.shape
        return (*lead, n, 2 * k if self.fmt == "e2m1" else k)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "QuantizedWeight":
        """The same weight with ``fn`` applied to codes and scales (a device move, an index)."""
        return QuantizedWeight(fn(self.codes), fn(self.scales), self.block, self.fmt)

    def values(self) -> torch.Tensor:
        """The codes decoded to float32 ``[..., N, K]``, before scaling."""
        if self.codes.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # FP8 codes in a float8 dtype convert directly
            return self.codes.to(torch.float32)
        table = decode_table(self.fmt, self.codes.device)
        codes = self.codes.view(torch.uint8) if self.codes.dtype != torch.uint8 else self.codes
        if self.fmt == "e4m3":
            return table[codes.long()]
        low, high = table[(codes & 0x0F).long()], table[(codes >> 4).long()]
        return torch.stack((low, high), dim=-1).flatten(-2)

    def scale_grid(self) -> torch.Tensor:
        """The float32 scales ``[..., N/bn, K/bk]``."""
        if self.scales.dtype == torch.uint8:
            return torch.exp2(self.scales.to(torch.float32) - 127.0)
        return self.scales.to(torch.float32)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The logical weight ``[..., N, K]`` in ``dtype``."""
        *lead, n, k = self.shape
        bn, bk = self.block
        s = self.scale_grid()
        nb, kb = s.shape[-2:]
        v = self.values()
        if nb * bn != n or kb * bk != k:  # partial edge blocks: pad to whole blocks, trimmed below
            v = torch.nn.functional.pad(v, (0, kb * bk - k, 0, nb * bn - n))
        # each block times its scale through a broadcast view: no full-size copy of the scales
        v = v.view(*lead, nb, bn, kb, bk).mul_(s[..., :, None, :, None]).view(*lead, nb * bn, kb * bk)
        return v[..., :n, :k].to(dtype).contiguous()

    def rows(self, start: int, stop: int) -> "QuantizedWeight":
        """Rows ``[start, stop)`` of the logical weight; ``start`` must be a multiple of the block rows."""
        bn = self.block[0]
        if start % bn:
            raise ValueError(f"rows from {start} do not start on a block of {bn} rows")
        return QuantizedWeight(
            self.codes[..., start:stop, :], self.scales[..., start // bn : -(-stop // bn), :], self.block, self.fmt
        )


def quantize(w: torch.Tensor, fmt: str, block: tuple[int, int], ue8m0: bool = True) -> QuantizedWeight:
    """``w`` ``[..., N, K]`` as a ``QuantizedWeight``: each block's absolute maximum maps to the format's
    largest value; ``ue8m0`` rounds every scale up to a power of two (stored as exponent bytes).

    For tests, tools and kernels that re-encode weights; a checkpoint's codes are loaded as stored.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; expected one of {', '.join(FORMATS)}")
    *lead, n, k = w.shape
    bn, bk = block
    *_, gn, gk = grid_shape(tuple(w.shape), block)
    x = torch.nn.functional.pad(w.detach().to(torch.float32), (0, gk * bk - k, 0, gn * bn - n))
    tiles = x.reshape(*lead, gn, bn, gk, bk)
    amax = tiles.abs().amax(dim=(-3, -1))
    top = 448.0 if fmt == "e4m3" else 6.0
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    if ue8m0:
        exponent = torch.ceil(torch.log2(scale)).clamp(-127, 127)
        scale = torch.exp2(exponent)
    scaled = (tiles / scale[..., :, None, :, None]).reshape(x.shape)[..., :n, :k]
    if fmt == "e4m3":
        codes = scaled.clamp(-top, top).to(torch.float8_e4m3fn)
    else:
        codes = _pack_e2m1(scaled)
    stored = (exponent + 127).to(torch.uint8) if ue8m0 else scale
    return QuantizedWeight(codes.contiguous(), stored.contiguous(), block, fmt)


def _pack_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 nibble of each value, two per byte (low nibble first); ``x`` ``[..., K]``, K even."""
    if x.shape[-1] % 2:
        raise ValueError(f"e2m1 packs values in pairs; the last dim is {x.shape[-1]}")
    table = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=x.device)
    nib = (x.abs()[..., None] - table).abs().argmin(-1).to(torch.uint8)
    nib = torch.where((x < 0) & (nib > 0), nib | 0x8, nib)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)

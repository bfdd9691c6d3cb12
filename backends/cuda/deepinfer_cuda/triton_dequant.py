"""Block-scaled weights read inside matmul kernels: the codes decoded in registers, then scaled.

``QuantizedWeight`` stores FP8 (e4m3) or packed FP4 (e2m1) codes and one scale
per ``bn × bk`` block. ``weight_dot`` adds ``a @ W[rows, k0 : k0 + BLOCK_K]ᵀ``
to an accumulator for one tile of a plain or quantized weight, so the grouped
expert kernels and the dequantizing linear share one piece of code:

- codes are decoded by bit manipulation (no lookup table, no hardware FP8
  conversion, so it runs on any GPU and under the interpreter); every e4m3 and
  e2m1 value is exact in bf16 and fp16, so the dot sees the codes unrounded;
- when a ``BLOCK_K`` tile lies inside one scale block (``bk % BLOCK_K == 0``)
  the scale multiplies the tile's fp32 partial product, one scale per output
  column; otherwise (odd blocks) it multiplies the decoded tile element by
  element before the dot.

``WeightOperand`` is the host side: the tensors and compile-time constants a
kernel needs for one stacked weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_interfaces.quant import QuantizedWeight

#: the weight formats the kernels decode (``FMT`` constexpr)
PLAIN, E4M3, E2M1 = 0, 1, 2
_FORMATS = {"e4m3": E4M3, "e2m1": E2M1}


@triton.jit
def e4m3_to_float(b):
    """fp32 value of each e4m3 byte (``b`` an integer tensor): sign, 4 exponent bits (bias 7), 3 mantissa bits."""
    b = b.to(tl.int32)
    sign = (b >> 7) << 31
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    tiny = tl.where(sign != 0, -1.0, 1.0) * m.to(tl.float32) * 0.001953125  # subnormals: m · 2^-9
    value = tl.where(e == 0, tiny, normal)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def e2m1_to_float(v):
    """fp32 value of each e2m1 nibble (``v`` an integer tensor in [0, 16)): sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    v = v.to(tl.int32)
    e = (v >> 1) & 0x3
    m = v & 0x1
    magnitude = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))  # e == 0: 0 or 0.5
    return (((v >> 3) << 31) | magnitude).to(tl.float32, bitcast=True)


@triton.jit
def scale_to_float(s, UE8M0: tl.constexpr):
    """Block scales as fp32: UE8M0 exponent bytes are ``2^(byte − 127)`` (byte 0 flushes to 0), else as stored."""
    if UE8M0:
        return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return s.to(tl.float32)


@triton.jit
def _decoded_tile(w_ptr, rows64, row_ok, k0, K, stride_wn, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Codes of ``W[rows, k0 : k0 + BLOCK_K]`` as fp32 ``[BLOCK_K, BLOCK_N]`` (zeros past ``K`` and off ``row_ok``)."""
    if FMT == 1:
        kk = k0 + tl.arange(0, BLOCK_K)
        codes = tl.load(w_ptr + rows64[None, :] * stride_wn + kk[:, None], mask=(kk < K)[:, None] & row_ok[None, :], other=0)
        return e4m3_to_float(codes)
    # e2m1: byte j of a row holds values 2j (low nibble) and 2j + 1 (high nibble)
    j = tl.arange(0, BLOCK_K // 2)
    mask = row_ok[:, None] & ((k0 + 2 * j) < K)[None, :]
    packed = tl.load(w_ptr + rows64[:, None] * stride_wn + (k0 // 2 + j)[None, :], mask=mask, other=0).to(tl.int32)
    pairs = tl.join(e2m1_to_float(packed & 0xF), e2m1_to_float(packed >> 4))  # [BLOCK_N, BLOCK_K / 2, 2]
    return tl.trans(tl.reshape(pairs, (BLOCK_N, BLOCK_K)))


@triton.jit
def weight_dot(
    acc, a, w_ptr, s_ptr, rows, row_ok, k0, K, stride_wn, stride_sn,
    FMT: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr, UE8M0: tl.constexpr,
    DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``acc + a @ W[rows, k0 : k0 + BLOCK_K]ᵀ`` in fp32; ``a`` ``[BLOCK_M, BLOCK_K]`` in ``DOT`` is zero past ``K``.

    ``W`` is plain (``FMT`` 0, ``w_ptr`` of any float dtype, ``s_ptr`` unused),
    e4m3 (1) or e2m1 (2) codes with ``BN_W × BK_W`` block scales at ``s_ptr``
    (row stride ``stride_sn``); ``stride_wn`` is the row stride of the stored
    codes (bytes for FP4: half the columns). ``k0`` is a multiple of ``BLOCK_K``.
    """
    rows64 = rows.to(tl.int64)
    if FMT == 0:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows64[None, :] * stride_wn + kk[:, None], mask=(kk < K)[:, None] & row_ok[None, :], other=0.0)
        return tl.dot(a, w.to(DOT), acc, input_precision=PREC)
    vals = _decoded_tile(w_ptr, rows64, row_ok, k0, K, stride_wn, FMT, BLOCK_N, BLOCK_K)
    s_rows = (rows // BN_W).to(tl.int64) * stride_sn
    if BK_W % BLOCK_K == 0:
        # the tile lies in one block column: scale the partial product, one scale per output column
        s = scale_to_float(tl.load(s_ptr + s_rows + k0 // BK_W, mask=row_ok, other=0), UE8M0)
        return acc + tl.dot(a, vals.to(DOT), input_precision=PREC) * s[None, :]
    kk = k0 + tl.arange(0, BLOCK_K)
    s = tl.load(s_ptr + s_rows[None, :] + (kk // BK_W)[:, None], mask=(kk < K)[:, None] & row_ok[None, :], other=0)
    return tl.dot(a, (vals * scale_to_float(s, UE8M0)).to(DOT), acc, input_precision=PREC)


@dataclass(frozen=True)
class WeightOperand:
    """One (stacked) weight as a kernel reads it: ``data`` plain values or uint8 codes, ``scales``, and constants.

    ``shape`` is the logical ``[..., N, K]``; for FP4 ``data`` has ``K / 2``
    byte columns. ``scales`` is ``data`` itself for plain weights (unused).
    """

    data: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    fmt: int
    block: tuple[int, int]
    ue8m0: bool

    @classmethod
    def of(cls, w: torch.Tensor | QuantizedWeight) -> "WeightOperand":
        """The operand of a plain tensor or a ``QuantizedWeight`` (unit inner strides; codes as raw bytes)."""
        if isinstance(w, torch.Tensor):
            data = w if w.stride(-1) == 1 else w.contiguous()
            return cls(data, data, tuple(w.shape), PLAIN, (1, 1), False)
        codes = w.codes if w.codes.dtype == torch.uint8 else w.codes.view(torch.uint8)
        codes = codes if codes.stride(-1) == 1 else codes.contiguous()
        scales = w.scales if w.scales.stride(-1) == 1 else w.scales.contiguous()
        return cls(codes, scales, tuple(w.shape), _FORMATS[w.fmt], tuple(w.block), w.scales.dtype == torch.uint8)

    def constants(self) -> dict:
        """The ``weight_dot`` constexprs of this weight."""
        return dict(FMT=self.fmt, BN_W=self.block[0], BK_W=self.block[1], UE8M0=self.ue8m0)


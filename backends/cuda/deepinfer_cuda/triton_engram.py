"""DeepSeek V4.1's Engram ops as Triton kernels: the n-gram hash, the table gather, the gated injection.

- ``_hash_kernel``: a tile of tokens × the heads of one n-gram size at a time;
  int64 products of each look-back with its multiplier (wrapping modulo 2^64,
  as LLVM's ``mul i64`` and numpy's int64 arrays both do), a running XOR,
  then per head a floored modulo (Triton's ``%`` on signed integers truncates
  like C, so a negative remainder of a positive prime is moved up by the
  prime) plus the column's offset.
- ``_lookup_kernel``: a tile of ``(token, column)`` rows × channels; each row
  id picks a table row, FP8 e4m3 codes are decoded by bit manipulation
  (``triton_dequant.e4m3_to_float``) and scaled by ``2^(byte − 127)`` per 32
  channels in fp32 (exact: a power of two, the byte 0 included, as the
  subnormal ``2^−127``), or a float row is converted; then rounded to the
  output dtype once. Runs only when the table lives where the ids do: GPU
  memory, or pinned host memory aliased as a CUDA tensor (``map_host``),
  whose rows the kernel loads over the bus; a memory-mapped host table stays
  with the reference's host gather.
- ``_inject_kernel``: one program per (token, stream) on a GPU (per token,
  all streams as one tile, under the interpreter). The gate needs three sums
  over all ``D`` channels (``Σ h²``, ``Σ q²``, ``Σ h · w · q``), so a first
  pass over ``D`` in channel blocks adds them into fp32 vectors, and a second
  pass writes ``h + gate · value``; ``value`` is read once per stream (the
  other streams' reads of it hit L2).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, next_power_of_2, num_warps_for, unit_inner
from .triton_dequant import e4m3_to_float

#: channels one UE8M0 scale covers in an FP8 table (``ENGRAM_SCALE_BLOCK`` of the reference)
SCALE_BLOCK = tl.constexpr(32)
#: ``_lookup_kernel``'s ``FMT``: a float table, or e4m3 codes with UE8M0 scales
PLAIN_TABLE, E4M3_TABLE = 0, 1


@triton.jit
def _hash_kernel(
    tok_ptr, mult_ptr, prime_ptr, off_ptr, out_ptr, T, N, H, stride_tt, stride_ts, stride_p, stride_o,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    rows64 = rows.to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < H
    first = tl.load(tok_ptr + rows64 * stride_tt, mask=r_ok, other=0)
    rolling = first * tl.load(mult_ptr)
    for i in range(1, N):
        tok = tl.load(tok_ptr + rows64 * stride_tt + i * stride_ts, mask=r_ok, other=0)
        rolling = rolling ^ (tok * tl.load(mult_ptr + i))
        prime = tl.load(prime_ptr + (i - 1) * stride_p + h, mask=h_ok, other=1)
        rem = rolling[:, None] % prime[None, :]  # truncated: the sign of rolling
        rem = tl.where((rem != 0) & ((rem < 0) != (prime[None, :] < 0)), rem + prime[None, :], rem)
        col = (i - 1) * H + h
        rem += tl.load(off_ptr + col, mask=h_ok, other=0)[None, :]
        tl.store(out_ptr + rows64[:, None] * stride_o + col[None, :], rem, mask=r_ok[:, None] & h_ok[None, :])


@triton.jit
def _ue8m0_to_float(s):
    """``2^(byte − 127)`` in fp32 for each scale byte, exactly: byte 0 is the subnormal ``2^−127``, 255 is inf."""
    s = s.to(tl.int32)
    return tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(x):
    """The bf16 nearest ``x`` (ties to even, NaN kept NaN) as its 16 bits in an int16, to store through an int16 view.

    Spelled out because the interpreter truncates fp32 to bf16 where a GPU rounds, and the lookup compares exactly.
    """
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, (u >> 16) | 0x40, rounded).to(tl.int16)


@triton.jit
def _lookup_kernel(
    ids_ptr, codes_ptr, scales_ptr, out_ptr, R, C, J, ROWS, stride_it, stride_ic, stride_cr, stride_cj,
    stride_sr, stride_sj, stride_o,
    FMT: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_ok = j < J
    t, c = r // C, r % C
    ids = tl.load(ids_ptr + t.to(tl.int64) * stride_it + c * stride_ic, mask=r_ok, other=0)
    # an id outside the table (outside the op's contract) reads as zeros rather than faulting
    ok = (r_ok & (ids >= 0) & (ids < ROWS))[:, None] & j_ok[None, :]
    codes = tl.load(codes_ptr + ids[:, None] * stride_cr + j[None, :] * stride_cj, mask=ok, other=0)
    if FMT == 1:
        s = tl.load(scales_ptr + ids[:, None] * stride_sr + (j // SCALE_BLOCK)[None, :] * stride_sj, mask=ok, other=127)
        vals = e4m3_to_float(codes) * _ue8m0_to_float(s)
    else:
        vals = codes.to(tl.float32)
    if BF16_BITS:
        vals = _bf16_bits(vals)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_o + j[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & j_ok[None, :])


@triton.jit
def _inject_kernel(
    h_ptr, q_ptr, v_ptr, w_ptr, out_ptr, NS, D, eps, inv_sqrt_d,
    stride_ht, stride_hn, stride_qt, stride_qn, stride_vt, stride_wn, stride_ot, stride_on,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = k < NS
    h_rows = h_ptr + t * stride_ht + k[:, None] * stride_hn
    q_rows = q_ptr + t * stride_qt + k[:, None] * stride_qn
    w_rows = w_ptr + k[:, None] * stride_wn
    hh = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    qq = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    hwq = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = k_ok[:, None] & (d < D)[None, :]
        h = tl.load(h_rows + d[None, :], mask=m, other=0.0).to(tl.float32)
        q = tl.load(q_rows + d[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_rows + d[None, :], mask=m, other=0.0).to(tl.float32)
        hh += h * h
        qq += q * q
        hwq += h * w * q
    rstd = (1.0 / tl.sqrt(tl.sum(hh, axis=1) / D + eps)) * (1.0 / tl.sqrt(tl.sum(qq, axis=1) / D + eps))
    dot = tl.sum(hwq, axis=1) * rstd * inv_sqrt_d
    sign = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
    gate = tl.sigmoid(sign * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6)))[:, None]
    o_rows = out_ptr + t * stride_ot + k[:, None] * stride_on
    v_row = v_ptr + t * stride_vt
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = k_ok[:, None] & (d < D)[None, :]
        h = tl.load(h_rows + d[None, :], mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_row + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(o_rows + d[None, :], (h + gate * v[None, :]).to(out_ptr.dtype.element_ty), mask=m)


def hash_tiles(heads: int) -> Tiles:
    """128 tokens × every head of an n-gram size a program (4 tokens under the interpreter, so batches cross tiles)."""
    block_t, block_h = choose(128, 4), next_power_of_2(heads)
    return Tiles({"BLOCK_T": block_t, "BLOCK_H": block_h}, num_warps=num_warps_for(block_t * block_h))


def _interpreter_block(width: int) -> int:
    """A quarter of ``width`` (rounded up to a power of two), at least 16: few, large interpreter steps that still
    leave every row crossing blocks."""
    return max(16, next_power_of_2(width) // 4)


def lookup_tiles(head_dim: int) -> Tiles:
    """Rows × channels, about 2048 values a program: 8 rows of V4.1's 256 channels (under the interpreter
    32 rows of a quarter row, so rows and channels both cross tiles)."""
    block_j = min(next_power_of_2(head_dim), choose(1024, _interpreter_block(head_dim)))
    block_r = choose(max(1, 2048 // block_j), 32)
    return Tiles({"BLOCK_R": block_r, "BLOCK_J": block_j}, num_warps=num_warps_for(block_r * block_j))


def inject_tiles(streams: int, dim: int) -> Tiles:
    """One stream a program in channel blocks of up to 1024: V4.1's 5120 channels as five full blocks, and at
    decode (16 tokens) 64 programs rather than 16. Under the interpreter, whose cost is per operation, every
    stream of a token at once (masked past ``n``) in blocks of a quarter row, so both passes loop and the last
    block is partial where the width is not a power of two."""
    block_n = choose(1, next_power_of_2(streams))
    block_d = min(next_power_of_2(dim), choose(1024, _interpreter_block(dim)))
    return Tiles({"BLOCK_N": block_n, "BLOCK_D": block_d}, num_warps=num_warps_for(block_n * block_d))


def engram_hash(tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``Kernels.engram_hash`` on the device for ``T >= 1`` tokens and ``N >= 2`` look-backs."""
    t, n = tokens.shape
    heads = primes.shape[-1]
    if tuple(multipliers.shape) != (n,) or tuple(primes.shape) != (n - 1, heads) or tuple(offsets.shape) != ((n - 1) * heads,):
        raise ValueError(
            f"engram_hash: tokens {tuple(tokens.shape)} need multipliers ({n},), primes ({n - 1}, H) and offsets "
            f"({n - 1}·H,); got {tuple(multipliers.shape)}, {tuple(primes.shape)}, {tuple(offsets.shape)}"
        )
    tokens = tokens.to(torch.int64)
    mult, primes, offsets = (x.to(torch.int64).contiguous() for x in (multipliers, primes, offsets))
    out = torch.empty(t, (n - 1) * heads, dtype=torch.int64, device=tokens.device)
    tiles = hash_tiles(heads)
    _hash_kernel[(triton.cdiv(t, tiles.blocks["BLOCK_T"]),)](
        tokens, mult, primes, offsets, out, t, n, heads, tokens.stride(0), tokens.stride(1), primes.stride(0), out.stride(0),
        **tiles.kwargs(),
    )
    return out


def engram_lookup(codes: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``Kernels.engram_lookup`` with the table on ``ids``' device: ``T·C >= 1`` rows, e4m3 codes (float8 or raw
    bytes) with UE8M0 scale bytes (uint8 or e8m0), or a float table and no scales."""
    t, c = ids.shape
    rows, head_dim = codes.shape
    if scales is not None:
        codes = codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)
        scales = scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)
    out = torch.empty(t, c, head_dim, dtype=dtype, device=ids.device)
    bits = dtype == torch.bfloat16
    tiles = lookup_tiles(head_dim)
    grid = (triton.cdiv(t * c, tiles.blocks["BLOCK_R"]), triton.cdiv(head_dim, tiles.blocks["BLOCK_J"]))
    s = codes if scales is None else scales
    _lookup_kernel[grid](
        ids, codes, s, out.view(torch.int16) if bits else out, t * c, c, head_dim, rows, ids.stride(0), ids.stride(1),
        codes.stride(0), codes.stride(1), s.stride(0), s.stride(1), head_dim,
        FMT=PLAIN_TABLE if scales is None else E4M3_TABLE, BF16_BITS=bits, **tiles.kwargs(),
    )
    return out


def engram_inject(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Kernels.engram_inject`` on the device for ``T >= 1`` tokens; fp32 math, the streams' dtype out."""
    t, n, d = streams.shape
    if tuple(key.shape) != (t, n, d) or tuple(value.shape) != (t, d) or tuple(weight.shape) != (n, d):
        raise ValueError(
            f"engram_inject: streams {tuple(streams.shape)} need key ({t}, {n}, {d}), value ({t}, {d}) and weight ({n}, {d}); "
            f"got {tuple(key.shape)}, {tuple(value.shape)}, {tuple(weight.shape)}"
        )
    streams, key, value, weight = (unit_inner(x) for x in (streams, key, value, weight))
    out = torch.empty(t, n, d, dtype=streams.dtype, device=streams.device)
    tiles = inject_tiles(n, d)
    _inject_kernel[(t, triton.cdiv(n, tiles.blocks["BLOCK_N"]))](
        streams, key, value, weight, out, n, d, float(eps), 1.0 / math.sqrt(d),
        streams.stride(0), streams.stride(1), key.stride(0), key.stride(1), value.stride(0), weight.stride(0),
        out.stride(0), out.stride(1), **tiles.kwargs(),
    )
    return out

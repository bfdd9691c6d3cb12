"""The KV compressor's gated pooling: a per-channel online softmax over a window of gathered rows.

A program takes one output entry and a block of channels. It walks the
window's slots in tiles, gathering the ``gate`` and ``kv`` rows (contiguous
along the channels), adds the position bias and keeps a running max, sum of
weights and weighted sum per channel in fp32. With overlapping windows the
previous window's rows feed channel ``c`` and the current window's rows
channel ``d + c`` of the same softmax. Absent slots (``-1``) are skipped; an
entry with no slot at all comes out as zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, next_power_of_2, num_warps_for


@triton.jit
def _pool_tile(
    kv_ptr, gate_ptr, bias_ptr, idx, idx_ok, j, j_ok, chan, c_ok, stride_kv, stride_g, stride_b, m_i, l_i, acc,
):
    """Fold one tile of window slots (rows ``idx``, slots ``j``) into the running softmax of channels ``chan``."""
    rows = idx[:, None]
    mask = idx_ok[:, None] & c_ok[None, :]
    g = tl.load(gate_ptr + rows * stride_g + chan[None, :], mask=mask, other=0.0).to(tl.float32)
    g += tl.load(bias_ptr + j[:, None] * stride_b + chan[None, :], mask=j_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    g = tl.where(mask, g, float("-inf"))
    v = tl.load(kv_ptr + rows * stride_kv + chan[None, :], mask=mask, other=0.0).to(tl.float32)
    m_new = tl.maximum(m_i, tl.max(g, axis=0))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    w = tl.exp(g - shift[None, :])
    alpha = tl.exp(m_i - shift)
    return m_new, l_i * alpha + tl.sum(w, axis=0), acc * alpha + tl.sum(w * v, axis=0)


@triton.jit
def _compress_kv_kernel(
    kv_ptr, gate_ptr, bias_ptr, idx_ptr, prev_ptr, out_ptr,
    M, DOUT, N, stride_kv, stride_g, stride_b, stride_i, stride_p, stride_o,
    HAS_PREV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    cb = tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < DOUT
    m_i = tl.full([BLOCK_C], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_C], tl.float32)
    acc = tl.zeros([BLOCK_C], tl.float32)
    for j0 in range(0, M, BLOCK_M):
        j = j0 + tl.arange(0, BLOCK_M)
        j_ok = j < M
        if HAS_PREV:
            pidx = tl.load(prev_ptr + e * stride_p + j, mask=j_ok, other=-1)
            m_i, l_i, acc = _pool_tile(
                kv_ptr, gate_ptr, bias_ptr, pidx, (pidx >= 0) & (pidx < N), j, j_ok, c, c_ok,
                stride_kv, stride_g, stride_b, m_i, l_i, acc,
            )
            cur_chan = DOUT + c
        else:
            cur_chan = c
        idx = tl.load(idx_ptr + e * stride_i + j, mask=j_ok, other=-1)
        m_i, l_i, acc = _pool_tile(
            kv_ptr, gate_ptr, bias_ptr, idx, (idx >= 0) & (idx < N), j, j_ok, cur_chan, c_ok,
            stride_kv, stride_g, stride_b, m_i, l_i, acc,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)
    tl.store(out_ptr + e * stride_o + c, out.to(out_ptr.dtype.element_ty), mask=c_ok)


def compress_tiles(window: int, channels: int) -> Tiles:
    """Windows of ``window`` slots walked up to 32 at a time, over blocks of up to 128 of ``channels`` output channels."""
    block_c = min(next_power_of_2(channels), choose(128, 32))
    block_m = min(next_power_of_2(window), choose(32, 8))
    return Tiles({"BLOCK_M": block_m, "BLOCK_C": block_c}, num_warps=num_warps_for(block_m * block_c))


def compress_kv(
    kv: torch.Tensor,
    gate: torch.Tensor,
    position_bias: torch.Tensor,
    indices: torch.Tensor,
    prev_indices: torch.Tensor | None,
) -> torch.Tensor:
    """``Kernels.compress_kv`` on the device for ``E >= 1`` entries."""
    if kv.dim() != 2 or gate.shape != kv.shape or indices.dim() != 2:
        raise ValueError(
            f"compress_kv: need kv and gate [N, C] of one shape and indices [E, m]; "
            f"got {tuple(kv.shape)}, {tuple(gate.shape)}, {tuple(indices.shape)}"
        )
    entries, m = indices.shape
    width = kv.shape[1]
    if tuple(position_bias.shape) != (m, width):
        raise ValueError(f"compress_kv: position_bias must be [m={m}, C={width}], got {tuple(position_bias.shape)}")
    if prev_indices is not None and tuple(prev_indices.shape) != (entries, m):
        raise ValueError(f"compress_kv: prev_indices must match indices [{entries}, {m}], got {tuple(prev_indices.shape)}")
    if prev_indices is not None and width % 2:
        raise ValueError(f"compress_kv: overlapping windows need an even channel count (two series), got C={width}")
    dout = width // 2 if prev_indices is not None else width
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    bias = position_bias if position_bias.stride(-1) == 1 else position_bias.contiguous()
    indices = indices.to(torch.int64).contiguous()
    prev = indices if prev_indices is None else prev_indices.to(torch.int64).contiguous()
    out = torch.empty(entries, dout, dtype=kv.dtype, device=kv.device)
    if dout == 0:
        return out
    tiles = compress_tiles(m, dout)
    _compress_kv_kernel[(entries, triton.cdiv(dout, tiles.blocks["BLOCK_C"]))](
        kv, gate, bias, indices, prev, out,
        m, dout, kv.shape[0], kv.stride(0), gate.stride(0), bias.stride(0), indices.stride(0), prev.stride(0), out.stride(0),
        HAS_PREV=prev_indices is not None, **tiles.kwargs(),
    )
    return out

"""The KV compressor's gated softmax pooling as a Triton-Ascend kernel.

One program per vector core walks (entry, channel-block) tiles. A tile holds
every slot of the window at once (the window is at most the compression ratio,
128 in V4), so the softmax over slots is a plain max/exp/sum in fp32 with no
running rescale; the overlapping CSA windows add the previous window's slots to
the same softmax. No atomics: each output element has one writer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import block, interpreting, next_power_of_2, program_count


@triton.jit
def _compress_kv_kernel(
    kv_ptr, gate_ptr, bias_ptr, idx_ptr, prev_ptr, out_ptr,
    E, M, DOUT,
    stride_kv, stride_gate, stride_bias, stride_idx, stride_prev, stride_out,
    HAS_PREV: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    c_blocks = tl.cdiv(DOUT, BLOCK_C)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    for tile in range(pid, E * c_blocks, NUM_PROGRAMS):
        e = tl.cast(tile // c_blocks, tl.int64)
        offs_c = (tile % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = offs_c < DOUT
        # the current window reads channels [DOUT, 2·DOUT) when windows overlap, else [0, DOUT)
        cur_c = offs_c + DOUT if HAS_PREV else offs_c
        idx = tl.load(idx_ptr + e * stride_idx + offs_m, mask=m_ok, other=-1)
        ok = (m_ok & (idx >= 0))[:, None] & c_ok[None, :]
        rows = tl.where(m_ok & (idx >= 0), idx, 0).to(tl.int64)
        gate = tl.load(gate_ptr + rows[:, None] * stride_gate + cur_c[None, :], mask=ok, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + offs_m[:, None] * stride_bias + cur_c[None, :], mask=ok, other=0.0).to(tl.float32)
        vals = tl.load(kv_ptr + rows[:, None] * stride_kv + cur_c[None, :], mask=ok, other=0.0).to(tl.float32)
        logits = tl.where(ok, gate + bias, float("-inf"))
        top = tl.max(logits, axis=0)
        if HAS_PREV:
            pidx = tl.load(prev_ptr + e * stride_prev + offs_m, mask=m_ok, other=-1)
            pok = (m_ok & (pidx >= 0))[:, None] & c_ok[None, :]
            prows = tl.where(m_ok & (pidx >= 0), pidx, 0).to(tl.int64)
            pgate = tl.load(gate_ptr + prows[:, None] * stride_gate + offs_c[None, :], mask=pok, other=0.0).to(tl.float32)
            pbias = tl.load(bias_ptr + offs_m[:, None] * stride_bias + offs_c[None, :], mask=pok, other=0.0).to(tl.float32)
            pvals = tl.load(kv_ptr + prows[:, None] * stride_kv + offs_c[None, :], mask=pok, other=0.0).to(tl.float32)
            plogits = tl.where(pok, pgate + pbias, float("-inf"))
            top = tl.maximum(top, tl.max(plogits, axis=0))
        # a channel with no valid slot pools to zero: exp(-inf) weights and a denominator of 1
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(logits - top[None, :])
        num = tl.sum(w * vals, axis=0)
        den = tl.sum(w, axis=0)
        if HAS_PREV:
            pw = tl.exp(plogits - top[None, :])
            num += tl.sum(pw * pvals, axis=0)
            den += tl.sum(pw, axis=0)
        pooled = num / tl.where(den > 0.0, den, 1.0)
        tl.store(out_ptr + e * stride_out + offs_c, pooled.to(out_ptr.dtype.element_ty), mask=c_ok)


def compress_kv(
    kv: torch.Tensor,
    gate: torch.Tensor,
    position_bias: torch.Tensor,
    indices: torch.Tensor,
    prev_indices: torch.Tensor | None,
) -> torch.Tensor:
    """``Kernels.compress_kv`` for fp32/fp16/bf16 pools with at least one entry and slot."""
    entries, m = indices.shape
    c = kv.shape[-1]
    dout = c // 2 if prev_indices is not None else c
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    bias = position_bias if position_bias.stride(-1) == 1 else position_bias.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    prev = indices if prev_indices is None else (prev_indices if prev_indices.stride(-1) == 1 else prev_indices.contiguous())
    out = torch.empty(entries, dout, dtype=kv.dtype, device=kv.device)
    programs = program_count(kv.device)
    block_m = next_power_of_2(m)
    block_c = block(dout, 4 if interpreting() else max(1, 4096 // block_m))
    _compress_kv_kernel[(programs,)](
        kv, gate, bias, indices, prev, out,
        entries, m, dout,
        kv.stride(0), gate.stride(0), bias.stride(0), indices.stride(0), prev.stride(0), out.stride(0),
        HAS_PREV=prev_indices is not None,
        NUM_PROGRAMS=programs,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
    )
    return out

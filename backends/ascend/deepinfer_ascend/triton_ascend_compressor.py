"""The KV compressor's gated softmax pooling as a Triton-Ascend kernel.

One program per vector core walks (entry, channel-block) tiles. A tile holds
every slot of the window at once (the window is at most the compression ratio,
128 in V4, or twice it when CSA windows overlap), so the softmax over slots is
a plain max/exp/sum in fp32 with no running rescale. No atomics: each output
element has one writer.

The tile is ``[BLOCK_C channels, BLOCK_S slots]``, so the softmax reduces its
last axis (a leading-axis reduction is what triton-ascend#2291 miscompiles on
910B, for 3-D tiles). With overlapping windows the previous window's slots
(channel ``c``) and the current window's (channel ``DOUT + c``) sit side by side
on the slot axis of one tile, ``2m`` slots wide. ``BLOCK_S`` is padded to at
least ``REDUCE_MIN`` (16) with masked slots (logit ``-inf``, weight 0): V4's CSA
window of 4 (8 slots overlapped) is below the extent of 8 that
triton-ascend#2247 reports dropping lanes on Ascend 950. ``BLOCK_C`` comes from
the UB budget (``plan_compress_kv``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (
    REDUCE_MIN, Tile, TilePlan, UnifiedBuffer, block, fit_blocks, interpreting, next_power_of_2, program_count, require_fit,
    unified_buffer,
)

#: most channels per tile
BLOCK_C_CAP = 256


@triton.jit
def _compress_kv_kernel(
    kv_ptr, gate_ptr, bias_ptr, idx_ptr, prev_ptr, out_ptr,
    E, M, DOUT,
    stride_kv, stride_gate, stride_bias, stride_idx, stride_prev, stride_out,
    HAS_PREV: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    c_blocks = tl.cdiv(DOUT, BLOCK_C)
    offs_s = tl.arange(0, BLOCK_S)
    if HAS_PREV:
        # slots [0, M): the previous window at channel c; [M, 2M): the current one at channel DOUT + c
        s_ok = offs_s < 2 * M
        is_prev = offs_s < M
        slot = tl.where(is_prev, offs_s, offs_s - M)
        chan = tl.where(is_prev, 0, DOUT)
    else:
        s_ok = offs_s < M
        slot = offs_s
        chan = tl.zeros([BLOCK_S], dtype=tl.int32)
    for tile in range(pid, E * c_blocks, NUM_PROGRAMS):
        e = tl.cast(tile // c_blocks, tl.int64)
        offs_c = (tile % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_ok = offs_c < DOUT
        if HAS_PREV:
            cur = tl.load(idx_ptr + e * stride_idx + slot, mask=s_ok & (offs_s >= M), other=-1)
            prev = tl.load(prev_ptr + e * stride_prev + slot, mask=is_prev, other=-1)
            idx = tl.where(is_prev, prev, cur)
        else:
            idx = tl.load(idx_ptr + e * stride_idx + slot, mask=s_ok, other=-1)
        s_valid = s_ok & (idx >= 0)
        rows = tl.where(s_valid, idx, 0).to(tl.int64)
        ok = c_ok[:, None] & s_valid[None, :]
        col = offs_c[:, None] + chan[None, :]
        gate = tl.load(gate_ptr + rows[None, :] * stride_gate + col, mask=ok, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + slot[None, :] * stride_bias + col, mask=ok, other=0.0).to(tl.float32)
        vals = tl.load(kv_ptr + rows[None, :] * stride_kv + col, mask=ok, other=0.0).to(tl.float32)
        logits = tl.where(ok, gate + bias, float("-inf"))
        # a channel with no valid slot pools to zero: exp(-inf) weights and a denominator of 1
        top = tl.max(logits, axis=1)
        top = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(logits - top[:, None])
        num = tl.sum(w * vals, axis=1)
        den = tl.sum(w, axis=1)
        pooled = num / tl.where(den > 0.0, den, 1.0)
        tl.store(out_ptr + e * stride_out + offs_c, pooled.to(out_ptr.dtype.element_ty), mask=c_ok)


def plan_compress_kv(
    m: int, dout: int, overlap: bool, dtype: torch.dtype, bias_dtype: torch.dtype, ub: UnifiedBuffer,
    *, interpret: bool = False,
) -> TilePlan:
    """Blocks of ``_compress_kv_kernel`` for windows of ``m`` slots into ``dout`` channels within ``ub``.

    ``BLOCK_S`` holds every slot (``2m`` when windows overlap) padded to at
    least 16: it is the reduced axis. ``BLOCK_C`` shrinks until the tiles fit.
    """
    bs = max(REDUCE_MIN, next_power_of_2(2 * m if overlap else m))
    xs = torch.empty((), dtype=dtype).element_size()
    bias_size = torch.empty((), dtype=bias_dtype).element_size()

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bc = b["BLOCK_C"]
        out = [
            Tile("indices", (bs,), 8, loaded=True), Tile("slot", (bs,), 4), Tile("channel offset", (bs,), 4),
            Tile("slot valid", (bs,), 1), Tile("rows", (bs,), 8),
            Tile("gate", (bc, bs), xs, loaded=True), Tile("bias", (bc, bs), bias_size, loaded=True),
            Tile("kv", (bc, bs), xs, loaded=True),
            Tile("gate fp32", (bc, bs), 4), Tile("bias fp32", (bc, bs), 4), Tile("kv fp32", (bc, bs), 4),
            Tile("logits", (bc, bs), 4), Tile("weights", (bc, bs), 4), Tile("weights·kv", (bc, bs), 4),
            Tile("mask", (bc, bs), 1), Tile("columns", (bc, bs), 4), Tile("bias offsets", (bc, bs), 4),
            Tile("gate offsets", (bc, bs), 8), Tile("kv offsets", (bc, bs), 8),
            Tile("top", (bc,), 4), Tile("num", (bc,), 4), Tile("den", (bc,), 4), Tile("pooled", (bc,), xs),
        ]
        if overlap:
            out += [Tile("previous indices", (bs,), 8, loaded=True), Tile("current indices", (bs,), 8)]
        return tuple(out)

    start = {"BLOCK_S": bs, "BLOCK_C": block(dout, 4 if interpret else BLOCK_C_CAP)}
    shape = f"{'overlapping ' if overlap else ''}m={m}, D={dout}, {str(dtype).removeprefix('torch.')}"
    return fit_blocks("compress_kv", shape, ub, start, {"BLOCK_S": bs}, tiles)


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
    wider = max(kv.dtype, gate.dtype, key=lambda dt: torch.empty((), dtype=dt).element_size())
    plan = require_fit(plan_compress_kv(
        m, dout, prev_indices is not None, wider, position_bias.dtype, unified_buffer(kv.device), interpret=interpreting(),
    ))
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    bias = position_bias if position_bias.stride(-1) == 1 else position_bias.contiguous()
    indices = indices if indices.stride(-1) == 1 else indices.contiguous()
    prev = indices if prev_indices is None else (prev_indices if prev_indices.stride(-1) == 1 else prev_indices.contiguous())
    out = torch.empty(entries, dout, dtype=kv.dtype, device=kv.device)
    programs = program_count(kv.device)
    _compress_kv_kernel[(programs,)](
        kv, gate, bias, indices, prev, out,
        entries, m, dout,
        kv.stride(0), gate.stride(0), bias.stride(0), indices.stride(0), prev.stride(0), out.stride(0),
        HAS_PREV=prev_indices is not None,
        NUM_PROGRAMS=programs,
        **plan.blocks,
    )
    return out

"""Sparse multi-query attention over gathered K=V rows with attention sinks (flash-decoding style).

A program takes one token and a block of heads, walks that token's index
list in tiles of ``BLOCK_N`` rows and keeps an online softmax in fp32: each
gathered row is one contiguous ``D``-vector (a coalesced load), read once for
the whole head block and used as both key and value. ``-1`` (and any index
outside the pool) scores ``-inf`` and loads nothing. The sink enters as the
running maximum's starting value with weight ``exp(0) = 1``, so a token with no
valid index ends with all mass on the sink and an output of zeros, exactly as
the reference defines it.

When tokens × head blocks cannot fill the GPU (decode), each token's index
list is cut into slices handled by separate programs; a second kernel merges
the slices' (max, sum, unnormalised output) and adds the sink.

The pool may be a ``PackedPool`` of one or two regions (``pool_operand``):
each gathered row's record is decoded in registers (``triton_records.pool_rows``)
and rounded to the query's dtype, as the reference's decoded rows are; such
launches take tiles of at most 32 rows (``PACKED_ROWS``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_interfaces import PackedPool

from .launch import Tiles, autotune_configs, choose, next_power_of_2, unit_inner
from .pool_operand import kernel_pool
from .triton_common import dot_operands, programs_target, split_count
from .triton_records import pool_rows

#: log2(e): scores and sinks are kept in the log2 domain so the softmax uses exp2
LOG2E = tl.constexpr(1.4426950408889634)


#: ``(BLOCK_N, warps, stages)`` over the rows of a plain pool
PLAIN_ROWS = ((32, 4, 2), (64, 4, 2), (32, 8, 3), (64, 8, 3))
#: over packed records, which are decoded in registers: at most 32 rows a tile, on 8 warps (wider tiles, or 32 rows
#: on 4 warps, spill at V4-Flash's 512-wide heads)
PACKED_ROWS = ((16, 8, 3), (32, 8, 3))


def row_config(config: triton.Config) -> tuple[int, int, int]:
    """``(BLOCK_N, warps, stages)`` of an autotune config."""
    return config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def _configs() -> list[triton.Config]:
    return autotune_configs(
        [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in dict.fromkeys(PLAIN_ROWS + PACKED_ROWS)],
        triton.Config({"BLOCK_N": 4}, num_warps=1),
    )


def keep_configs(configs: list[triton.Config], rows: tuple[tuple[int, int, int], ...]) -> list[triton.Config]:
    """The configs among ``rows`` (the first config where none is: the interpreter's one)."""
    return [c for c in configs if row_config(c) in rows] or configs[:1]


def _prune(configs: list[triton.Config], nargs: dict, **constants: object) -> list[triton.Config]:
    """Small heads (tests, tiny models) take the first config instead of benchmarking them all; otherwise the
    configs of plain rows or of packed records (``REGIONS`` > 0)."""
    if nargs["D"] <= 64:
        return configs[:1]
    return keep_configs(configs, PACKED_ROWS if constants.get("REGIONS") else PLAIN_ROWS)


#: slice lengths are multiples of this, so every BLOCK_N of the configs divides them
_SLICE_QUANTUM = choose(64, 4)


@triton.jit
def head_block_query(q_ptr, H, D, stride_qt, stride_qh, DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's token, slice, head block and channels, and the block's queries ``[BLOCK_H, BLOCK_D]``
    (axis 0 walks the head blocks of one token before the next token, so they share its rows in L2)."""
    head_blocks = tl.cdiv(H, BLOCK_H)
    hb = tl.program_id(0) % head_blocks
    t = (tl.program_id(0) // head_blocks).to(tl.int64)
    sl = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh + d[None, :],
        mask=h_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(DOT)
    return t, sl, heads, h_ok, d, d_ok, q


@triton.jit
def softmax_start(sink_ptr, heads, h_ok, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """The running (max, sum, output) of a head block: the sink as the starting maximum with weight
    ``exp(0) = 1`` (no value), or empty for a slice whose merge adds the sink."""
    if SPLIT:
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
    else:
        m_i = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    return m_i, l_i, tl.zeros([BLOCK_H, BLOCK_D], tl.float32)


@triton.jit
def softmax_absorb(q, rows, ok, m_i, l_i, acc, qk_scale, DOT: tl.constexpr, PREC: tl.constexpr):
    """One tile of ``rows`` (``ok``: a real row) into the running softmax of ``q``'s heads (log2 domain)."""
    s = tl.dot(q, tl.trans(rows), input_precision=PREC) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row that has seen only -inf keeps l = 0; shifting by 0 there avoids inf - inf
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - shift[:, None])
    alpha = tl.exp2(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), rows, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def softmax_store(
    out_ptr, part_m_ptr, part_l_ptr, m_i, l_i, acc, t, sl, heads, h_ok, d, d_ok, H, D, stride_ot, stride_oh,
    SPLIT: tl.constexpr,
):
    """The normalised output, or a slice's partial results: out ``[T, S, H, D]`` fp32 unnormalised, m and
    l ``[T, S, H]`` (what ``_merge_slices_kernel`` reads)."""
    o_ptrs = out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh + d[None, :]
    o_mask = h_ok[:, None] & d_ok[None, :]
    if SPLIT:
        stat = (t * tl.num_programs(1) + sl) * H + heads
        tl.store(part_m_ptr + stat, m_i, mask=h_ok)
        tl.store(part_l_ptr + stat, l_i, mask=h_ok)
        tl.store(o_ptrs + sl.to(tl.int64) * H * D, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.autotune(configs=_configs(), key=["H", "D", "SPLIT", "REGIONS", "F0", "F1"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _sparse_attention_kernel(
    q_ptr, kv_ptr, kv2_ptr, idx_ptr, sink_ptr, out_ptr, part_m_ptr, part_l_ptr,
    H, D, K, N, SLICE, qk_scale,
    stride_qt, stride_qh, stride_kv, stride_kv2, SPLIT_ROW, stride_it, stride_ot, stride_oh,
    SPLIT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    REGIONS: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t, sl, heads, h_ok, d, d_ok, q = head_block_query(q_ptr, H, D, stride_qt, stride_qh, DOT, BLOCK_H, BLOCK_D)
    m_i, l_i, acc = softmax_start(sink_ptr, heads, h_ok, SPLIT, BLOCK_H, BLOCK_D)
    start = sl * SLICE
    end = tl.minimum(start + SLICE, K)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + t * stride_it + n, mask=n < end, other=-1)
        ok = (idx >= 0) & (idx < N)
        rows = pool_rows(
            kv_ptr, kv2_ptr, idx, ok, d, d_ok, stride_kv, stride_kv2, SPLIT_ROW, q_ptr.dtype.element_ty, REGIONS, F0, F1,
        ).to(DOT)
        m_i, l_i, acc = softmax_absorb(q, rows, ok, m_i, l_i, acc, qk_scale, DOT, PREC)
    softmax_store(out_ptr, part_m_ptr, part_l_ptr, m_i, l_i, acc, t, sl, heads, h_ok, d, d_ok, H, D, stride_ot, stride_oh, SPLIT)


@triton.jit
def _merge_slices_kernel(
    part_ptr, part_m_ptr, part_l_ptr, sink_ptr, out_ptr, H, D, S, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    head_blocks = tl.cdiv(H, BLOCK_H)
    hb = tl.program_id(0) % head_blocks
    t = (tl.program_id(0) // head_blocks).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    d = tl.arange(0, BLOCK_D)
    mask = h_ok[:, None] & (d < D)[None, :]
    m = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * LOG2E
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(0, S):
        stat = (t * S + s) * H + heads
        m_s = tl.load(part_m_ptr + stat, mask=h_ok, other=float("-inf"))
        l_s = tl.load(part_l_ptr + stat, mask=h_ok, other=0.0)
        o_s = tl.load(part_ptr + (stat[:, None] * D + d[None, :]), mask=mask, other=0.0)
        m_new = tl.maximum(m, m_s)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m - shift)
        b = tl.exp2(m_s - shift)
        l = l * a + l_s * b
        acc = acc * a[:, None] + o_s * b[:, None]
        m = m_new
    o_ptrs = out_ptr + t * stride_ot + heads[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(o_ptrs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def attention_tiles(heads: int, dim: int) -> Tiles:
    """A block of up to 16 heads (one MMA's rows) and the whole head dim, the reduction of q·kᵀ
    (at least 16: ``tl.dot`` needs that for 16-bit operands); ``BLOCK_N``, warps and stages are autotuned."""
    block_h = choose(16, 4) if heads >= 16 else max(1, min(next_power_of_2(heads), choose(16, 4)))
    return Tiles({"BLOCK_H": block_h, "BLOCK_D": max(16, next_power_of_2(dim))})


def merge_tiles(heads: int, dim: int) -> Tiles:
    """The slice merge takes the attention kernel's head and channel blocks."""
    return Tiles(attention_tiles(heads, dim).blocks, num_warps=choose(4, 1))


def attention_slices(tokens: int, heads: int, k: int, target: int) -> tuple[int, int]:
    """``(splits, slice_len)``: each token's ``k`` indices cut into slices (multiples of ``_SLICE_QUANTUM``)
    when tokens × head blocks fall short of ``target`` programs (decode), else one slice of all of them."""
    head_blocks = triton.cdiv(heads, attention_tiles(heads, 1).blocks["BLOCK_H"])
    splits = split_count(tokens * head_blocks, k, 2 * _SLICE_QUANTUM, target)
    slice_len = triton.cdiv(triton.cdiv(k, splits), _SLICE_QUANTUM) * _SLICE_QUANTUM
    return triton.cdiv(k, slice_len), slice_len


def check_attention_shapes(
    op: str, q: torch.Tensor, kv: "torch.Tensor | PackedPool", indices: torch.Tensor, sinks: torch.Tensor, rows: str = "N"
) -> None:
    """One line naming the mismatch when ``q [T, H, D]``, ``kv [rows, D]`` (a tensor or a packed pool), ``indices [T, K]``
    and ``sinks [H]`` disagree."""
    if q.dim() != 3 or len(kv.shape) != 2 or indices.dim() != 2:
        raise ValueError(f"{op}: need q [T, H, D], kv [{rows}, D], indices [T, K]; got {tuple(q.shape)}, {tuple(kv.shape)}, {tuple(indices.shape)}")
    tokens, heads, dim = q.shape
    if kv.shape[1] != dim or indices.shape[0] != tokens or tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"{op}: kv must be [{rows}, {dim}], indices [{tokens}, K] and sinks [{heads}]; "
            f"got {tuple(kv.shape)}, {tuple(indices.shape)}, {tuple(sinks.shape)}"
        )


def sparse_attention(
    q: torch.Tensor, kv: "torch.Tensor | PackedPool", indices: torch.Tensor, sinks: torch.Tensor, scale: float,
    invariant: bool = False,
) -> torch.Tensor:
    """``Kernels.sparse_attention`` on the device for ``T >= 1`` tokens and ``K >= 1`` indices; ``kv`` plain rows or
    packed records (decoded in registers). ``invariant``: batch-invariant mode (each token's indices never split)."""
    check_attention_shapes("sparse_attention", q, kv, indices, sinks)
    tokens, heads, dim = q.shape
    q = unit_inner(q)
    pool = kernel_pool("sparse_attention", q, kv)
    indices = indices.to(torch.int64)
    indices = unit_inner(indices)
    sinks = sinks.contiguous()
    k = indices.shape[1]
    dot, prec = dot_operands(q.dtype)
    tiles = attention_tiles(heads, dim)
    head_blocks = triton.cdiv(heads, tiles.blocks["BLOCK_H"])
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    splits, slice_len = attention_slices(tokens, heads, k, programs_target(q.device, invariant))
    common = dict(DOT=dot, PREC=prec, **pool.constants(), **tiles.kwargs())
    qk_scale = float(scale) * LOG2E.value
    kv, kv2, stride_kv, stride_kv2, split_row = pool.args()
    if splits == 1:
        _sparse_attention_kernel[(head_blocks * tokens, 1)](
            q, kv, kv2, indices, sinks, out, out, out,
            heads, dim, k, pool.rows, k, qk_scale,
            q.stride(0), q.stride(1), stride_kv, stride_kv2, split_row, indices.stride(0), out.stride(0), out.stride(1),
            SPLIT=False, **common,
        )
        return out
    part = torch.empty(tokens, splits, heads, dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(tokens, splits, heads, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    _sparse_attention_kernel[(head_blocks * tokens, splits)](
        q, kv, kv2, indices, sinks, part, part_m, part_l,
        heads, dim, k, pool.rows, slice_len, qk_scale,
        q.stride(0), q.stride(1), stride_kv, stride_kv2, split_row, indices.stride(0), part.stride(0), part.stride(2),
        SPLIT=True, **common,
    )
    _merge_slices_kernel[(head_blocks * tokens,)](
        part, part_m, part_l, sinks, out, heads, dim, splits, out.stride(0), out.stride(1),
        **merge_tiles(heads, dim).kwargs(),
    )
    return out

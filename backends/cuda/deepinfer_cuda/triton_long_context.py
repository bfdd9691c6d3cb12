"""The ops that read every compressed entry a token sees through per-sequence tables: the indexer's fused
score + top-k (``indexer_topk``) and attention over listed rows plus every visible entry (``entry_attention``).

Neither allocates anything that grows with the table width ``N`` (a million-token context has 262,144
CSA entries): each program walks its token's entries ``table[token_seq[t], j]``, ``j < visible[t]``, in
tiles and keeps only a running state in registers. At decode, when tokens alone cannot fill the GPU,
each token's entries are cut into at most 32 slices (a count that depends on the shapes only) whose
states, ``[T, S, ·]``, a second kernel merges. Nothing is read back to the host, so a decode step that
calls them can be captured as a graph.

``indexer_topk``: a program scores ``K_PAD`` entries at a time (``BLOCK_N`` per ``tl.dot`` of all the
token's heads, ``[H, D] x [D, BLOCK_N]``, ReLU and the weighted head sum in registers) and packs each
candidate into one int64 key, ``(order-preserving int32 of the fp32 score) << 32 | (2^31 - 1 - j)``, so a
larger key is a better pick and equal scores go to the lower entry ``j``; a non-candidate is ``SENTINEL``,
below every key. The tile joins the running best ``K_PAD`` keys (kept sorted, descending) through
``tl.topk`` of the ``2 K_PAD`` concatenation, skipped when the tile's best key is below the current k-th.
The keys are unique, so the picks are exactly the reference's whenever the scores are. ``K_PAD`` is
``next_power_of_2(min(k, N))`` (at least ``MIN_TILE``), at most ``MAX_TOPK``; wider top-k runs the
reference (itself tiled). Output columns past ``K_PAD`` are ``-1`` (no token has more candidates).

``entry_attention``: ``triton_attention``'s online softmax with the sink as the starting maximum, over one
virtual list per token: its ``K`` listed rows, then its visible entries' rows. Split slices reuse
``triton_attention``'s merge kernel (which adds the sink).

Both read plain pools or ``PackedPool``s of one or two regions, whose records they decode in registers
(``triton_records.pool_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_interfaces import PackedPool

from .launch import Tiles, autotune_configs, choose, next_power_of_2, num_warps_for, unit_inner
from .pool_operand import kernel_pool
from .triton_attention import (
    LOG2E, PACKED_ROWS, _merge_slices_kernel, attention_slices, attention_tiles, check_attention_shapes, head_block_query,
    keep_configs, merge_tiles, softmax_absorb, softmax_start, softmax_store,
)
from .triton_common import dot_operands, programs_target, split_count
from .triton_indexer import indexer_query, indexer_row_scores, indexer_tiles
from .triton_records import pool_rows

#: the widest running top-k the fused kernel keeps in registers (V4-Flash's index_topk is 512)
MAX_TOPK = 2048
#: the fewest entries one merge takes (small k still scores entries in wide tiles)
MIN_TILE = choose(128, 4)

#: a non-candidate's key, below every real key; the int32 key of a -inf score; the low 32 bits' maximum
SENTINEL = tl.constexpr(-(2**63))
KEY_MAX = tl.constexpr(2**63 - 1)
NEG_INF_KEY = tl.constexpr(-2139095041)
LOW = tl.constexpr(2**31 - 1)


# ---- indexer top-k --------------------------------------------------------------------------


@triton.jit
def _score_keys(score, j):
    """int64 keys of fp32 ``score`` at entries ``j``: larger key = higher score, then lower ``j``."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: they compare equal, so they tie
    bits = score.to(tl.int32, bitcast=True)
    key32 = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (key32.to(tl.int64) << 32) | (LOW + -j.to(tl.int64))


@triton.jit
def _merge_best(best, tile, TOPK, K_PAD: tl.constexpr):
    """The ``K_PAD`` best keys of ``best`` (sorted, descending) and ``tile`` (any order), sorted descending;
    ``best`` itself when nothing in ``tile`` beats its ``TOPK``-th key."""
    pos = tl.arange(0, K_PAD)
    kth = tl.min(tl.where(pos < TOPK, best, KEY_MAX), axis=0)
    if tl.max(tile, axis=0) > kth:
        both = tl.reshape(tl.permute(tl.join(best, tile), (1, 0)), [2 * K_PAD])
        best = tl.topk(both, K_PAD)
    return best


@triton.jit
def _store_entries(out_ptr, best, TOPK, K_PAD: tl.constexpr):
    """Decode keys to entry numbers (``-1`` for non-candidates and ``-inf`` scores); the first ``TOPK`` columns."""
    pos = tl.arange(0, K_PAD)
    ids = LOW + -(best & LOW)
    ids = tl.where((best >> 32) > NEG_INF_KEY, ids, -1)
    tl.store(out_ptr + pos, ids, mask=pos < TOPK)


@triton.jit
def _indexer_topk_kernel(
    q_ptr, w_ptr, keys_ptr, keys2_ptr, table_ptr, seq_ptr, vis_ptr, out_ptr,
    H, D, N, P, TOPK, SLICE, scale,
    stride_qt, stride_qh, stride_wt, stride_k, stride_k2, SPLIT_ROW, stride_tb, stride_ot,
    SPLIT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, REGIONS: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    q, w, d, d_ok = indexer_query(q_ptr, w_ptr, t, H, D, stride_qt, stride_qh, stride_wt, DOT, BLOCK_H, BLOCK_D)
    seq = tl.load(seq_ptr + t)
    start = sl * SLICE
    end = tl.minimum(start + SLICE, tl.minimum(tl.load(vis_ptr + t), N).to(tl.int32))
    SUBS: tl.constexpr = K_PAD // BLOCK_N
    sub = tl.arange(0, SUBS)
    best = tl.full([K_PAD], SENTINEL, tl.int64)
    for j0 in range(start, end, K_PAD):
        # score up to K_PAD entries, BLOCK_N per dot, into one tile of keys
        tile = tl.full([SUBS, BLOCK_N], SENTINEL, tl.int64)
        for s in range(0, tl.minimum(SUBS, tl.cdiv(end - j0, BLOCK_N))):
            j = j0 + s * BLOCK_N + tl.arange(0, BLOCK_N)
            seen = j < end
            row = tl.load(table_ptr + seq * stride_tb + j, mask=seen, other=-1)
            ok = seen & (row >= 0) & (row < P)
            score = indexer_row_scores(
                q, w, keys_ptr, keys2_ptr, row, ok, d, d_ok, stride_k, stride_k2, SPLIT_ROW, scale, q_ptr.dtype.element_ty,
                DOT, PREC, REGIONS, F0, F1,
            )
            key = tl.where(ok, _score_keys(score, j), SENTINEL)
            tile = tl.where(sub[:, None] == s, key[None, :], tile)
        best = _merge_best(best, tl.reshape(tile, [K_PAD]), TOPK, K_PAD)
    if SPLIT:
        # the slice's keys: [T, S, K_PAD] int64, merged by _topk_merge_kernel
        tl.store(out_ptr + (t * tl.num_programs(1) + sl) * K_PAD + tl.arange(0, K_PAD), best)
    else:
        _store_entries(out_ptr + t * stride_ot, best, TOPK, K_PAD)


@triton.jit
def _topk_merge_kernel(part_ptr, out_ptr, S, TOPK, stride_ot, K_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, K_PAD)
    best = tl.load(part_ptr + t * S * K_PAD + pos)
    for s in range(1, S):
        best = _merge_best(best, tl.load(part_ptr + (t * S + s) * K_PAD + pos), TOPK, K_PAD)
    _store_entries(out_ptr + t * stride_ot, best, TOPK, K_PAD)


def topk_width(k: int, entries: int) -> int:
    """``K_PAD``: the running top-k's width for ``k`` picks of ``entries`` (a power of two, at least ``MIN_TILE``)."""
    return max(MIN_TILE, next_power_of_2(min(k, entries)))


def topk_tiles(heads: int, dim: int, k: int, entries: int, dtype: torch.dtype) -> Tiles:
    """Every indexer head and the whole head dim (``indexer_tiles``), ``K_PAD`` entries a merge scored ``BLOCK_N``
    per dot: 64 on a GPU (32 for fp32 operands, which spill at 64), a quarter of the tile under the interpreter
    (so small tiles still take several dots)."""
    k_pad = topk_width(k, entries)
    block_n = min(k_pad, choose(32 if dtype == torch.float32 else 64, max(4, k_pad // 4)))
    blocks = indexer_tiles(heads, dim).blocks
    warps = choose(8 if k_pad >= 512 or heads * dim >= 8192 else 4, 1)
    return Tiles({**blocks, "BLOCK_N": block_n, "K_PAD": k_pad}, num_warps=warps)


def topk_merge_tiles(k: int, entries: int) -> Tiles:
    k_pad = topk_width(k, entries)
    return Tiles({"K_PAD": k_pad}, num_warps=choose(num_warps_for(2 * k_pad), 1))


def topk_slices(tokens: int, k: int, entries: int, target: int) -> tuple[int, int]:
    """``(splits, slice_len)``: each token's entries cut into slices of whole tiles (at least 4 tiles on a GPU,
    1 under the interpreter) when tokens fall short of ``target`` programs (decode), else one slice of all."""
    k_pad = topk_width(k, entries)
    splits = split_count(tokens, entries, choose(4, 1) * k_pad, target)
    slice_len = triton.cdiv(triton.cdiv(entries, splits), k_pad) * k_pad
    return triton.cdiv(entries, slice_len), slice_len


def _check_tables(op: str, tokens: int, table: torch.Tensor, token_seq: torch.Tensor, visible: torch.Tensor) -> None:
    if table.dim() != 2 or tuple(token_seq.shape) != (tokens,) or tuple(visible.shape) != (tokens,):
        raise ValueError(
            f"{op}: need table [B, N], token_seq [{tokens}] and visible [{tokens}]; "
            f"got {tuple(table.shape)}, {tuple(token_seq.shape)}, {tuple(visible.shape)}"
        )


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: "torch.Tensor | PackedPool", table: torch.Tensor, token_seq: torch.Tensor,
    visible: torch.Tensor, scale: float, k: int, invariant: bool = False,
) -> torch.Tensor:
    """``Kernels.indexer_topk`` on the device for ``T >= 1`` tokens, ``N >= 1`` entries and ``1 <= k``,
    ``next_power_of_2(min(k, N)) <= MAX_TOPK``; ``keys`` plain rows or packed records (decoded in registers).
    Allocates ``[T, k]`` (and ``[T, S <= 32, K_PAD]`` at decode), never ``[T, N]``."""
    if q.dim() != 3 or weights.dim() != 2 or len(keys.shape) != 2:
        raise ValueError(
            f"indexer_topk: need q [T, H, D], weights [T, H], keys [P, D]; "
            f"got {tuple(q.shape)}, {tuple(weights.shape)}, {tuple(keys.shape)}"
        )
    tokens, heads, dim = q.shape
    if tuple(weights.shape) != (tokens, heads) or keys.shape[1] != dim:
        raise ValueError(
            f"indexer_topk: weights must be [{tokens}, {heads}] and keys [P, {dim}]; got {tuple(weights.shape)}, {tuple(keys.shape)}"
        )
    _check_tables("indexer_topk", tokens, table, token_seq, visible)
    n = table.shape[1]
    if k < 1 or n < 1 or topk_width(k, n) > MAX_TOPK:
        raise ValueError(f"indexer_topk: need k >= 1, N >= 1 and next_power_of_2(min(k, N)) <= {MAX_TOPK}; got k={k}, N={n}")
    q, weights = unit_inner(q), unit_inner(weights)
    pool = kernel_pool("indexer_topk", q, keys)
    table = unit_inner(table.to(torch.int64))
    token_seq, visible = token_seq.to(torch.int64).contiguous(), visible.to(torch.int64).contiguous()
    tiles = topk_tiles(heads, dim, k, n, q.dtype)
    k_pad = tiles.blocks["K_PAD"]
    out = torch.empty(tokens, k, dtype=torch.int64, device=q.device)
    if k > k_pad:
        out[:, k_pad:] = -1  # fewer candidates than k_pad exist
    dot, prec = dot_operands(q.dtype)
    splits, slice_len = topk_slices(tokens, k, n, programs_target(q.device, invariant))
    part = torch.empty(tokens, splits, k_pad, dtype=torch.int64, device=q.device) if splits > 1 else out
    keys, keys2, stride_k, stride_k2, split_row = pool.args()
    _indexer_topk_kernel[(tokens, splits)](
        q, weights, keys, keys2, table, token_seq, visible, part,
        heads, dim, n, pool.rows, k, slice_len, float(scale),
        q.stride(0), q.stride(1), weights.stride(0), stride_k, stride_k2, split_row, table.stride(0), out.stride(0),
        SPLIT=splits > 1, DOT=dot, PREC=prec, **pool.constants(), **tiles.kwargs(),
    )
    if splits > 1:
        _topk_merge_kernel[(tokens,)](part, out, splits, k, out.stride(0), **topk_merge_tiles(k, n).kwargs())
    return out


# ---- entry attention ------------------------------------------------------------------------


#: the one config of fp32 operands (twice the registers of 16-bit ones) at wide heads
_FP32_ROWS = (16, 8, 3)
#: ``triton_attention``'s configs of plain rows less 64 rows on 4 warps, which spills at V4-Flash's 512-wide heads
_PLAIN_ROWS = ((32, 4, 2), (32, 8, 3), (64, 8, 3))


def _attention_configs() -> list[triton.Config]:
    """The configs of plain rows, ``_FP32_ROWS`` and ``triton_attention``'s configs of packed records."""
    rows = dict.fromkeys(_PLAIN_ROWS + (_FP32_ROWS,) + PACKED_ROWS)
    return autotune_configs(
        [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in rows],
        triton.Config({"BLOCK_N": 4}, num_warps=1),
    )


def _attention_prune(configs: list[triton.Config], nargs: dict, **constants: object) -> list[triton.Config]:
    """Small heads: the first config; at wide heads ``_FP32_ROWS`` for fp32 operands, else the configs of plain rows
    or of packed records (``REGIONS`` > 0)."""
    if nargs["D"] <= 64:
        return configs[:1]
    if nargs["q_ptr"].dtype == torch.float32:
        return keep_configs(configs, (_FP32_ROWS,))
    return keep_configs(configs, PACKED_ROWS if constants.get("REGIONS") else _PLAIN_ROWS)


@triton.autotune(
    configs=_attention_configs(), key=["H", "D", "SPLIT", "REGIONS", "F0", "F1"], prune_configs_by={"early_config_prune": _attention_prune},
)
@triton.jit
def _entry_attention_kernel(
    q_ptr, kv_ptr, kv2_ptr, idx_ptr, table_ptr, seq_ptr, vis_ptr, sink_ptr, out_ptr, part_m_ptr, part_l_ptr,
    H, D, K, N, P, SLICE, qk_scale,
    stride_qt, stride_qh, stride_kv, stride_kv2, SPLIT_ROW, stride_it, stride_tb, stride_ot, stride_oh,
    SPLIT: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, REGIONS: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t, sl, heads, h_ok, d, d_ok, q = head_block_query(q_ptr, H, D, stride_qt, stride_qh, DOT, BLOCK_H, BLOCK_D)
    m_i, l_i, acc = softmax_start(sink_ptr, heads, h_ok, SPLIT, BLOCK_H, BLOCK_D)
    seq = tl.load(seq_ptr + t)
    # the token's list: positions [0, K) are its listed rows, [K, K + visible) its entries' rows
    seen = tl.maximum(tl.minimum(tl.load(vis_ptr + t), N), 0).to(tl.int32)
    start = sl * SLICE
    end = tl.minimum(start + SLICE, K + seen)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        listed = n < K
        idx = tl.load(idx_ptr + t * stride_it + n, mask=listed & (n < end), other=-1)
        entry = tl.load(table_ptr + seq * stride_tb + (n - K), mask=(n >= K) & (n < end), other=-1)
        row = tl.where(listed, idx, entry)
        ok = (row >= 0) & (row < P)
        rows = pool_rows(
            kv_ptr, kv2_ptr, row, ok, d, d_ok, stride_kv, stride_kv2, SPLIT_ROW, q_ptr.dtype.element_ty, REGIONS, F0, F1,
        ).to(DOT)
        m_i, l_i, acc = softmax_absorb(q, rows, ok, m_i, l_i, acc, qk_scale, DOT, PREC)
    softmax_store(out_ptr, part_m_ptr, part_l_ptr, m_i, l_i, acc, t, sl, heads, h_ok, d, d_ok, H, D, stride_ot, stride_oh, SPLIT)


def entry_attention(
    q: torch.Tensor, kv: "torch.Tensor | PackedPool", indices: torch.Tensor, table: torch.Tensor, token_seq: torch.Tensor,
    visible: torch.Tensor, sinks: torch.Tensor, scale: float, invariant: bool = False,
) -> torch.Tensor:
    """``Kernels.entry_attention`` on the device for ``T >= 1`` tokens; ``kv`` plain rows or packed records (decoded
    in registers). Allocates the ``[T, H, D]`` output (and ``[T, S <= 32, H, D]`` fp32 partials at decode), never ``[T, N, ·]``."""
    check_attention_shapes("entry_attention", q, kv, indices, sinks, rows="P")
    tokens, heads, dim = q.shape
    _check_tables("entry_attention", tokens, table, token_seq, visible)
    q = unit_inner(q)
    pool = kernel_pool("entry_attention", q, kv)
    indices = unit_inner(indices.to(torch.int64))
    table = unit_inner(table.to(torch.int64))
    token_seq, visible = token_seq.to(torch.int64).contiguous(), visible.to(torch.int64).contiguous()
    sinks = sinks.contiguous()
    k, n = indices.shape[1], table.shape[1]
    length = max(k + n, 1)
    dot, prec = dot_operands(q.dtype)
    tiles = attention_tiles(heads, dim)
    head_blocks = triton.cdiv(heads, tiles.blocks["BLOCK_H"])
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    splits, slice_len = attention_slices(tokens, heads, length, programs_target(q.device, invariant))
    common = dict(DOT=dot, PREC=prec, **pool.constants(), **tiles.kwargs())
    qk_scale = float(scale) * LOG2E.value
    # an empty list's pointer is never read; pass a live int64 tensor in its place
    tables = (indices if k else token_seq, table if n else token_seq, token_seq, visible, sinks)
    sizes = (heads, dim, k, n, pool.rows)
    kv, kv2, stride_kv, stride_kv2, split_row = pool.args()
    if splits == 1:
        _entry_attention_kernel[(head_blocks * tokens, 1)](
            q, kv, kv2, *tables, out, out, out, *sizes, length, qk_scale,
            q.stride(0), q.stride(1), stride_kv, stride_kv2, split_row, indices.stride(0), table.stride(0), out.stride(0),
            out.stride(1), SPLIT=False, **common,
        )
        return out
    part = torch.empty(tokens, splits, heads, dim, dtype=torch.float32, device=q.device)
    part_m = torch.empty(tokens, splits, heads, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    _entry_attention_kernel[(head_blocks * tokens, splits)](
        q, kv, kv2, *tables, part, part_m, part_l, *sizes, slice_len, qk_scale,
        q.stride(0), q.stride(1), stride_kv, stride_kv2, split_row, indices.stride(0), table.stride(0), part.stride(0),
        part.stride(2), SPLIT=True, **common,
    )
    _merge_slices_kernel[(head_blocks * tokens,)](
        part, part_m, part_l, sinks, out, heads, dim, splits, out.stride(0), out.stride(1),
        **merge_tiles(heads, dim).kwargs(),
    )
    return out

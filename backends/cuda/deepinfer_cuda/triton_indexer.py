"""The lightning indexer's scores: per-head dot products, ReLU and the weighted head sum in one pass.

A program takes one token and a tile of ``BLOCK_N`` candidate entries: it
gathers their key rows (contiguous, coalesced), multiplies them by all of the
token's indexer heads at once (``[H, D] × [D, BLOCK_N]``) and reduces over the
heads in registers, so the ``[T, H, K]`` intermediate of the reference never
reaches memory. Top-k stays in torch (``Kernels.topk_select``). Keys of a
``PackedPool`` are decoded in registers (``triton_records.pool_rows``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_interfaces import PackedPool

from .launch import Tiles, autotune_configs, next_power_of_2, unit_inner
from .pool_operand import kernel_pool
from .triton_common import dot_operands
from .triton_records import pool_rows


def _configs() -> list[triton.Config]:
    return autotune_configs(
        [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in ((64, 4, 2), (128, 4, 2), (64, 8, 3), (128, 8, 3))],
        triton.Config({"BLOCK_N": 4}, num_warps=1),
    )


def _prune(configs: list[triton.Config], nargs: dict, **_: object) -> list[triton.Config]:
    """Small heads (tests, tiny models) take the first config instead of benchmarking them all."""
    return configs[:1] if nargs["D"] * nargs["H"] <= 1024 else configs


@triton.jit
def indexer_query(
    q_ptr, w_ptr, t, H, D, stride_qt, stride_qh, stride_wt, DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Token ``t``'s indexer queries ``[BLOCK_H, BLOCK_D]`` (in ``DOT``) and fp32 head weights, and the channels."""
    h = tl.arange(0, BLOCK_H)
    h_ok = h < H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(
        q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0
    ).to(DOT)
    w = tl.load(w_ptr + t * stride_wt + h, mask=h_ok, other=0.0).to(tl.float32)
    return q, w, d, d_ok


@triton.jit
def indexer_row_scores(
    q, w, keys_ptr, keys2_ptr, row, ok, d, d_ok, stride_k, stride_k2, split, scale,
    ROWS: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, REGIONS: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr,
):
    """``[BLOCK_N]`` head-summed ReLU scores of the key rows ``row`` (rows not ``ok`` read as zeros; the
    caller masks them): every head at once, ``[H, D] × [D, BLOCK_N]``. Keys are plain rows or packed records
    (``triton_records.pool_rows``), read as ``ROWS``."""
    rows = pool_rows(keys_ptr, keys2_ptr, row, ok, d, d_ok, stride_k, stride_k2, split, ROWS, REGIONS, F0, F1).to(DOT)
    dots = tl.dot(q, tl.trans(rows), input_precision=PREC)  # [H, BLOCK_N]
    return tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * scale


@triton.autotune(configs=_configs(), key=["H", "D", "REGIONS", "F0", "F1"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _indexer_scores_kernel(
    q_ptr, w_ptr, keys_ptr, keys2_ptr, idx_ptr, out_ptr,
    H, D, K, N, scale,
    stride_qt, stride_qh, stride_wt, stride_k, stride_k2, SPLIT_ROW, stride_it, stride_ot,
    DOT: tl.constexpr, PREC: tl.constexpr, REGIONS: tl.constexpr, F0: tl.constexpr, F1: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    q, w, d, d_ok = indexer_query(q_ptr, w_ptr, t, H, D, stride_qt, stride_qh, stride_wt, DOT, BLOCK_H, BLOCK_D)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < K
    idx = tl.load(idx_ptr + t * stride_it + n, mask=n_ok, other=-1)
    ok = (idx >= 0) & (idx < N)
    score = indexer_row_scores(
        q, w, keys_ptr, keys2_ptr, idx, ok, d, d_ok, stride_k, stride_k2, SPLIT_ROW, scale, q_ptr.dtype.element_ty, DOT, PREC,
        REGIONS, F0, F1,
    )
    score = tl.where(ok, score, float("-inf"))
    tl.store(out_ptr + t * stride_ot + n, score, mask=n_ok)


def indexer_tiles(heads: int, dim: int) -> Tiles:
    """Every indexer head at once and the whole head dim, the reduction of the head dot products
    (at least 16: ``tl.dot`` needs that for 16-bit operands); ``BLOCK_N``, warps and stages are autotuned."""
    return Tiles({"BLOCK_H": next_power_of_2(heads), "BLOCK_D": max(16, next_power_of_2(dim))})


def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: "torch.Tensor | PackedPool", indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """``Kernels.indexer_scores`` on the device for ``T >= 1`` tokens and ``K >= 1`` candidates; fp32 scores.
    ``keys`` plain rows or packed records (decoded in registers)."""
    if q.dim() != 3 or weights.dim() != 2 or len(keys.shape) != 2 or indices.dim() != 2:
        raise ValueError(
            f"indexer_scores: need q [T, H, D], weights [T, H], keys [N, D], indices [T, K]; got "
            f"{tuple(q.shape)}, {tuple(weights.shape)}, {tuple(keys.shape)}, {tuple(indices.shape)}"
        )
    tokens, heads, dim = q.shape
    if tuple(weights.shape) != (tokens, heads) or keys.shape[1] != dim or indices.shape[0] != tokens:
        raise ValueError(
            f"indexer_scores: weights must be [{tokens}, {heads}], keys [N, {dim}] and indices [{tokens}, K]; "
            f"got {tuple(weights.shape)}, {tuple(keys.shape)}, {tuple(indices.shape)}"
        )
    q = unit_inner(q)
    pool = kernel_pool("indexer_scores", q, keys)
    weights = unit_inner(weights)
    indices = indices.to(torch.int64)
    indices = unit_inner(indices)
    k = indices.shape[1]
    out = torch.empty(tokens, k, dtype=torch.float32, device=q.device)
    dot, prec = dot_operands(q.dtype)
    grid = lambda meta: (tokens, triton.cdiv(k, meta["BLOCK_N"]))  # noqa: E731
    keys, keys2, stride_k, stride_k2, split_row = pool.args()
    _indexer_scores_kernel[grid](
        q, weights, keys, keys2, indices, out,
        heads, dim, k, pool.rows, float(scale),
        q.stride(0), q.stride(1), weights.stride(0), stride_k, stride_k2, split_row, indices.stride(0), out.stride(0),
        DOT=dot, PREC=prec, **pool.constants(), **indexer_tiles(heads, dim).kwargs(),
    )
    return out

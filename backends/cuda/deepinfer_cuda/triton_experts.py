"""Grouped clamped-SwiGLU experts: two grouped matmuls over (token, expert) pairs sorted by expert.

The expert weights are plain tensors (``moe_experts``) or block-scaled FP8 /
FP4 codes (``moe_experts_quantized``), decoded tile by tile inside both
matmuls (``triton_dequant.weight_dot``); everything else is shared.

Torch lays out the work without a host sync: the ``T·k`` (token, slot) pairs
are sorted by expert and each expert's run is padded to a multiple of
``BLOCK_M``, so every row tile belongs to one expert. The grid is sized for
the worst case; tiles past the last expert's run exit at once.

1. ``_up_kernel``: per row tile and block of ``I`` columns, the gate and up
   projections (``x @ w13[e, :I]ᵀ`` and ``x @ w13[e, I:]ᵀ``) accumulate in fp32
   side by side; the epilogue applies the clamped SwiGLU and stores the
   activation in the input dtype (the next matmul's operand dtype).
2. ``_down_kernel``: ``act @ w2[e]ᵀ`` in fp32, times the pair's routing weight,
   stored per pair in fp32.
3. ``_sum_kernel``: each token's ``k`` pair rows summed in slot order (skipping
   ``-1`` and foreign ids) and cast to the input dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_interfaces.quant import QuantizedWeight

from .launch import SHARED_MEMORY_PER_BLOCK, Tiles, autotune_configs, choose, interpreting, next_power_of_2, num_warps_for
from .triton_common import dot_operands
from .triton_dequant import PLAIN, WeightOperand, weight_dot


def _configs() -> list[triton.Config]:
    shapes = ((64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 8, 4))
    return autotune_configs(
        [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes],
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 16}, num_warps=1),
    )


def pipelined_bytes(config: triton.Config, block_m: int, itemsize: int, weight_tiles: int) -> int:
    """Shared memory the software pipeline buffers for plain weights: an activation tile and ``weight_tiles``
    weight tiles (two for the gate and up halves) per buffer. ``num_stages`` buffers for 16-bit dots (exact
    for the wgmma / tcgen05 tiles of ``BLOCK_M`` 64, an upper bound for smaller tiles, which keep one buffer
    fewer), ``num_stages - 1`` for fp32 (FMA) dots, as ``compile_check`` measures them on sm_90 and sm_100."""
    buffers = config.num_stages if itemsize < 4 else config.num_stages - 1
    return buffers * (block_m + weight_tiles * config.kwargs["BLOCK_N"]) * config.kwargs["BLOCK_K"] * itemsize


def _prune(configs: list[triton.Config], nargs: dict, weight_tiles: int, **meta: object) -> list[triton.Config]:
    """Drop tiles wider than the matrices and, for plain weights, tiles whose pipeline buffers would exceed
    the shared memory one block may use (the 128 x 128 x 3-stage up-projection tile at ``BLOCK_M`` 64, and
    more in fp32); small matrices (tests, tiny models) take the first config. Quantized codes (1 or ½ byte)
    fit at every config."""
    n, k = nargs["N"], nargs["K"]
    if n <= 64 and k <= 64:
        return configs[:1]
    fit = [c for c in configs if c.kwargs["BLOCK_N"] <= max(64, n) and c.kwargs["BLOCK_K"] <= max(64, k)]
    if meta["FMT"] == PLAIN:
        itemsize = nargs["w_ptr"].dtype.itemsize
        fit = [c for c in fit if pipelined_bytes(c, meta["BLOCK_M"], itemsize, weight_tiles) <= SHARED_MEMORY_PER_BLOCK]
    return fit or configs[:1]


@triton.autotune(configs=_configs(), key=["N", "K", "BLOCK_M", "FMT"],
                 prune_configs_by={"early_config_prune": functools.partial(_prune, weight_tiles=2)})
@triton.jit
def _up_kernel(
    x_ptr, w_ptr, s_ptr, act_ptr, pairs_ptr, block_expert_ptr,
    E, N, K, TOPK, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_a, limit,
    HAS_LIMIT: tl.constexpr, FMT: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr, UE8M0: tl.constexpr,
    DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    m_ok = pair >= 0
    tok = tl.where(m_ok, pair // TOPK, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + tok[:, None] * stride_x + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0).to(DOT)
        acc_g = weight_dot(acc_g, a, w_base, s_base, n, n_ok, k0, K, stride_wn, stride_sn,
                           FMT, BN_W, BK_W, UE8M0, DOT, PREC, BLOCK_N, BLOCK_K)
        acc_u = weight_dot(acc_u, a, w_base, s_base, N + n, n_ok, k0, K, stride_wn, stride_sn,
                           FMT, BN_W, BK_W, UE8M0, DOT, PREC, BLOCK_N, BLOCK_K)
    if HAS_LIMIT:
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(act_ptr + offs_m[:, None] * stride_a + n[None, :], act.to(act_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.autotune(configs=_configs(), key=["N", "K", "BLOCK_M", "FMT"],
                 prune_configs_by={"early_config_prune": functools.partial(_prune, weight_tiles=1)})
@triton.jit
def _down_kernel(
    act_ptr, w_ptr, s_ptr, y_ptr, pairs_ptr, block_expert_ptr, weights_ptr,
    E, N, K, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    FMT: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr, UE8M0: tl.constexpr,
    DOT: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= E:
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    m_ok = pair >= 0
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = s_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + offs_m[:, None] * stride_a + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0).to(DOT)
        acc = weight_dot(acc, a, w_base, s_base, n, n_ok, k0, K, stride_wn, stride_sn,
                         FMT, BN_W, BK_W, UE8M0, DOT, PREC, BLOCK_N, BLOCK_K)
    wt = tl.load(weights_ptr + pair, mask=m_ok, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    dst = tl.where(m_ok, pair, 0)
    tl.store(y_ptr + dst[:, None] * stride_y + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_kernel(y_ptr, ids_ptr, out_ptr, E, D, TOPK, stride_y, stride_o, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(0, TOPK):
        pair = t * TOPK + s
        e = tl.load(ids_ptr + pair)
        # foreign or -1 slots add nothing: their columns limit is 0
        cols = tl.where((e >= 0) & (e < E), D, 0)
        acc += tl.load(y_ptr + pair * stride_y + d, mask=d < cols, other=0.0)
    tl.store(out_ptr + t * stride_o + d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def block_m_for(pairs: int, experts: int, invariant: bool = False) -> int:
    """Rows per tile: small tiles when each expert gets few rows (decode), larger ones for prefill; one
    height (32) whatever the batch in batch-invariant mode."""
    if interpreting():
        return 8
    if invariant:
        return 32
    per_expert = pairs / max(1, min(experts, pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def sum_tiles(dim: int) -> Tiles:
    """Up to 1024 channels of a token's pair rows per program."""
    block_d = min(next_power_of_2(dim), choose(1024, 32))
    return Tiles({"BLOCK_D": block_d}, num_warps=num_warps_for(block_d))


def align_by_expert(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pairs, block_expert)``: pair indices ``t·k + slot`` grouped by expert, each group padded
    with ``-1`` to a multiple of ``block_m``, and the expert of every ``block_m`` tile (``experts``
    for tiles past the end). Sized for the worst case, so no value is read back to the host."""
    flat = ids.reshape(-1).to(torch.int64)
    n_pairs = flat.numel()
    dev = flat.device
    valid = (flat >= 0) & (flat < experts)
    key = torch.where(valid, flat, torch.full_like(flat, experts))
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[experts] = 0
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(key, stable=True).indices
    skey = key[order]
    rank = torch.arange(n_pairs, device=dev) - cnt_start[skey]
    capacity = triton.cdiv(n_pairs + min(experts, n_pairs) * (block_m - 1), block_m) * block_m
    dest = torch.where(skey < experts, pad_start[skey] + rank, torch.full_like(rank, capacity))
    pairs = torch.full((capacity + 1,), -1, dtype=torch.int64, device=dev)
    pairs[dest] = order
    tile_starts = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end[:experts].contiguous(), tile_starts, right=True)
    return pairs[:capacity], block_expert.to(torch.int32)


def _strides(t: torch.Tensor) -> tuple[int, int]:
    """(expert, row) strides of a stacked ``[E, rows, cols]`` tensor."""
    return t.stride(0), t.stride(1)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor | QuantizedWeight,
    w2: torch.Tensor | QuantizedWeight,
    limit: float | None,
    invariant: bool = False,
) -> torch.Tensor:
    """``Kernels.moe_experts`` (plain weights) or ``moe_experts_quantized`` (``QuantizedWeight`` stacks)
    on the device, for ``T >= 1`` tokens and ``k >= 1`` slots; ``invariant``: batch-invariant mode."""
    up, down = WeightOperand.of(w13), WeightOperand.of(w2)
    if x.dim() != 2 or topk_ids.dim() != 2 or len(up.shape) != 3 or len(down.shape) != 3:
        raise ValueError(
            f"moe_experts: need x [T, D], topk_ids [T, k], w13 [E, 2I, D], w2 [E, D, I]; got {tuple(x.shape)}, "
            f"{tuple(topk_ids.shape)}, {up.shape}, {down.shape}"
        )
    tokens, dim = x.shape
    experts, two_i, _ = up.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"moe_experts: topk_ids and topk_weights must both be [{tokens}, k], got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if up.shape != (experts, 2 * inter, dim) or down.shape != (experts, dim, inter):
        raise ValueError(
            f"moe_experts: for x [T, {dim}] need w13 [E, 2I, {dim}] and w2 [E, {dim}, I]; got {up.shape} and {down.shape}"
        )
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.contiguous()
    dev = x.device
    block_m = block_m_for(tokens * top_k, experts, invariant)
    pairs, block_expert = align_by_expert(ids, experts, block_m)
    tiles = block_expert.numel()
    dot, prec = dot_operands(x.dtype)
    act = torch.empty(pairs.numel(), inter, dtype=x.dtype, device=dev)
    _up_kernel[lambda meta: (tiles, triton.cdiv(inter, meta["BLOCK_N"]))](
        x, up.data, up.scales, act, pairs, block_expert,
        experts, inter, dim, top_k, x.stride(0), *_strides(up.data), *_strides(up.scales), act.stride(0),
        0.0 if limit is None else float(limit),
        HAS_LIMIT=limit is not None, **up.constants(), DOT=dot, PREC=prec, BLOCK_M=block_m,
    )
    y = torch.empty(tokens * top_k, dim, dtype=torch.float32, device=dev)
    _down_kernel[lambda meta: (tiles, triton.cdiv(dim, meta["BLOCK_N"]))](
        act, down.data, down.scales, y, pairs, block_expert, weights,
        experts, dim, inter, act.stride(0), *_strides(down.data), *_strides(down.scales), y.stride(0),
        **down.constants(), DOT=dot, PREC=prec, BLOCK_M=block_m,
    )
    out = torch.empty(tokens, dim, dtype=x.dtype, device=dev)
    tiles = sum_tiles(dim)
    _sum_kernel[(tokens, triton.cdiv(dim, tiles.blocks["BLOCK_D"]))](
        y, ids, out, experts, dim, top_k, y.stride(0), out.stride(0), **tiles.kwargs(),
    )
    return out

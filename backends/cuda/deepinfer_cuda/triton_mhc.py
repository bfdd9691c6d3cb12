"""Manifold-constrained hyper-connections (mHC): the mixing weights, Sinkhorn, collapse and expansion.

``mhc_pre`` and ``mhc_head`` run as two kernels:

1. ``_mix_kernel``: a tile of tokens × a slice of the flattened streams
   ``n·D``; one pass over ``x`` accumulates both ``x @ fnᵀ`` (``tl.dot``) and
   the sum of squares for the RMS norm, which factors out of the product as a
   per-token scalar. When there are few tokens (decode) the ``n·D`` reduction
   is cut into slices run by separate programs; their partial sums go to a
   small fp32 buffer.
2. ``_finish_kernel``: sums the slices, applies the norm and the sigmoid to
   get ``pre`` (every channel block recomputes these few values rather than
   reloading them) and collapses the streams ``Σ_j pre_j · x_j`` for its block
   of channels; the first channel block also computes ``post`` and runs the
   softmax and Sinkhorn iterations on each token's ``n × n`` matrix in
   registers, and stores both.

``mhc_mix`` (V4.1, whose sites collapse with the previous site's ``pre``) is
the same two kernels with ``COLLAPSE`` off: one channel block that stores
``pre`` beside ``post`` and ``comb``. ``mhc_collapse`` is ``_collapse_kernel``,
the finishing kernel's collapse (``_collapse_tile``) with ``pre`` loaded
instead of computed.

``mhc_post`` is one elementwise-and-small-matmul kernel over ``[T, n, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, interpreting, next_power_of_2, num_warps_for, unit_inner
from .triton_common import programs_target, split_count


@triton.jit
def _mix_kernel(
    x_ptr, fn_ptr, part_ptr, sq_ptr, T, KD, NU, SLICE, stride_x, stride_f,
    PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tb = tl.program_id(0)
    sl = tl.program_id(1)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    u = tl.arange(0, BLOCK_U)
    u_ok = u < NU
    acc = tl.zeros([BLOCK_T, BLOCK_U], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    start = sl * SLICE
    end = tl.minimum(start + SLICE, KD)
    for k0 in range(start, end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < end
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0
        ).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
        f = tl.load(fn_ptr + u[None, :] * stride_f + kk[:, None], mask=u_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)
        acc = tl.dot(x, f, acc, input_precision=PREC)
    base = (sl * T + rows).to(tl.int64)
    tl.store(part_ptr + base[:, None] * BLOCK_U + u[None, :], acc, mask=r_ok[:, None])
    tl.store(sq_ptr + base, sq, mask=r_ok)


@triton.jit
def _mix_logits(part_ptr, rows, r_ok, cols, col_ok, T, S, BLOCK_U: tl.constexpr):
    """Sum over slices (at least one) of the partial ``x @ fnᵀ`` at ``cols``, broadcast against ``rows``."""
    mask = r_ok & col_ok
    total = tl.load(part_ptr + rows.to(tl.int64) * BLOCK_U + cols, mask=mask, other=0.0)
    for s in range(1, S):
        base = (s * T + rows).to(tl.int64)
        total += tl.load(part_ptr + base * BLOCK_U + cols, mask=mask, other=0.0)
    return total


@triton.jit
def _collapse_tile(x_ptr, out_ptr, pre, rows, r_ok, j, j_ok, d, D, stride_xt, stride_xn, stride_ot):
    """``out[rows, d] = Σ_j pre[rows, j] · x[rows, j, d]`` in fp32, stored in ``out``'s dtype (``pre`` is 0 at padding streams)."""
    d_ok = d < D
    x = tl.load(
        x_ptr + rows[:, None, None].to(tl.int64) * stride_xt + j[None, :, None] * stride_xn + d[None, None, :],
        mask=r_ok[:, None, None] & j_ok[None, :, None] & d_ok[None, None, :], other=0.0,
    ).to(tl.float32)
    out = tl.sum(pre[:, :, None] * x, axis=1)
    o_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_ot + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def _finish_kernel(
    x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, out_ptr, pre_ptr, post_ptr, comb_ptr,
    T, NS, D, S, ITERS, norm_eps, hc_eps, stride_xt, stride_xn, stride_ot,
    HEAD: tl.constexpr, COLLAPSE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_U: tl.constexpr,
):
    tb = tl.program_id(0)
    db = tl.program_id(1)
    rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    sq = tl.zeros([BLOCK_T], tl.float32)
    for s in range(0, S):
        sq += tl.load(sq_ptr + (s * T + rows).to(tl.int64), mask=r_ok, other=0.0)
    inv = 1.0 / tl.sqrt(sq / (NS * D) + norm_eps)
    j = tl.arange(0, BLOCK_S)
    j_ok = j < NS
    r2 = rows[:, None]
    ok2 = r_ok[:, None]
    u_pre = _mix_logits(part_ptr, r2, ok2, j[None, :], j_ok[None, :], T, S, BLOCK_U) * inv[:, None]
    s0 = tl.load(scale_ptr).to(tl.float32)
    pre = tl.sigmoid(u_pre * s0 + tl.load(base_ptr + j, mask=j_ok, other=0.0)[None, :]) + hc_eps
    pre = tl.where(j_ok[None, :], pre, 0.0)
    if not HEAD:
        if db == 0:
            s1 = tl.load(scale_ptr + 1).to(tl.float32)
            s2 = tl.load(scale_ptr + 2).to(tl.float32)
            u_post = _mix_logits(part_ptr, r2, ok2, NS + j[None, :], j_ok[None, :], T, S, BLOCK_U) * inv[:, None]
            post = 2.0 * tl.sigmoid(u_post * s1 + tl.load(base_ptr + NS + j, mask=j_ok, other=0.0)[None, :])
            tl.store(post_ptr + r2.to(tl.int64) * NS + j[None, :], post, mask=ok2 & j_ok[None, :])
            if not COLLAPSE:
                tl.store(pre_ptr + r2.to(tl.int64) * NS + j[None, :], pre, mask=ok2 & j_ok[None, :])
            # comb[t, j, k] from column 2n + j·n + k
            r3 = rows[:, None, None]
            ok3 = r_ok[:, None, None]
            cell = j[None, :, None] * NS + j[None, None, :]
            cell_ok = j_ok[None, :, None] & j_ok[None, None, :]
            z = _mix_logits(part_ptr, r3, ok3, 2 * NS + cell, cell_ok, T, S, BLOCK_U) * inv[:, None, None]
            z = z * s2 + tl.load(base_ptr + 2 * NS + cell, mask=cell_ok, other=0.0)
            # softmax over k; padding cells (j or k >= n) stay exactly 0 through every normalisation
            z_max = tl.max(tl.where(cell_ok, z, float("-inf")), axis=2)
            z = tl.where(cell_ok, tl.exp(z - tl.where(z_max == float("-inf"), 0.0, z_max)[:, :, None]), 0.0)
            z_sum = tl.sum(z, axis=2)
            comb = tl.where(cell_ok, z / tl.where(z_sum > 0, z_sum, 1.0)[:, :, None] + hc_eps, 0.0)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
            for _ in range(1, ITERS):
                comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
                comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
            tl.store(comb_ptr + r3.to(tl.int64) * (NS * NS) + cell, comb, mask=ok3 & cell_ok)
    if COLLAPSE:
        d = db * BLOCK_D + tl.arange(0, BLOCK_D)
        _collapse_tile(x_ptr, out_ptr, pre, rows, r_ok, j, j_ok, d, D, stride_xt, stride_xn, stride_ot)


@triton.jit
def _collapse_kernel(
    x_ptr, pre_ptr, out_ptr, T, NS, D, stride_xt, stride_xn, stride_pt, stride_ot,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    j = tl.arange(0, BLOCK_S)
    j_ok = j < NS
    pre = tl.load(
        pre_ptr + rows[:, None].to(tl.int64) * stride_pt + j[None, :], mask=r_ok[:, None] & j_ok[None, :], other=0.0
    ).to(tl.float32)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    _collapse_tile(x_ptr, out_ptr, pre, rows, r_ok, j, j_ok, d, D, stride_xt, stride_xn, stride_ot)


@triton.jit
def _post_kernel(
    y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, NS, D,
    stride_yt, stride_xt, stride_xn, stride_pt, stride_ct, stride_cj, stride_ot, stride_on,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    j = tl.arange(0, BLOCK_S)
    j_ok = j < NS
    d = db * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    y = tl.load(y_ptr + t * stride_yt + d, mask=d_ok, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + t * stride_xt + j[:, None] * stride_xn + d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * stride_pt + j, mask=j_ok, other=0.0).to(tl.float32)
    comb = tl.load(
        comb_ptr + t * stride_ct + j[:, None] * stride_cj + j[None, :], mask=j_ok[:, None] & j_ok[None, :], other=0.0
    ).to(tl.float32)
    # out[k] = post[k] · y + Σ_j comb[j, k] · x[j]
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)
    out = post[:, None] * y[None, :] + mixed
    tl.store(
        out_ptr + t * stride_ot + j[:, None] * stride_on + d[None, :], out.to(out_ptr.dtype.element_ty),
        mask=j_ok[:, None] & d_ok[None, :],
    )


def _streams(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, n, D]`` with rows of ``n·D`` contiguous values (what the mixing matmul reads)."""
    if x.dim() != 3:
        raise ValueError(f"mhc: x must be [T, n, D], got shape {tuple(x.shape)}")
    return x if x.is_contiguous() else x.contiguous()


def mix_tiles(n: int, head: bool) -> Tiles:
    """Tiles of 16 tokens × every mixing column (``n`` for the head, ``(2 + n)·n`` otherwise) × 64 of the ``n·D`` inputs."""
    nu = n if head else (2 + n) * n
    return Tiles({"BLOCK_T": choose(16, 8), "BLOCK_U": max(next_power_of_2(nu), choose(16, 1)), "BLOCK_K": choose(64, 32)},
                 num_warps=choose(4, 1))


def mix_slices(tokens: int, n: int, dim: int, target: int) -> tuple[int, int]:
    """``(splits, slice_len)``: the ``n·D`` reduction cut into slices when token tiles fall short of ``target`` programs."""
    blocks = mix_tiles(n, True).blocks
    kd, block_k = n * dim, blocks["BLOCK_K"]
    splits = split_count(triton.cdiv(tokens, blocks["BLOCK_T"]), kd, 4 * block_k, target)
    slice_len = triton.cdiv(triton.cdiv(kd, splits), block_k) * block_k
    return triton.cdiv(kd, slice_len), slice_len


def mix_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision of the mixing matmul: the streams are rounded to ``dtype`` already, and tf32
    products round ``fn`` to 10 mantissa bits, within 16-bit tolerances; fp32 streams take exact products."""
    return "ieee" if dtype == torch.float32 or interpreting() else "tf32"


def collapse_tiles(n: int, dim: int) -> Tiles:
    """The mixing kernel's token tile, all ``n`` streams, and channels for about 4096 values of ``x`` a program."""
    block_t, block_s = mix_tiles(n, True).blocks["BLOCK_T"], next_power_of_2(n)
    block_d = min(next_power_of_2(dim), choose(max(64, 4096 // (block_t * block_s)), 32))
    return Tiles({"BLOCK_T": block_t, "BLOCK_S": block_s, "BLOCK_D": block_d}, num_warps=num_warps_for(block_t * block_s * block_d))


def finish_tiles(n: int, dim: int, head: bool, collapse: bool = True) -> Tiles:
    """``collapse_tiles`` plus the mixing kernel's columns; without the collapse (``mhc_mix``) one channel
    block of one channel (unused) and warps for the ``n × n`` Sinkhorn matrices."""
    tiles = collapse_tiles(n, dim)
    blocks = {**tiles.blocks, "BLOCK_U": mix_tiles(n, head).blocks["BLOCK_U"]}
    if collapse:
        return Tiles(blocks, num_warps=tiles.num_warps)
    return Tiles({**blocks, "BLOCK_D": 1}, num_warps=num_warps_for(blocks["BLOCK_T"] * blocks["BLOCK_S"] ** 2))


def post_tiles(n: int, dim: int) -> Tiles:
    """One token's ``n`` streams × a block of channels (about 2048 values of ``x``)."""
    block_s = next_power_of_2(n)
    block_d = min(next_power_of_2(dim), choose(max(128, 2048 // block_s), 32))
    return Tiles({"BLOCK_S": block_s, "BLOCK_D": block_d}, num_warps=num_warps_for(block_s * block_s * block_d // 2))


@dataclass
class Mixed:
    """What the two mixing kernels return: the collapse, or ``pre``, and for a site (not the head) ``post``, ``comb``."""

    out: torch.Tensor | None
    pre: torch.Tensor | None
    post: torch.Tensor | None
    comb: torch.Tensor | None


def _mix_and_finish(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_eps: float, hc_eps: float, iters: int, head: bool, collapse: bool = True, invariant: bool = False,
) -> Mixed:
    """The mixing matmul, then the finishing kernel: collapsing with the site's own ``pre`` (``collapse``) or storing it."""
    tokens, n, dim = x.shape
    nu = n if head else (2 + n) * n
    if tuple(fn.shape) != (nu, n * dim) or tuple(base.shape) != (nu,) or scale.numel() != (1 if head else 3):
        raise ValueError(
            f"mhc: for x {tuple(x.shape)} need fn [{nu}, {n * dim}], base [{nu}] and scale [{1 if head else 3}]; "
            f"got {tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}"
        )
    dev = x.device
    fn = fn if fn.stride(-1) == 1 else fn.contiguous()
    base = base.to(torch.float32).contiguous()
    scale = scale.to(torch.float32).contiguous()
    kd = n * dim
    mix = mix_tiles(n, head)
    token_blocks = triton.cdiv(tokens, mix.blocks["BLOCK_T"])
    splits, slice_len = mix_slices(tokens, n, dim, programs_target(dev, invariant))
    part = torch.empty(splits, tokens, mix.blocks["BLOCK_U"], dtype=torch.float32, device=dev)
    sq = torch.empty(splits, tokens, dtype=torch.float32, device=dev)
    _mix_kernel[(token_blocks, splits)](
        x, fn, part, sq, tokens, kd, nu, slice_len, kd, fn.stride(0), PREC=mix_precision(x.dtype), **mix.kwargs(),
    )
    f32 = dict(dtype=torch.float32, device=dev)
    got = Mixed(
        out=torch.empty(tokens, dim, dtype=x.dtype, device=dev) if collapse else None,
        pre=None if collapse else torch.empty(tokens, n, **f32),
        post=None if head else torch.empty(tokens, n, **f32),
        comb=None if head else torch.empty(tokens, n, n, **f32),
    )
    finish = finish_tiles(n, dim, head, collapse)
    # outputs a launch does not write are given as some other tensor of the launch (never touched)
    out = got.out if got.out is not None else part
    _finish_kernel[(token_blocks, triton.cdiv(dim, finish.blocks["BLOCK_D"]) if collapse else 1)](
        x, part, sq, base, scale, out, part if got.pre is None else got.pre, part if got.post is None else got.post,
        part if got.comb is None else got.comb, tokens, n, dim, splits, int(iters), float(norm_eps), float(hc_eps),
        x.stride(0), x.stride(1), out.stride(0), HEAD=head, COLLAPSE=collapse, **finish.kwargs(),
    )
    return got


def mhc_pre(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_eps: float, hc_eps: float, sinkhorn_iters: int, invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Kernels.mhc_pre`` on the device for ``T >= 1`` tokens: the collapse fused into the finishing kernel."""
    got = _mix_and_finish(_streams(x), fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head=False, invariant=invariant)
    assert got.out is not None and got.post is not None and got.comb is not None
    return got.out, got.post, got.comb


def mhc_mix(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_eps: float, hc_eps: float, sinkhorn_iters: int, invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Kernels.mhc_mix`` on the device for ``T >= 1`` tokens: ``mhc_pre``'s kernels with the collapse off."""
    got = _mix_and_finish(_streams(x), fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head=False, collapse=False,
                          invariant=invariant)
    assert got.pre is not None and got.post is not None and got.comb is not None
    return got.pre, got.post, got.comb


def mhc_head(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float,
    invariant: bool = False,
) -> torch.Tensor:
    """``Kernels.mhc_head`` on the device for ``T >= 1`` tokens."""
    got = _mix_and_finish(_streams(x), fn, base, scale, norm_eps, hc_eps, 0, head=True, invariant=invariant)
    assert got.out is not None
    return got.out


def mhc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``Kernels.mhc_collapse`` on the device for ``T >= 1`` tokens."""
    if x.dim() != 3 or tuple(pre.shape) != tuple(x.shape[:2]):
        raise ValueError(f"mhc_collapse: need x [T, n, D] and pre [T, n], got {tuple(x.shape)} and {tuple(pre.shape)}")
    tokens, n, dim = x.shape
    x, pre = unit_inner(x), unit_inner(pre)
    out = torch.empty(tokens, dim, dtype=x.dtype, device=x.device)
    tiles = collapse_tiles(n, dim)
    grid = (triton.cdiv(tokens, tiles.blocks["BLOCK_T"]), triton.cdiv(dim, tiles.blocks["BLOCK_D"]))
    _collapse_kernel[grid](
        x, pre, out, tokens, n, dim, x.stride(0), x.stride(1), pre.stride(0), out.stride(0), **tiles.kwargs(),
    )
    return out


def mhc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``Kernels.mhc_post`` on the device for ``T >= 1`` tokens."""
    if x.dim() != 3:
        raise ValueError(f"mhc_post: x must be [T, n, D], got shape {tuple(x.shape)}")
    tokens, n, dim = x.shape
    if tuple(y.shape) != (tokens, dim) or tuple(post.shape) != (tokens, n) or tuple(comb.shape) != (tokens, n, n):
        raise ValueError(
            f"mhc_post: for x {tuple(x.shape)} need y [{tokens}, {dim}], post [{tokens}, {n}], comb [{tokens}, {n}, {n}]; "
            f"got {tuple(y.shape)}, {tuple(post.shape)}, {tuple(comb.shape)}"
        )
    y = y if y.stride(-1) == 1 else y.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    post = post if post.stride(-1) == 1 else post.contiguous()
    comb = comb if comb.stride(-1) == 1 else comb.contiguous()
    out = torch.empty(tokens, n, dim, dtype=x.dtype, device=x.device)
    tiles = post_tiles(n, dim)
    _post_kernel[(tokens, triton.cdiv(dim, tiles.blocks["BLOCK_D"]))](
        y, x, post, comb, out, n, dim,
        y.stride(0), x.stride(0), x.stride(1), post.stride(0), comb.stride(0), comb.stride(1), out.stride(0), out.stride(1),
        **tiles.kwargs(),
    )
    return out

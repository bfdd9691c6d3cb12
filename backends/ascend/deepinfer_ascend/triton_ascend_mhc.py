"""mHC hyper-connection pre/post (and the final head collapse) as Triton-Ascend kernels.

``mhc_pre`` splits in two: the mixing matmul ``flatten(x) @ fnᵀ`` runs as one
fp32 torch matmul over all tokens (the cube unit on an NPU; one pass over
``fn`` instead of one per token), and the kernel does the rest per token: the
RMS factor, the sigmoid gates, the softmax and Sinkhorn normalisation of the
``n × n`` mixing matrix in registers, and the collapse ``Σ_j pre_j · x_j``.
``mhc_post`` is one kernel per (token, channel-block) tile. Both use a 1-D grid
of one program per vector core, fp32 math, and no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import block, interpreting, next_power_of_2, program_count


@triton.jit
def _mhc_pre_kernel(
    x_ptr, mix_ptr, base_ptr, scale_ptr, collapsed_ptr, post_ptr, comb_ptr,
    T, N, D, ITERS,
    stride_xt, stride_mt, stride_ct, stride_pt, stride_bt,
    norm_eps, hc_eps,
    HEAD: tl.constexpr, NUM_PROGRAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_j = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_N)
    j_ok = offs_j < N
    k_ok = offs_k < N
    pair_ok = j_ok[:, None] & k_ok[None, :]
    for t in range(pid, T, NUM_PROGRAMS):
        t64 = tl.cast(t, tl.int64)
        x_row = x_ptr + t64 * stride_xt
        # RMS over the flattened streams
        sq = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            xb = tl.load(x_row + offs_j[:, None] * D + offs_d[None, :], mask=j_ok[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
            sq += xb * xb
        rms = 1.0 / tl.sqrt(tl.sum(tl.sum(sq, axis=1), axis=0) / (N * D) + norm_eps)
        mix_row = mix_ptr + t64 * stride_mt
        s0 = tl.load(scale_ptr).to(tl.float32)
        u_pre = tl.load(mix_row + offs_j, mask=j_ok, other=0.0).to(tl.float32) * rms
        b_pre = tl.load(base_ptr + offs_j, mask=j_ok, other=0.0).to(tl.float32)
        pre = tl.where(j_ok, tl.sigmoid(u_pre * s0 + b_pre) + hc_eps, 0.0)
        if not HEAD:
            s1 = tl.load(scale_ptr + 1).to(tl.float32)
            s2 = tl.load(scale_ptr + 2).to(tl.float32)
            u_post = tl.load(mix_row + N + offs_j, mask=j_ok, other=0.0).to(tl.float32) * rms
            b_post = tl.load(base_ptr + N + offs_j, mask=j_ok, other=0.0).to(tl.float32)
            post = 2.0 * tl.sigmoid(u_post * s1 + b_post)
            tl.store(post_ptr + t64 * stride_pt + offs_j, post, mask=j_ok)
            pair = 2 * N + offs_j[:, None] * N + offs_k[None, :]
            u_comb = tl.load(mix_row + pair, mask=pair_ok, other=0.0).to(tl.float32) * rms
            b_comb = tl.load(base_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)
            logits = tl.where(k_ok[None, :], u_comb * s2 + b_comb, float("-inf"))
            logits = logits - tl.max(logits, axis=1)[:, None]
            e = tl.exp(logits)
            comb = tl.where(pair_ok, e / tl.sum(e, axis=1)[:, None] + hc_eps, 0.0)
            # Sinkhorn: columns (sum over j) first, then rows and columns ITERS-1 times
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
            for _ in range(ITERS - 1):
                comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
                comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
            tl.store(comb_ptr + t64 * stride_bt + offs_j[:, None] * N + offs_k[None, :], comb, mask=pair_ok)
        # collapse: Σ_j pre_j · x_j
        out_row = collapsed_ptr + t64 * stride_ct
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_ok = offs_d < D
            xb = tl.load(x_row + offs_j[:, None] * D + offs_d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            y = tl.sum(pre[:, None] * xb, axis=0)
            tl.store(out_row + offs_d, y.to(collapsed_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _mhc_post_kernel(
    y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr,
    T, N, D,
    stride_yt, stride_xt, stride_pt, stride_ct, stride_ot,
    NUM_PROGRAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_j = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_N)
    j_ok = offs_j < N
    k_ok = offs_k < N
    d_blocks = tl.cdiv(D, BLOCK_D)
    for tile in range(pid, T * d_blocks, NUM_PROGRAMS):
        t = tl.cast(tile // d_blocks, tl.int64)
        offs_d = (tile % d_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        comb = tl.load(comb_ptr + t * stride_ct + offs_j[:, None] * N + offs_k[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        post = tl.load(post_ptr + t * stride_pt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + t * stride_yt + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + t * stride_xt + offs_j[:, None] * D + offs_d[None, :], mask=j_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [k, d]
        out = post[:, None] * y[None, :] + mixed
        tl.store(
            out_ptr + t * stride_ot + offs_k[:, None] * D + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=k_ok[:, None] & d_ok[None, :],
        )


def _mix(x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """``flatten(x) @ fnᵀ`` in fp32 for every token at once (the RMS factor is applied in the kernel)."""
    return x.reshape(x.shape[0], -1).float() @ fn.float().t()


def _launch_pre(x, fn, base, scale, norm_eps, hc_eps, iters, head):
    t, n, d = x.shape
    x = x.contiguous()
    mix = _mix(x, fn).contiguous()
    base = base.float().contiguous()
    scale = scale.float().contiguous()
    collapsed = torch.empty(t, d, dtype=x.dtype, device=x.device)
    post = torch.empty(t, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    programs = program_count(x.device)
    block_n = next_power_of_2(n)
    _mhc_pre_kernel[(programs,)](
        x, mix, base, scale, collapsed, post, comb,
        t, n, d, int(iters),
        x.stride(0), mix.stride(0), collapsed.stride(0), post.stride(0), comb.stride(0),
        float(norm_eps), float(hc_eps),
        HEAD=head,
        NUM_PROGRAMS=programs,
        BLOCK_N=block_n,
        BLOCK_D=block(d, 8 if interpreting() else max(16, 2048 // block_n)),
    )
    return collapsed, post, comb


def mhc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Kernels.mhc_pre`` for fp32/fp16/bf16 ``x`` with at least one token."""
    return _launch_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head=False)


def mhc_head(x, fn, base, scale, norm_eps, hc_eps) -> torch.Tensor:
    """``Kernels.mhc_head`` for fp32/fp16/bf16 ``x`` with at least one token."""
    return _launch_pre(x, fn, base, scale, norm_eps, hc_eps, 1, head=True)[0]


def mhc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``Kernels.mhc_post`` for fp32/fp16/bf16 ``x`` with at least one token."""
    t, n, d = x.shape
    x = x.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    post = post.contiguous()
    comb = comb.contiguous()
    out = torch.empty(t, n, d, dtype=x.dtype, device=x.device)
    programs = program_count(x.device)
    block_n = next_power_of_2(n)
    _mhc_post_kernel[(programs,)](
        y, x, post, comb, out,
        t, n, d,
        y.stride(0), x.stride(0), post.stride(0), comb.stride(0), out.stride(0),
        NUM_PROGRAMS=programs,
        BLOCK_N=block_n,
        BLOCK_D=block(d, 8 if interpreting() else max(16, 4096 // (block_n * block_n))),
    )
    return out

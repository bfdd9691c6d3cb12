"""mHC hyper-connection pre/post (and the final head collapse) as Triton-Ascend kernels.

``mhc_pre`` splits in two: the mixing matmul ``flatten(x) @ fnᵀ`` runs as one
fp32 torch matmul over all tokens (the cube unit on an NPU; one pass over
``fn`` instead of one per token), and the kernel does the rest per token: the
RMS factor, the sigmoid gates, the softmax and Sinkhorn normalisation of the
``n × n`` mixing matrix, and the collapse ``Σ_j pre_j · x_j``. ``mhc_mix``
(V4.1, whose sites collapse with the previous site's ``pre``) is that kernel
with ``COLLAPSE`` off: it stores ``pre`` instead. ``mhc_collapse`` and
``mhc_post`` are one kernel per (token, channel-block) tile; the collapse of a
channel block (``_collapse_block``) is one helper that ``mhc_pre``'s kernel and
``mhc_collapse``'s share. All use a 1-D grid of one program per vector core,
fp32 math, and no atomics.

Written around reported triton-ascend miscompiles (github.com/triton-lang/triton-ascend):

- #2291: ``tl.sum(acc, 0)`` over a 3-D tile reduces the wrong axis on 910B
  (silently; reshaping first does not help). ``mhc_post`` used to reduce
  ``comb[:, :, None] · x[:, None, :]`` over its leading axis; it now adds one
  rank-1 update ``comb[j, :]ᵀ · x_j`` per input stream to a 2-D ``[k, d]`` tile,
  with no reduction at all. Nothing here builds a 3-D tile.
- #2247: 2-D reductions whose inner extent is below 8 drop lanes on Ascend 950.
  The ``n × n`` Sinkhorn matrix (n = 4) is padded to ``REDUCE_MIN`` (16) per
  axis with zeros, and held twice, as ``A[j, k]`` and its transpose ``B[k, j]``,
  so both its row sums (over k, of A) and its column sums (over j, of B) are
  last-axis reductions; each sum updates both copies, which stay exact
  transposes. The RMS sum and the collapse use 1-D vectors of at least 16.

Block sizes come from the UB budget of the SoC generation (``plan_mhc_pre``,
``plan_mhc_collapse``, ``plan_mhc_post``; see ``launch.fit_blocks``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (
    REDUCE_MIN, Tile, TilePlan, UnifiedBuffer, block, fit_blocks, interpreting, next_power_of_2, program_count,
    require_fit, unified_buffer,
)

#: widest 1-D block of the RMS pass and of the collapse (more buys nothing at V4's hidden 4096)
BLOCK_CAP = 4096

#: blocks a loop over one row takes under the interpreter, whose cost is per operation
INTERPRETER_STEPS = 4


def interpreter_block(n: int, cap: int, floor: int = REDUCE_MIN) -> int:
    """The block a launch under the interpreter walks ``n`` elements in: about ``INTERPRETER_STEPS`` of them, so
    small shapes still cross blocks and V4.1's 5120-wide rows take a few steps, not hundreds."""
    return block(-(-n // INTERPRETER_STEPS), cap, floor)


def channel_block(d: int, cap: int) -> int:
    """The power-of-two channel block, ``REDUCE_MIN`` to ``cap``, that pads ``d`` least (the widest of equals):
    5120 channels take 1024 (five full blocks) rather than 4096 (two blocks, 37.5% padding)."""
    sizes = [1 << e for e in range(REDUCE_MIN.bit_length() - 1, cap.bit_length())]
    return min(sizes, key=lambda b: (-(-d // b) * b, -b))



@triton.jit
def _total(v):
    """The sum of a 1-D vector (its only axis is its last)."""
    return tl.sum(v, axis=0)


@triton.jit
def _collapse_block(x_row, out_row, pre, offs_g, N, D, d0, BLOCK_D: tl.constexpr):
    """``out[d] = Σ_j pre_j · x_j[d]`` over one channel block, one stream at a time (``pre_j`` picked out of
    the zero-padded gate vector ``pre``, so no reduction but the 1-D pick)."""
    offs_d = d0 + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    y = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(N):
        pre_j = _total(tl.where(offs_g == j, pre, 0.0))
        xj = tl.load(x_row + j * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        y += pre_j * xj
    tl.store(out_row + offs_d, y.to(out_row.dtype.element_ty), mask=d_ok)


@triton.jit
def _mhc_pre_kernel(
    x_ptr, mix_ptr, base_ptr, scale_ptr, collapsed_ptr, pre_ptr, post_ptr, comb_ptr,
    T, N, D, ITERS,
    stride_xt, stride_mt, stride_ct, stride_gt, stride_pt, stride_bt,
    norm_eps, hc_eps,
    HEAD: tl.constexpr, COLLAPSE: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    g_ok = offs_g < N
    pair_ok = g_ok[:, None] & g_ok[None, :]
    F = N * D
    for t in range(pid, T, NUM_PROGRAMS):
        t64 = tl.cast(t, tl.int64)
        x_row = x_ptr + t64 * stride_xt
        # RMS over the flattened streams, in 1-D blocks of the contiguous [n·D] row
        sq = tl.zeros([BLOCK_F], dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            offs_f = f0 + tl.arange(0, BLOCK_F)
            xf = tl.load(x_row + offs_f, mask=offs_f < F, other=0.0).to(tl.float32)
            sq += xf * xf
        rms = 1.0 / tl.sqrt(_total(sq) / F + norm_eps)
        mix_row = mix_ptr + t64 * stride_mt
        s0 = tl.load(scale_ptr).to(tl.float32)
        u_pre = tl.load(mix_row + offs_g, mask=g_ok, other=0.0).to(tl.float32) * rms
        b_pre = tl.load(base_ptr + offs_g, mask=g_ok, other=0.0).to(tl.float32)
        pre = tl.where(g_ok, tl.sigmoid(u_pre * s0 + b_pre) + hc_eps, 0.0)
        if not HEAD:
            s1 = tl.load(scale_ptr + 1).to(tl.float32)
            s2 = tl.load(scale_ptr + 2).to(tl.float32)
            u_post = tl.load(mix_row + N + offs_g, mask=g_ok, other=0.0).to(tl.float32) * rms
            b_post = tl.load(base_ptr + N + offs_g, mask=g_ok, other=0.0).to(tl.float32)
            post = 2.0 * tl.sigmoid(u_post * s1 + b_post)
            tl.store(post_ptr + t64 * stride_pt + offs_g, post, mask=g_ok)
            # the mixing matrix as A[j, k] and as B[k, j] = A[j, k], zero-padded to BLOCK_G × BLOCK_G
            at_a = 2 * N + offs_g[:, None] * N + offs_g[None, :]
            at_b = 2 * N + offs_g[None, :] * N + offs_g[:, None]
            u_a = tl.load(mix_row + at_a, mask=pair_ok, other=0.0).to(tl.float32) * rms
            b_a = tl.load(base_ptr + at_a, mask=pair_ok, other=0.0).to(tl.float32)
            u_b = tl.load(mix_row + at_b, mask=pair_ok, other=0.0).to(tl.float32) * rms
            b_b = tl.load(base_ptr + at_b, mask=pair_ok, other=0.0).to(tl.float32)
            la = tl.where(pair_ok, u_a * s2 + b_a, float("-inf"))
            lb = tl.where(pair_ok, u_b * s2 + b_b, float("-inf"))
            # softmax over k: A's rows; a padded row has max 0 and denominator 1
            top = tl.where(g_ok, tl.max(la, axis=1), 0.0)
            ea = tl.exp(la - top[:, None])
            eb = tl.exp(lb - top[None, :])
            den = tl.where(g_ok, tl.sum(ea, axis=1), 1.0)
            a = tl.where(pair_ok, ea / den[:, None] + hc_eps, 0.0)
            b = tl.where(pair_ok, eb / den[None, :] + hc_eps, 0.0)
            # Sinkhorn: columns (Σ_j, B's rows) first, then rows (Σ_k, A's rows) and columns ITERS-1 times
            col = tl.sum(b, axis=1) + hc_eps
            a = a / col[None, :]
            b = b / col[:, None]
            for _ in range(ITERS - 1):
                row = tl.sum(a, axis=1) + hc_eps
                a = a / row[:, None]
                b = b / row[None, :]
                col = tl.sum(b, axis=1) + hc_eps
                a = a / col[None, :]
                b = b / col[:, None]
            tl.store(comb_ptr + t64 * stride_bt + offs_g[:, None] * N + offs_g[None, :], a, mask=pair_ok)
        if COLLAPSE:
            # the block input: Σ_j pre_j · x_j, channel block by channel block
            out_row = collapsed_ptr + t64 * stride_ct
            for d0 in range(0, D, BLOCK_D):
                _collapse_block(x_row, out_row, pre, offs_g, N, D, d0, BLOCK_D)
        else:
            tl.store(pre_ptr + t64 * stride_gt + offs_g, pre, mask=g_ok)


@triton.jit
def _mhc_collapse_kernel(
    x_ptr, pre_ptr, out_ptr,
    T, N, D,
    stride_xt, stride_gt, stride_ot,
    NUM_PROGRAMS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    d_blocks = tl.cdiv(D, BLOCK_D)
    for tile in range(pid, T * d_blocks, NUM_PROGRAMS):
        t = tl.cast(tile // d_blocks, tl.int64)
        pre = tl.load(pre_ptr + t * stride_gt + offs_g, mask=offs_g < N, other=0.0).to(tl.float32)
        _collapse_block(x_ptr + t * stride_xt, out_ptr + t * stride_ot, pre, offs_g, N, D, (tile % d_blocks) * BLOCK_D, BLOCK_D)


@triton.jit
def _mhc_post_kernel(
    y_ptr, x_ptr, post_ptr, comb_ptr, out_ptr,
    T, N, D,
    stride_yt, stride_xt, stride_pt, stride_ct, stride_ot,
    NUM_PROGRAMS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_N)
    k_ok = offs_k < N
    d_blocks = tl.cdiv(D, BLOCK_D)
    for tile in range(pid, T * d_blocks, NUM_PROGRAMS):
        t = tl.cast(tile // d_blocks, tl.int64)
        offs_d = (tile % d_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        # Σ_j comb[j, k] · x_j[d] as n rank-1 updates of the [k, d] tile: no reduction
        mixed = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for j in range(N):
            c_j = tl.load(comb_ptr + t * stride_ct + j * N + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            x_j = tl.load(x_ptr + t * stride_xt + j * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
            mixed += c_j[:, None] * x_j[None, :]
        post = tl.load(post_ptr + t * stride_pt + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + t * stride_yt + offs_d, mask=d_ok, other=0.0).to(tl.float32)
        out = post[:, None] * y[None, :] + mixed
        tl.store(
            out_ptr + t * stride_ot + offs_k[:, None] * D + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=k_ok[:, None] & d_ok[None, :],
        )


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _collapse_tiles(g: int, bd: int, xs: int) -> list[Tile]:
    """The tiles ``_collapse_block`` holds for one channel block of ``bd`` (gates padded to ``g``)."""
    return [
        Tile("pre_j pick", (g,), 4),
        Tile("x_j", (bd,), xs, loaded=True), Tile("x_j fp32", (bd,), 4), Tile("pre_j·x_j", (bd,), 4),
        Tile("y", (bd,), 4), Tile("y out", (bd,), xs), Tile("d mask", (bd,), 1),
    ]


def _shape(n: int, d: int, dtype: torch.dtype) -> str:
    return f"n={n}, D={d}, {str(dtype).removeprefix('torch.')}"


def plan_mhc_pre(
    n: int, d: int, dtype: torch.dtype, ub: UnifiedBuffer, *, head: bool = False, collapse: bool = True, interpret: bool = False,
) -> TilePlan:
    """Blocks of ``_mhc_pre_kernel`` for ``n`` streams of ``d`` channels in ``dtype`` within ``ub``.

    ``BLOCK_G`` (gates and the padded Sinkhorn matrix) is fixed at ``max(16, n)``;
    ``BLOCK_F`` (the RMS pass, a reduced axis, at least 16) and ``BLOCK_D`` (the
    collapse) shrink until the tiles fit. Under the interpreter both start at
    ``interpreter_block``. Without the collapse (``mhc_mix``) there is no
    ``BLOCK_D``: the launch passes 1, unused.
    """
    g = max(REDUCE_MIN, next_power_of_2(n))
    xs = _itemsize(dtype)

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bf = b["BLOCK_F"]
        out = [
            Tile("x", (bf,), xs, loaded=True), Tile("x fp32", (bf,), 4), Tile("x²", (bf,), 4), Tile("sq", (bf,), 4),
            Tile("f mask", (bf,), 1),
            Tile("u_pre", (g,), 4, loaded=True), Tile("b_pre", (g,), 4, loaded=True), Tile("pre", (g,), 4),
        ]
        if collapse:
            out += _collapse_tiles(g, b["BLOCK_D"], xs)
        if not head:
            out += [Tile("u_post", (g,), 4, loaded=True), Tile("b_post", (g,), 4, loaded=True), Tile("post", (g,), 4)]
            out += [Tile(name, (g, g), 4, loaded=True) for name in ("u_comb A", "b_comb A", "u_comb B", "b_comb B")]
            out += [Tile(name, (g, g), 4) for name in ("logits A", "logits B", "exp A", "exp B", "A", "B")]
            out += [Tile("offsets A", (g, g), 4), Tile("offsets B", (g, g), 4), Tile("pair mask", (g, g), 1)]
        return tuple(out)

    if interpret:
        start = {"BLOCK_G": g, "BLOCK_F": interpreter_block(n * d, BLOCK_CAP), "BLOCK_D": interpreter_block(d, BLOCK_CAP, 1)}
    else:
        start = {"BLOCK_G": g, "BLOCK_F": block(n * d, BLOCK_CAP, REDUCE_MIN), "BLOCK_D": block(d, BLOCK_CAP)}
    if not collapse:
        del start["BLOCK_D"]
    floors = {"BLOCK_G": g, "BLOCK_F": REDUCE_MIN}
    name = "mhc_head" if head else "mhc_pre" if collapse else "mhc_mix"
    return fit_blocks(name, _shape(n, d, dtype), ub, start, floors, tiles)


def plan_mhc_collapse(n: int, d: int, dtype: torch.dtype, ub: UnifiedBuffer, *, interpret: bool = False) -> TilePlan:
    """Blocks of ``_mhc_collapse_kernel``: ``BLOCK_G`` holds the ``n`` weights (padded to 16, the pick's
    reduced axis), ``BLOCK_D`` shrinks until the tiles fit (under the interpreter it starts at ``interpreter_block``)."""
    g = max(REDUCE_MIN, next_power_of_2(n))
    xs = _itemsize(dtype)

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        return (Tile("pre", (g,), 4, loaded=True), Tile("pre mask", (g,), 1), *_collapse_tiles(g, b["BLOCK_D"], xs))

    start = {"BLOCK_G": g, "BLOCK_D": interpreter_block(d, BLOCK_CAP) if interpret else channel_block(d, BLOCK_CAP)}
    return fit_blocks("mhc_collapse", _shape(n, d, dtype), ub, start, {"BLOCK_G": g}, tiles)


def plan_mhc_post(n: int, d: int, dtype: torch.dtype, ub: UnifiedBuffer, *, interpret: bool = False) -> TilePlan:
    """Blocks of ``_mhc_post_kernel`` (no reduction: ``BLOCK_N`` covers the streams, ``BLOCK_D`` shrinks to fit)."""
    bn = next_power_of_2(n)
    xs = _itemsize(dtype)

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bd = b["BLOCK_D"]
        return (
            Tile("comb row", (bn,), 4, loaded=True), Tile("post", (bn,), 4, loaded=True),
            Tile("x_j", (bd,), xs, loaded=True), Tile("x_j fp32", (bd,), 4),
            Tile("y", (bd,), xs, loaded=True), Tile("y fp32", (bd,), 4),
            Tile("mixed", (bn, bd), 4), Tile("rank-1 update", (bn, bd), 4), Tile("post·y", (bn, bd), 4),
            Tile("out", (bn, bd), 4), Tile("out cast", (bn, bd), xs), Tile("out mask", (bn, bd), 1),
            Tile("out offsets", (bn, bd), 4),
        )

    start = {"BLOCK_N": bn, "BLOCK_D": block(d, 8 if interpret else BLOCK_CAP)}
    return fit_blocks("mhc_post", _shape(n, d, dtype), ub, start, {"BLOCK_N": bn}, tiles)


def _mix(x: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """``flatten(x) @ fnᵀ`` in fp32 for every token at once (the RMS factor is applied in the kernel)."""
    return x.reshape(x.shape[0], -1).float() @ fn.float().t()


def _launch_pre(
    x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_eps: float, hc_eps: float, iters: int, head: bool, collapse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(collapsed, pre, post, comb)``: the kernel writes ``collapsed`` (``collapse``) or ``pre`` (not), and
    ``post`` and ``comb`` unless ``head``."""
    t, n, d = x.shape
    plan = require_fit(plan_mhc_pre(n, d, x.dtype, unified_buffer(x.device), head=head, collapse=collapse, interpret=interpreting()))
    x = x.contiguous()
    mix = _mix(x, fn).contiguous()
    base = base.float().contiguous()
    scale = scale.float().contiguous()
    post = torch.empty(t, n, dtype=torch.float32, device=x.device)
    # the output a launch does not write is given as another of its outputs (never touched)
    collapsed = torch.empty(t, d, dtype=x.dtype, device=x.device) if collapse else post
    pre = post if collapse else torch.empty(t, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    programs = program_count(x.device)
    _mhc_pre_kernel[(programs,)](
        x, mix, base, scale, collapsed, pre, post, comb,
        t, n, d, int(iters),
        x.stride(0), mix.stride(0), collapsed.stride(0), pre.stride(0), post.stride(0), comb.stride(0),
        float(norm_eps), float(hc_eps),
        HEAD=head, COLLAPSE=collapse,
        NUM_PROGRAMS=programs,
        **{"BLOCK_D": 1, **plan.blocks},
    )
    return collapsed, pre, post, comb


def mhc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Kernels.mhc_pre`` for fp32/fp16/bf16 ``x`` with at least one token."""
    collapsed, _, post, comb = _launch_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head=False)
    return collapsed, post, comb


def mhc_mix(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Kernels.mhc_mix`` for fp32/fp16/bf16 ``x`` with at least one token: ``mhc_pre``'s kernel storing ``pre``."""
    _, pre, post, comb = _launch_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, head=False, collapse=False)
    return pre, post, comb


def mhc_head(x, fn, base, scale, norm_eps, hc_eps) -> torch.Tensor:
    """``Kernels.mhc_head`` for fp32/fp16/bf16 ``x`` with at least one token."""
    return _launch_pre(x, fn, base, scale, norm_eps, hc_eps, 1, head=True)[0]


def mhc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``Kernels.mhc_collapse`` for fp32/fp16/bf16 ``x`` with at least one token."""
    t, n, d = x.shape
    plan = require_fit(plan_mhc_collapse(n, d, x.dtype, unified_buffer(x.device), interpret=interpreting()))
    x = x.contiguous()
    pre = pre.contiguous()
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    programs = program_count(x.device)
    _mhc_collapse_kernel[(programs,)](
        x, pre, out,
        t, n, d,
        x.stride(0), pre.stride(0), out.stride(0),
        NUM_PROGRAMS=programs,
        **plan.blocks,
    )
    return out


def mhc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``Kernels.mhc_post`` for fp32/fp16/bf16 ``x`` with at least one token."""
    t, n, d = x.shape
    plan = require_fit(plan_mhc_post(n, d, x.dtype, unified_buffer(x.device), interpret=interpreting()))
    x = x.contiguous()
    y = y if y.stride(-1) == 1 else y.contiguous()
    post = post.contiguous()
    comb = comb.contiguous()
    out = torch.empty(t, n, d, dtype=x.dtype, device=x.device)
    programs = program_count(x.device)
    _mhc_post_kernel[(programs,)](
        y, x, post, comb, out,
        t, n, d,
        y.stride(0), x.stride(0), post.stride(0), comb.stride(0), out.stride(0),
        NUM_PROGRAMS=programs,
        **plan.blocks,
    )
    return out

"""V4.1's Engram injection (``engram_inject``) as a Triton-Ascend kernel.

One program per vector core walks (token, stream) rows. A row needs three sums
over its ``D`` channels (``Σ h²``, ``Σ q²``, ``Σ h · w · q``) before its gate
is known, and ``D`` is V4.1's hidden size (5120): whole rows of ``h``, ``q``,
``w`` and ``v`` do not fit one unified buffer, so the kernel makes two passes
over the row in channel blocks, as ``mhc_pre``'s RMS pass does. The first adds
the three products into 1-D fp32 vectors and sums each once (``_total``: a
1-D sum, its only axis, at least ``REDUCE_MIN`` wide); the second writes
``h + gate · v``. Memory held is a few ``BLOCK_D`` vectors whatever ``D``; no
atomics (each output element has one writer), fp32 math, no 2-D tiles at all.
``BLOCK_D`` comes from the UB budget (``plan_engram_inject``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import (
    REDUCE_MIN, Tile, TilePlan, UnifiedBuffer, fit_blocks, interpreting, program_count, require_fit, unified_buffer,
)
from .triton_ascend_mhc import _total, channel_block, interpreter_block

#: widest channel block (V4.1's 5120 channels run as five blocks of 1024: see ``channel_block``)
BLOCK_CAP = 4096


@triton.jit
def _engram_inject_kernel(
    h_ptr, q_ptr, v_ptr, w_ptr, out_ptr,
    T, N, D,
    stride_ht, stride_hn, stride_qt, stride_qn, stride_vt, stride_wn, stride_ot, stride_on,
    eps, inv_sqrt_d,
    NUM_PROGRAMS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    for row in range(pid, T * N, NUM_PROGRAMS):
        t = tl.cast(row // N, tl.int64)
        k = row % N
        h_row = h_ptr + t * stride_ht + k * stride_hn
        q_row = q_ptr + t * stride_qt + k * stride_qn
        w_row = w_ptr + k * stride_wn
        hh = tl.zeros([BLOCK_D], dtype=tl.float32)
        qq = tl.zeros([BLOCK_D], dtype=tl.float32)
        hwq = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            ok = offs < D
            h = tl.load(h_row + offs, mask=ok, other=0.0).to(tl.float32)
            q = tl.load(q_row + offs, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_row + offs, mask=ok, other=0.0).to(tl.float32)
            hh += h * h
            qq += q * q
            hwq += h * w * q
        rstd = (1.0 / tl.sqrt(_total(hh) / D + eps)) * (1.0 / tl.sqrt(_total(qq) / D + eps))
        dot = _total(hwq) * rstd * inv_sqrt_d
        sign = tl.where(dot > 0.0, 1.0, tl.where(dot < 0.0, -1.0, 0.0))
        gate = tl.sigmoid(sign * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6)))
        v_row = v_ptr + t * stride_vt
        out_row = out_ptr + t * stride_ot + k * stride_on
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            ok = offs < D
            h = tl.load(h_row + offs, mask=ok, other=0.0).to(tl.float32)
            v = tl.load(v_row + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_row + offs, (h + gate * v).to(out_ptr.dtype.element_ty), mask=ok)


def plan_engram_inject(n: int, d: int, dtype: torch.dtype, weight_dtype: torch.dtype, ub: UnifiedBuffer, *,
                       interpret: bool = False) -> TilePlan:
    """Blocks of ``_engram_inject_kernel`` for ``n`` streams of ``d`` channels (``BLOCK_D`` halves to fit)."""
    xs = torch.empty((), dtype=dtype).element_size()
    ws = torch.empty((), dtype=weight_dtype).element_size()

    def tiles(b: dict[str, int]) -> tuple[Tile, ...]:
        bd = b["BLOCK_D"]
        return (
            Tile("h", (bd,), xs, loaded=True), Tile("q", (bd,), xs, loaded=True), Tile("w", (bd,), ws, loaded=True),
            Tile("v", (bd,), xs, loaded=True),
            Tile("h fp32", (bd,), 4), Tile("q fp32", (bd,), 4), Tile("w fp32", (bd,), 4), Tile("v fp32", (bd,), 4),
            Tile("Σh²", (bd,), 4), Tile("Σq²", (bd,), 4), Tile("Σhwq", (bd,), 4), Tile("product", (bd,), 4),
            Tile("out", (bd,), 4), Tile("out cast", (bd,), xs), Tile("mask", (bd,), 1), Tile("offsets", (bd,), 4),
        )

    start = {"BLOCK_D": interpreter_block(d, BLOCK_CAP) if interpret else channel_block(d, BLOCK_CAP)}
    shape = f"n={n}, D={d}, {str(dtype).removeprefix('torch.')}"
    return fit_blocks("engram_inject", shape, ub, start, {"BLOCK_D": REDUCE_MIN}, tiles)


def engram_inject(streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``Kernels.engram_inject`` for fp32/fp16/bf16 inputs with at least one token."""
    t, n, d = streams.shape
    wider = max(streams.dtype, key.dtype, value.dtype, key=lambda dt: torch.empty((), dtype=dt).element_size())
    plan = require_fit(plan_engram_inject(n, d, wider, weight.dtype, unified_buffer(streams.device), interpret=interpreting()))
    streams, key, value, weight = (x if x.stride(-1) == 1 else x.contiguous() for x in (streams, key, value, weight))
    out = torch.empty(t, n, d, dtype=streams.dtype, device=streams.device)
    programs = program_count(streams.device)
    _engram_inject_kernel[(programs,)](
        streams, key, value, weight, out,
        t, n, d,
        streams.stride(0), streams.stride(1), key.stride(0), key.stride(1), value.stride(0), weight.stride(0),
        out.stride(0), out.stride(1),
        float(eps), float(d) ** -0.5,
        NUM_PROGRAMS=programs,
        **plan.blocks,
    )
    return out

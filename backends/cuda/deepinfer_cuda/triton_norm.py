"""RMSNorm as one Triton program per row, accumulating in fp32 (fp64 for fp64 input)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, next_power_of_2, num_warps_for, rows
from .triton_common import accumulator

#: rows up to this width are held in registers and read once; wider rows are read twice in chunks
_ONE_PASS_MAX = 16384


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps,
    HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    o_row = out_ptr + row * stride_o
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(ACC)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = x * inv
        if HAS_WEIGHT:
            y = tl.load(w_ptr + offs, mask=mask, other=0.0).to(ACC) * y
        tl.store(o_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        sq = tl.zeros([BLOCK], dtype=ACC)
        for start in range(0, D, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < D, other=0.0).to(ACC)
            sq += x * x
        inv = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / D + eps)
        for start in range(0, D, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < D
            y = tl.load(x_row + offs, mask=mask, other=0.0).to(ACC) * inv
            if HAS_WEIGHT:
                y = tl.load(w_ptr + offs, mask=mask, other=0.0).to(ACC) * y
            tl.store(o_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_tiles(d: int) -> Tiles:
    """Rows of ``d`` columns: held whole in registers up to ``_ONE_PASS_MAX``, else read twice in chunks."""
    one_pass = d <= choose(_ONE_PASS_MAX, 64)
    block = next_power_of_2(d) if one_pass else choose(4096, 32)
    return Tiles({"BLOCK": block, "ONE_PASS": one_pass}, num_warps=num_warps_for(block))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``Kernels.rms_norm`` on the device; ``x`` is ``[..., D]`` with at least one row."""
    d = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({d},) to match x's last dim")
    x2 = rows(x, d)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    w = weight.contiguous() if weight is not None else x2
    _rms_norm_kernel[(x2.shape[0],)](
        x2, w, out, d, x2.stride(0), out.stride(0), float(eps),
        HAS_WEIGHT=weight is not None, ACC=accumulator(x.dtype), **rms_norm_tiles(d).kwargs(),
    )
    return out.view(x.shape)

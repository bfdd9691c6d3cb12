"""RMSNorm."""

from __future__ import annotations

import torch

from .base import acc_dtype, op


class NormOps:
    @op(rows=("x",))
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """Root-mean-square norm over the last dim: ``x / sqrt(mean(x²) + eps) * weight``.

        Accumulates in fp32; the weight (kept in fp32 by V4 checkpoints) multiplies
        in fp32 and the result is cast once to ``x.dtype``. ``weight=None`` is the
        unweighted norm (per-head q norm).
        """
        acc = acc_dtype(x)
        xf = x.to(acc)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if weight is not None:
            y = weight.to(acc) * y
        return y.to(x.dtype)

"""Partial interleaved rotary position embedding."""

from __future__ import annotations

import torch

from .base import acc_dtype, op


class RopeOps:
    @op(rows=("x", "cos", "sin"))
    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """Rotate the trailing ``2·cos.shape[-1]`` channels of ``x`` in interleaved pairs.

        ``x`` is ``[T, D]`` or ``[T, H, D]``; ``cos``/``sin`` are ``[T, R/2]`` (one
        angle per pair, already scaled as the rope type asks). Pair ``(x[2i], x[2i+1])``
        of the rope slice becomes ``(x0·c − x1·s, x0·s + x1·c)``; ``inverse`` rotates
        by the negative angle (V4 un-rotates the attention output). The leading
        ``D − R`` channels pass through unchanged. Computed in fp32, returned in
        ``x.dtype``.
        """
        half = cos.shape[-1]
        if half == 0 or x.shape[0] == 0:
            return x.clone()
        acc = acc_dtype(x)
        c = cos.to(acc)
        s = sin.to(acc)
        if inverse:
            s = -s
        if x.dim() == 3:
            c, s = c[:, None, :], s[:, None, :]
        rot = x[..., -2 * half:].to(acc)
        x0, x1 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
        return torch.cat([x[..., : x.shape[-1] - 2 * half], out.to(x.dtype)], dim=-1)

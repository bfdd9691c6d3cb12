"""The example kernel set: its own RMSNorm, RoPE and bitmask; every other op is the reference.

Each override computes the same function as the reference in a different way,
the way a vendor's fused kernel would; the conformance suite checks that it does.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels


class ExampleKernels(Kernels):
    name = "example"
    interface_version = "1.7.0"  # the contract this kernel set was written for

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = x.float()
        inv = (xf.square().sum(-1, keepdim=True) / x.shape[-1] + eps) ** -0.5
        y = xf * inv
        return (y if weight is None else y * weight.float()).to(x.dtype)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        half = cos.shape[-1]
        if half == 0 or x.shape[0] == 0:
            return x.clone()
        # complex multiplication: (x0 + i x1) * (cos ± i sin)
        rot = x[..., -2 * half :].float().reshape(*x.shape[:-1], half, 2)
        z = torch.view_as_complex(rot.contiguous())
        angle = torch.complex(cos.float(), -sin.float() if inverse else sin.float())
        if x.dim() == 3:
            angle = angle[:, None, :]
        out = torch.view_as_real(z * angle).flatten(-2).to(x.dtype)
        return torch.cat([x[..., : x.shape[-1] - 2 * half], out], dim=-1)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        vocab = logits.shape[-1]
        words = bitmask.shape[-1]
        token = torch.arange(vocab, device=logits.device)
        word = (token // 32).clamp(max=max(words - 1, 0))
        bit = (bitmask.to(torch.int64)[:, word] >> (token % 32)) & 1 if words else torch.zeros_like(logits, dtype=torch.int64)
        allowed = (bit == 1) & (token < words * 32)
        return logits.masked_fill_(~allowed, float("-inf"))

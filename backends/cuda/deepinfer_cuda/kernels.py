"""The CUDA kernel set: Triton kernels where a fused kernel pays, the reference elsewhere.

Triton is imported only when a kernel runs (the ``triton_*`` modules are
imported inside the methods), so listing plugins never imports it. Empty
batches return without launching anything. Dtypes the kernels do not handle
(anything outside ``launch.KERNEL_DTYPES``) run the reference.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from .launch import KERNEL_DTYPES, check_device


class CUDAKernels(Kernels):
    name = "cuda"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm, one Triton program per row (see ``Kernels.rms_norm``)."""
        if x.dtype not in KERNEL_DTYPES:
            return super().rms_norm(x, weight, eps)
        if x.numel() == 0:
            return torch.empty_like(x)
        check_device("rms_norm", x, *([] if weight is None else [weight]))
        from .triton_norm import rms_norm

        return rms_norm(x, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Partial interleaved RoPE, forward or inverse, in one pass (see ``Kernels.rope``)."""
        if x.dtype not in KERNEL_DTYPES:
            return super().rope(x, cos, sin, inverse)
        if cos.shape[-1] == 0 or x.numel() == 0:
            return x.clone()
        check_device("rope", x, cos, sin)
        from .triton_rope import rope

        return rope(x, cos, sin, inverse)

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p by the exponential race (see ``Kernels.sample``)."""
        if logits.shape[0] == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        check_device("sample", logits, noise)
        from .triton_sampling import sample

        return sample(logits, temperature, top_k, top_p, min_p, noise)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Masks disallowed tokens to ``-inf`` in place (see ``Kernels.apply_token_bitmask``)."""
        if logits.numel() == 0:
            return logits
        check_device("apply_token_bitmask", logits)
        from .triton_bitmask import apply_token_bitmask

        return apply_token_bitmask(logits, bitmask)

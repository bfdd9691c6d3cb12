"""The CUDA kernel set: Triton kernels where a fused kernel pays, the reference elsewhere.

Triton is imported only when a kernel runs, so listing plugins never imports it.
"""

from __future__ import annotations

from deepinfer_interfaces import Kernels


class CUDAKernels(Kernels):
    name = "cuda"

"""The Ascend kernel set: torch_npu fused ops and Triton-Ascend kernels, the reference elsewhere."""

from __future__ import annotations

from deepinfer_interfaces import Kernels


class AscendKernels(Kernels):
    name = "ascend"

"""The ``cuda`` backend bundle."""

from __future__ import annotations

import importlib.util

from deepinfer_interfaces import Backend


class CUDABackend(Backend):
    name = "cuda"
    interface_version = "1.7.0"  # the contract this bundle was written for
    device = "cuda"
    communicator = "torch-distributed"
    kernels = "cuda"
    priority = 100

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        from .device import CUDADevice

        ok, reason = CUDADevice.is_available()
        if not ok:
            return ok, reason
        if importlib.util.find_spec("triton") is None:
            return False, "triton is not installed (pip install 'deepinfer[cuda]')"
        return True, None

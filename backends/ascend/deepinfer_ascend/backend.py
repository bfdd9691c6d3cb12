"""The ``ascend`` backend bundle."""

from __future__ import annotations

from deepinfer_interfaces import Backend


class AscendBackend(Backend):
    name = "ascend"
    device = "ascend"
    communicator = "hccl-moe"
    kernels = "ascend"
    priority = 90

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        from .device import AscendDevice

        return AscendDevice.is_available()

"""The ``ascend`` backend bundle."""

from __future__ import annotations

from deepinfer_interfaces import Backend


class AscendBackend(Backend):
    name = "ascend"
    interface_version = "1.7.0"  # the contract this bundle was written for
    device = "ascend"
    communicator = "hccl-moe"
    kernels = "ascend"
    priority = 90

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        from .device import AscendDevice

        return AscendDevice.is_available()

"""The bundle: which device, communicator and kernels make the ``example`` backend."""

from deepinfer_interfaces import Backend

from .device import ExampleDevice


class ExampleBackend(Backend):
    name = "example"
    interface_version = "1.7.0"  # the contract this bundle was written for
    device = "example"
    communicator = "torch-distributed"
    kernels = "example"
    priority = -10  # never preferred by `auto` over the reference

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        return ExampleDevice.is_available()

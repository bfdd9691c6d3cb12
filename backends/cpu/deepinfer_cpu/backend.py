"""The ``cpu`` backend bundle."""

from deepinfer_interfaces import Backend


class CPUBackend(Backend):
    """Always available; the reference every other backend is checked against."""

    name = "cpu"
    interface_version = "1.7.0"  # the contract this bundle was written for
    device = "cpu"
    communicator = "torch-distributed"
    kernels = "reference"
    priority = 0

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        return True, None

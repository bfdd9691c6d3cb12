"""A device test double that refuses host reads: the model runs on torch's ``meta`` device.

Meta tensors hold no data, so anything that reads a device value on the host
inside the forward (``.item()``, ``.tolist()``, a copy to the CPU, a gather of a
host table by device ids) raises, while ops that stay on the device run (shapes
only). ``map_host`` gives a meta tensor of the host table's shape, as a device
that reads host memory in place gives a device tensor over it;
``MetaDeviceWithoutMapping`` cannot read host memory (``map_host`` is None), as
Ascend. ``free`` sets the free memory the device reports.
"""

from __future__ import annotations

import torch

from deepinfer_cpu.device import CPUDevice


class MetaDevice(CPUDevice):
    type = "meta"

    def __init__(self, index: int = 0, free: int = 1 << 40) -> None:
        super().__init__(index)
        self.free = free

    @property
    def torch_device(self) -> torch.device:
        return torch.device("meta")

    def memory_info(self) -> tuple[int, int]:
        return self.free, 2 * self.free

    def map_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(tensor, device="meta")


class MetaDeviceWithoutMapping(MetaDevice):
    def map_host(self, tensor: torch.Tensor) -> None:
        return None

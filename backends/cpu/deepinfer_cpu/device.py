"""The host CPU as a Device."""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any

import torch

from deepinfer_interfaces import Device, DeviceCapabilities, HostEvent, HostStream, host_stream_context


class CPUDevice(Device):
    """Runs everything on the host; work is synchronous, so streams and events are trivial."""

    type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        return True, None

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def capabilities(self) -> DeviceCapabilities:
        return DeviceCapabilities(
            name=platform.processor() or platform.machine() or "cpu",
            dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
            extra={"threads": torch.get_num_threads()},
        )

    def synchronize(self) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def new_stream(self) -> HostStream:
        return HostStream()

    def new_event(self) -> HostEvent:
        return HostEvent()

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return host_stream_context(stream)

"""The example device. A real vendor wraps its runtime here (torch.<vendor> or a PrivateUse1 backend).

This example drives the host CPU so it runs anywhere; everything a vendor must
answer is spelled out: availability with a reason, capabilities, memory,
streams and events, and which torch.distributed backend connects its devices.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from deepinfer_interfaces import Device, DeviceCapabilities, HostEvent, HostStream, host_stream_context


class ExampleDevice(Device):
    type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        # A real device checks its runtime import and device count here, never raising.
        if os.environ.get("EXAMPLE_DEVICE_DISABLE") == "1":
            return False, "disabled by EXAMPLE_DEVICE_DISABLE=1"
        return True, None

    def device_count(self) -> int:
        return 1

    def capabilities(self) -> DeviceCapabilities:
        return DeviceCapabilities(name="example-accelerator", dtypes=(torch.float32, torch.bfloat16, torch.float16))

    def synchronize(self) -> None:
        pass

    def memory_info(self) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def new_stream(self) -> Any:
        return HostStream()

    def new_event(self) -> Any:
        return HostEvent()

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return host_stream_context(stream)

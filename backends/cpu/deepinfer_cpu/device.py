"""The host CPU as a Device."""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any, Callable, TypeVar

import torch

from deepinfer_interfaces import Device, DeviceCapabilities, HostEvent, HostStream, host_stream_context

T = TypeVar("T")


class CPUDevice(Device):
    """Runs everything on the host; work is synchronous, so streams and events are trivial.

    A "graph" here is the callable compiled by ``torch.compile`` (inductor,
    fused C++ kernels, static shapes): replaying it skips Python and most
    per-op dispatch. Compiling takes seconds per shape (about half a minute for
    the first on a cold cache), more than a short run saves, so the engine
    captures on the CPU only when asked (``enforce_eager=False``).
    """

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
            graph_capture=True,
            graph_by_default=False,
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

    def map_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor itself: host memory is this device's memory."""
        return tensor

    def capture_graph(self, fn: Callable[[], T], pool: Any = None) -> Callable[[], T]:
        """``fn`` compiled whole (``fullgraph``: a graph break is an error) for the shapes it reads now.

        Every capture of one function is a cache entry of the same code object,
        so the recompile limit is lifted for the capture (one entry per shape).
        The compiled code runs under ``no_grad`` whatever the caller's mode
        (inductor does not take views of inference tensors as inputs).
        """
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)

        def replay() -> T:
            with torch.inference_mode(False), torch.no_grad():
                return compiled()

        with torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16):
            replay()
        return replay

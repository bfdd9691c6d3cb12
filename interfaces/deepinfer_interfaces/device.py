"""The Device contract: what the engine needs to know about, and do with, an accelerator.

Modelled on ``torch.accelerator`` and kept small: identity, capabilities,
availability, device selection, streams and events, synchronisation, memory and
seeding, host memory the device reads in place, graph capture, and the name of
the torch.distributed backend that connects devices.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, TypeVar

import torch

from .errors import NotSupportedError

T = TypeVar("T")


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a device can do; the engine and the kernels branch on these, never on names."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    fp8: bool = False
    fp4: bool = False
    #: ``Device.capture_graph`` works (a captured callable replays without the host re-issuing its ops)
    graph_capture: bool = False
    #: whether the engine captures decode graphs unless told otherwise: False where capture costs more
    #: than replay saves in a typical run (compiling on the host CPU)
    graph_by_default: bool = False
    #: work is queued and runs apart from the host thread, so the host can schedule the next step meanwhile
    #: (False for the host CPU itself: overlapping would only split the same cores)
    asynchronous: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class Device(ABC):
    """One kind of accelerator (all devices of that kind on this host)."""

    #: torch device type, e.g. ``"cpu"``, ``"cuda"``, ``"npu"``.
    type: ClassVar[str]
    #: torch.distributed backend connecting these devices, e.g. ``"gloo"``.
    dist_backend: ClassVar[str]

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @classmethod
    @abstractmethod
    def is_available(cls) -> tuple[bool, str | None]:
        """``(True, None)`` when usable here, else ``(False, reason)``; never raises."""

    @abstractmethod
    def device_count(self) -> int:
        """Number of devices of this kind visible to the process."""

    @abstractmethod
    def capabilities(self) -> DeviceCapabilities:
        """Capabilities of the selected device."""

    @property
    def torch_device(self) -> torch.device:
        """The torch device that tensors for this device are created on."""
        return torch.device(self.type, self.index)

    def set_device(self, index: int) -> None:
        """Select the device that later work runs on."""
        self.index = index

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work on the selected device."""

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of the selected device."""

    def manual_seed(self, seed: int) -> None:
        """Seed the default generators that sampling on this device uses."""
        torch.manual_seed(seed)

    def generator(self, seed: int) -> torch.Generator:
        """A generator on this device seeded with ``seed`` (per-request sampling)."""
        g = torch.Generator(device=self.torch_device)
        g.manual_seed(seed)
        return g

    @abstractmethod
    def new_stream(self) -> Any:
        """A new stream for overlapping work with the default stream."""

    @abstractmethod
    def new_event(self) -> Any:
        """A new event that can be recorded on a stream and waited for."""

    @abstractmethod
    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        """Context manager making ``stream`` current for the enclosed work."""

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor that copies to this device without staging (pinned where the device is not the host)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.type != "cpu")

    def map_host(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A tensor on this device whose data is host memory holding ``tensor``'s values, which the device's
        kernels read in place, inside captured graphs too (pinned or registered memory under unified
        addressing); None where the device cannot read host memory.

        Made once, at load: the host copy may be taken now (pinned memory), so later writes to ``tensor``
        need not show. Meant for large, read-mostly tables a step reads a few rows of (the Engram tables)."""
        return None

    def new_graph_pool(self) -> Any:
        """A memory pool handle that captures can share (graphs replayed one at a time reuse its memory)."""
        return None

    def capture_graph(self, fn: Callable[[], T], pool: Any = None) -> Callable[[], T]:
        """Capture ``fn`` and return a replay callable that returns what ``fn`` returns.

        ``fn`` takes no arguments: it reads only tensors whose storage stays put
        (static input buffers, parameters, cache pools), so a replay sees
        whatever those buffers hold at that moment. ``fn`` must not synchronise
        with the host. Outputs may be the same tensors at every replay: copy
        what must survive the next one. Devices without graph capture raise
        ``NotSupportedError`` (``capabilities().graph_capture`` is False).
        """
        raise NotSupportedError(f"device {self.type} has no graph capture; run eager (enforce_eager=True)")

    def describe(self) -> str:
        """One line naming the device, for logs."""
        return f"{self.type}:{self.index} ({self.capabilities().name})"


class HostStream:
    """A stream for devices whose work runs synchronously on the host."""

    def synchronize(self) -> None:
        """Nothing is ever queued, so there is nothing to wait for."""

    def wait_event(self, event: "HostEvent") -> None:
        """Events on a host stream have always completed."""

    def wait_stream(self, stream: "HostStream") -> None:
        """Work on a host stream is always complete."""


class HostEvent:
    """An event for devices whose work runs synchronously on the host."""

    def record(self, stream: HostStream | None = None) -> None:
        """Work before the record point is already complete."""

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def _null_context() -> Iterator[None]:
    yield


def host_stream_context(stream: Any) -> contextlib.AbstractContextManager:
    """Stream context for host-synchronous devices: a no-op."""
    return _null_context()


def record_stream_graph(ns: Any, graph_cls: type, fn: Callable[[], T], pool: Any = None, warmup: int = 2) -> Callable[[], T]:
    """Capture ``fn`` as a stream graph through a ``torch.cuda``-shaped namespace (``torch.cuda``, ``torch_npu.npu``).

    ``fn`` runs ``warmup`` times on a side stream first (lazy initialisation,
    autotuning, allocator growth stay out of the graph), then once under
    capture into ``pool``. The replay callable returns the tensors the captured
    run returned; each replay overwrites them.
    """
    side = ns.Stream()
    side.wait_stream(ns.current_stream())
    with ns.stream(side):
        for _ in range(warmup):
            fn()
    ns.current_stream().wait_stream(side)
    graph = graph_cls()
    with ns.graph(graph, pool=pool):
        out = fn()

    def replay() -> T:
        graph.replay()
        return out

    return replay

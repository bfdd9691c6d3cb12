"""NVIDIA GPUs through torch.cuda, with features gated by compute capability."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, TypeVar

import torch

from deepinfer_interfaces import Device, DeviceCapabilities, record_stream_graph
from deepinfer_interfaces.memory_alias import alias_memory

T = TypeVar("T")


def features_for_capability(major: int, minor: int) -> dict[str, bool]:
    """Block-scaled low-precision matmuls by architecture: FP8 from Hopper (sm_90), FP4 on Blackwell (sm_100/sm_120)."""
    return {"fp8": (major, minor) >= (8, 9), "fp4": major >= 10}


class CUDADevice(Device):
    type = "cuda"
    dist_backend = "nccl"

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is a build without CUDA (install a CUDA build of torch)"
        if not torch.cuda.is_available():
            return False, "no CUDA device visible (torch.cuda.is_available() is False; check the driver and CUDA_VISIBLE_DEVICES)"
        return True, None

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        self.index = index
        torch.cuda.set_device(index)

    def capabilities(self) -> DeviceCapabilities:
        major, minor = torch.cuda.get_device_capability(self.index)
        feats = features_for_capability(major, minor)
        dtypes = [torch.float32, torch.float16, torch.bfloat16]
        if feats["fp8"]:
            dtypes.append(torch.float8_e4m3fn)
        return DeviceCapabilities(
            name=torch.cuda.get_device_name(self.index),
            dtypes=tuple(dtypes),
            fp8=feats["fp8"],
            fp4=feats["fp4"],
            graph_capture=True,
            graph_by_default=True,
            asynchronous=True,
            extra={"capability": f"sm_{major}{minor}"},
        )

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def memory_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.index)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def map_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A CUDA tensor over a pinned host copy of ``tensor`` (copied once; kept alive by the alias).

        torch pins with ``cudaHostAlloc``; under unified addressing (every 64-bit CUDA platform) that memory is
        mapped for every device at its host address, so kernels read it there, over PCIe or NVLink-C2C, with
        no copy queued: a captured graph reads the rows it gathers straight from host memory."""
        pinned = tensor.contiguous().pin_memory()
        return alias_memory(pinned.data_ptr(), tuple(pinned.shape), pinned.dtype, "cuda", self.index, pinned)

    def new_graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn: Callable[[], T], pool: Any = None) -> Callable[[], T]:
        """A CUDA graph of ``fn`` (warmed up on a side stream, captured into ``pool``)."""
        return record_stream_graph(torch.cuda, torch.cuda.CUDAGraph, fn, pool)

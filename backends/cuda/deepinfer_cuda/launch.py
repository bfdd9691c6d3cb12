"""Launch helpers shared by the Triton kernels: interpreter awareness, block sizes, tensor checks.

This module never imports Triton, so ``kernels.py`` can use it to decide where
a kernel may run before any Triton module is loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence, TypeVar

import torch

T = TypeVar("T")


def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def choose(gpu: T, interpreter: T) -> T:
    """``gpu`` on a real device, ``interpreter`` under the interpreter.

    Interpreter values are small blocks: the interpreter is slow per element,
    and small blocks make the small op-spec shapes cross block boundaries.
    """
    return interpreter if interpreting() else gpu


def autotune_configs(gpu: Sequence[T], interpreter: T) -> list[T]:
    """Configs for ``@triton.autotune``: all of ``gpu`` on a device, only ``interpreter`` under the interpreter.

    The interpreter cannot benchmark configs against each other (autotuning with
    more than one config fails there), so it gets exactly one.
    """
    return [interpreter] if interpreting() else list(gpu)


@dataclass(frozen=True)
class Tiles:
    """What a launcher picks for one launch: block-size constexprs and, unless autotuned, warps and stages.

    Each launcher gets its picks from a ``*_tiles`` function of the sizes, and
    ``compile_check`` compiles those same picks ahead of time, so what CI
    compiles for sm_90 / sm_100 is what a GPU launches.
    """

    blocks: dict[str, int | bool] = field(default_factory=dict)
    #: None: the autotune config's (autotuned kernels) or Triton's default
    num_warps: int | None = None
    num_stages: int | None = None

    def kwargs(self) -> dict[str, int | bool]:
        """The launch keyword arguments: the block constexprs, then the options that are set."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        return {**self.blocks, **{k: v for k, v in options.items() if v is not None}}


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_warps_for(elements: int) -> int:
    """Warps for a program that holds ``elements`` values at once: about 8 per thread, 1 to 16 warps."""
    return max(1, min(16, next_power_of_2(elements) // 256))


#: the most shared memory one block may use on sm_90 and sm_100 (232448 bytes: 228 KB per SM less the
#: 1 KB the driver reserves per block; CUDA C++ Programming Guide, "Technical Specifications per Compute Capability")
SHARED_MEMORY_PER_BLOCK = 227 * 1024

#: dtypes the Triton kernels load and store; fp64 accumulates in fp64 like the reference.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: dtypes of the DeepSeek-V4 model kernels (``tl.dot`` operands, fp32 softmax); fp64, the
#: conformance oracle's dtype, runs the reference there
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_device(op: str, *tensors: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under the interpreter; say so clearly otherwise."""
    want = "cpu" if interpreting() else "cuda"
    for t in tensors:
        if t.device.type != want:
            fix = (
                "move the tensors to the CUDA device, or run with --interpret (TRITON_INTERPRET=1) for CPU tensors"
                if want == "cuda"
                else "the interpreter runs on CPU tensors; move them to the CPU"
            )
            raise ValueError(f"cuda kernel {op}: got a {t.device.type} tensor but Triton here runs on {want} tensors; {fix}")


def rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` as ``[N, width]`` rows with unit stride along the row (a copy only when needed)."""
    x2 = x.reshape(-1, width)
    return x2 if width <= 1 or x2.stride(-1) == 1 else x2.contiguous()


def unit_inner(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dim (a copy only when it has another)."""
    return t if t.stride(-1) == 1 else t.contiguous()

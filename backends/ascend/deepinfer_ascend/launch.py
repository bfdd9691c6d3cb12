"""Where an Ascend op runs, decided per call: torch_npu fused op, Triton-Ascend kernel, or the reference.

This module never imports torch_npu or Triton. It reads two environment
variables: ``TRITON_INTERPRET=1`` (Triton kernels run on CPU tensors through the
interpreter) and ``DEEPINFER_ASCEND_DISABLE`` (a comma-separated list of ops,
or ``all``, that run the reference instead of their fused op or Triton kernel,
for bisecting a numerical problem op by op).
"""

from __future__ import annotations

import os

import torch

#: dtypes the Triton-Ascend kernels load and store (others run the reference)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: programs a Triton-Ascend launch uses under the interpreter (small, so small shapes still loop)
INTERPRETER_PROGRAMS = 3

DISABLE_ENV = "DEEPINFER_ASCEND_DISABLE"


def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def disabled_ops() -> frozenset[str]:
    """Ops named in ``DEEPINFER_ASCEND_DISABLE`` (``all`` disables every one)."""
    raw = os.environ.get(DISABLE_ENV, "")
    return frozenset(p.strip() for p in raw.split(",") if p.strip())


def is_disabled(op: str) -> bool:
    names = disabled_ops()
    return op in names or "all" in names


def on_npu(*tensors: torch.Tensor) -> bool:
    """True when every tensor lives on an NPU."""
    return bool(tensors) and all(t.device.type == "npu" for t in tensors)


def triton_can_run(*tensors: torch.Tensor) -> bool:
    """Triton-Ascend runs NPU tensors on the device, or CPU tensors under the interpreter."""
    if not tensors:
        return False
    if interpreting():
        return all(t.device.type == "cpu" for t in tensors)
    if not on_npu(*tensors):
        return False
    try:
        import triton

        backend = triton.runtime.driver.active.get_current_target().backend
    except Exception:
        return False
    return backend not in ("cuda", "hip")  # a GPU build of Triton cannot launch on an NPU; Triton-Ascend can


def program_count(device: torch.device) -> int:
    """Programs in a 1-D Triton-Ascend grid: one per vector core on an NPU, a few under the interpreter."""
    if interpreting() or device.type != "npu":
        return INTERPRETER_PROGRAMS
    from .device import vector_core_count

    return vector_core_count(device.index or 0)


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def block(n: int, cap: int, floor: int = 1) -> int:
    """A power-of-two block covering ``n`` (at least ``floor``), at most ``cap``."""
    return max(floor, min(next_power_of_2(n), cap))

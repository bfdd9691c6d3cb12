"""Where an Ascend op runs, decided per call: torch_npu fused op, Triton-Ascend kernel, or the reference.

It also plans each Triton-Ascend launch's block sizes from the unified-buffer
budget of the SoC generation (``UNIFIED_BUFFERS``, ``fit_blocks``, ``require_fit``).

This module never imports torch_npu or Triton (``flash_plans`` plans the
models' launches with the kernel modules). It reads two environment
variables: ``TRITON_INTERPRET=1`` (Triton kernels run on CPU tensors through the
interpreter) and ``DEEPINFER_ASCEND_DISABLE`` (a comma-separated list of ops,
or ``all``, that run the reference instead of their fused op or Triton kernel,
for bisecting a numerical problem op by op).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer_interfaces import NotSupportedError, PackedPool

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


def packed_pool_reason(pool: PackedPool, one_format: bool = True) -> str | None:
    """Why the Triton-Ascend kernels cannot read the packed ``pool``, or None: they decode to fp32/fp16/bf16, and
    (``one_format``: the kernels that decode rows as they load them, ``triton_ascend_kv_quant._load_rows``) read
    pools of one record format."""
    if one_format and len(pool.regions) != 1:
        names = ", ".join(r.format.name for r in pool.regions)
        return f"the pool holds {len(pool.regions)} record regions ({names}); the Triton-Ascend kernels read pools of one format"
    if pool.dtype not in KERNEL_DTYPES:
        return f"the pool's rows decode to {pool.dtype}, not fp32/fp16/bf16"
    return None


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


# ---- the unified buffer (UB) budget ------------------------------------------------------
#
# A Triton-Ascend program keeps every tile it loads or computes in its vector core's unified
# buffer, and the compiler fails with "ub overflow" when they do not fit (blocks tuned on a
# 950 overflow an A2, triton-ascend#442). Each launcher sizes its blocks from the budget of
# its SoC generation and refuses a shape that cannot fit even at the smallest blocks.

KiB = 1024

#: every reduction runs along the last axis of a tile at least this wide (masked padding that
#: cannot change the result): triton-ascend#2247 reports 2-D reductions with an inner extent < 8
#: dropping lanes on Ascend 950 and padding to 8 fixing it; 16 is one 32-byte UB block at 2 bytes
REDUCE_MIN = 16

#: copies of each tl.load'ed tile: triton-ascend's ``multibuffer`` compile option (on by default,
#: docs/en/migration_guide/architecture_difference.md) double-buffers loads so the next load
#: overlaps this compute
LOAD_BUFFERS = 2

#: UB allocations are 32-byte aligned (CANN Ascend C memory management: "Unified Buffer: 32Byte对齐")
UB_ALIGN = 32


@dataclass(frozen=True)
class UnifiedBuffer:
    """One SoC generation's vector-core UB: its size and the part a Triton-Ascend kernel is planned in."""

    generation: str
    physical_bytes: int
    budget_bytes: int
    source: str


#: the UB of one AIV (vector) core per SoC generation
UNIFIED_BUFFERS: dict[str, UnifiedBuffer] = {
    "a2": UnifiedBuffer(
        "a2", 192 * KiB, 192 * KiB,
        "triton-ascend third_party/ascend/backend/runtime/utils.py (ub_size_in_kbytes = 192 for Ascend910B); "
        "triton-ascend#302 on 910B3: 'ub overflow, requires … while 1572864 bits available' (= 192 KiB)",
    ),
    "a3": UnifiedBuffer(
        "a3", 192 * KiB, 192 * KiB,
        "triton-ascend runtime/utils.py: Ascend910_93 keeps the 192 KiB default",
    ),
    "950": UnifiedBuffer(
        "950", 256 * KiB, 216 * KiB,
        "triton-ascend runtime/utils.py (ub_size_in_kbytes = 256 for Ascend910_95 / Ascend950); CANN "
        "GetRuntimeUBSize on 950PR/950DT: 248 KB for SIMD kernels, 216 KB where SIMD and SIMT mix "
        "(gathers may lower to SIMT), so the plan uses 216 KiB",
    ),
}

#: the budget a launch is planned in where the generation is unknown (the interpreter, another SoC)
SMALLEST_UB = min(UNIFIED_BUFFERS.values(), key=lambda ub: ub.budget_bytes)


def unified_buffer(device: torch.device) -> UnifiedBuffer:
    """The UB a launch on ``device`` is planned for: its NPU's generation's, else the smallest."""
    if device.type == "npu" and not interpreting():
        try:
            from .device import cached_soc
            from .npu import npu_namespace

            generation = cached_soc(npu_namespace(), device.index or 0).generation
        except Exception:
            generation = "other"
        if generation in UNIFIED_BUFFERS:
            return UNIFIED_BUFFERS[generation]
    return SMALLEST_UB


@dataclass(frozen=True)
class Tile:
    """One tile a kernel holds in UB: a tl.load'ed tile counts ``LOAD_BUFFERS`` times."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    loaded: bool = False

    @property
    def bytes(self) -> int:
        raw = math.prod(self.shape) * self.itemsize
        return -(-raw // UB_ALIGN) * UB_ALIGN * (LOAD_BUFFERS if self.loaded else 1)

    def describe(self) -> str:
        return f"{self.name}[{'×'.join(map(str, self.shape))}] {self.bytes / KiB:.1f} KiB"


@dataclass(frozen=True)
class TilePlan:
    """The block sizes of one launch and the UB its tiles take.

    The footprint is the sum of every tile in the kernel body, live or not, so
    it bounds what the compiler's memory planning (which reuses dead buffers)
    can allocate from above.
    """

    kernel: str
    shape: str
    blocks: dict[str, int]
    tiles: tuple[Tile, ...]
    ub: UnifiedBuffer

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.tiles)

    @property
    def fits(self) -> bool:
        return self.bytes <= self.ub.budget_bytes

    def describe(self) -> str:
        blocks = ", ".join(f"{k}={v}" for k, v in self.blocks.items())
        return f"{self.kernel} ({self.shape}): {self.bytes / KiB:.1f} KiB of {self.ub.budget_bytes // KiB} KiB ({blocks})"


class UbBudgetError(NotSupportedError):
    """A launch whose tiles cannot fit the vector core's UB even at the smallest blocks."""


def fit_blocks(
    kernel: str,
    shape: str,
    ub: UnifiedBuffer,
    start: dict[str, int],
    floors: dict[str, int],
    tiles: Callable[[dict[str, int]], tuple[Tile, ...]],
) -> TilePlan:
    """The largest blocks from ``start`` whose ``tiles`` fit ``ub``, halving the widest shrinkable block
    (never below its floor) until they do; the smallest plan when none fits (``require_fit`` refuses it)."""
    blocks = dict(start)
    while True:
        plan = TilePlan(kernel, shape, blocks, tiles(blocks), ub)
        shrinkable = [a for a, v in blocks.items() if v > floors.get(a, 1)]
        if plan.fits or not shrinkable:
            return plan
        axis = max(shrinkable, key=lambda a: blocks[a])
        blocks = {**blocks, axis: blocks[axis] // 2}


def require_fit(plan: TilePlan) -> TilePlan:
    """``plan`` when its tiles fit its UB budget; else a ``UbBudgetError`` that names the biggest tiles."""
    if plan.fits:
        return plan
    biggest = ", ".join(t.describe() for t in sorted(plan.tiles, key=lambda t: -t.bytes)[:3])
    blocks = ", ".join(f"{k}={v}" for k, v in plan.blocks.items())
    raise UbBudgetError(
        f"{plan.kernel} ({plan.shape}) does not fit the unified buffer of an Ascend {plan.ub.generation} vector core: "
        f"its tiles need {plan.bytes / KiB:.1f} KiB of {plan.ub.budget_bytes // KiB} KiB even at the smallest blocks "
        f"({blocks}); largest: {biggest}. Run the reference for it: {DISABLE_ENV}={plan.kernel}"
    )

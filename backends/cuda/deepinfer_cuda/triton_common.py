"""Pieces the matmul kernels share: the dtype ``tl.dot`` runs in, and how many programs fill the GPU.

``tl.dot`` takes 16-bit operands as they are (tensor cores, fp32 accumulation)
and fp32 operands with exact ``ieee`` products: TF32 would round them to 10
mantissa bits and miss fp32 tolerances. Under the interpreter every operand is
upcast to fp32 first, because the interpreter's bf16 ``tl.dot`` multiplies raw
bit patterns rather than values.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import interpreting

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

#: programs a split-K launch aims for under the interpreter (small, so small shapes still split)
_INTERPRETER_PROGRAMS = 4

#: programs per multiprocessor a split launch aims for on a GPU
PROGRAMS_PER_SM = 2


def dot_operands(dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """``(operand dtype, input_precision)`` for ``tl.dot`` on inputs of ``dtype`` (fp32, fp16 or bf16)."""
    if interpreting() or dtype == torch.float32:
        return tl.float32, "ieee"
    return _TL_DTYPES[dtype], "tf32"


def accumulator(dtype: torch.dtype) -> tl.dtype:
    """The dtype elementwise kernels accumulate in: fp64 for fp64 input (like the reference), fp32 otherwise."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """Programs one launch should offer to keep every multiprocessor busy: two per SM on a GPU."""
    if interpreting() or device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return PROGRAMS_PER_SM * _multiprocessors(torch.cuda.current_device() if device.index is None else device.index)


def programs_target(device: torch.device, invariant: bool) -> int:
    """``target_programs``, or 1 in batch-invariant mode: no reduction is then split to fill the device, so how
    a token's sums are cut never depends on how many tokens share the launch."""
    return 1 if invariant else target_programs(device)


def split_count(programs: int, length: int, chunk: int, target: int, max_splits: int = 32) -> int:
    """How many slices to cut a reduction of ``length`` into (each at least ``chunk`` long)
    so that ``programs`` programs per slice reach ``target`` programs (``target_programs`` of the
    device); 1 when already there. A pure function of sizes, so ``compile_check`` can ask what a
    GPU of a given size picks."""
    want = triton.cdiv(target, max(programs, 1))
    return max(1, min(want, triton.cdiv(length, chunk), max_splits))

"""Helpers shared by the reference kernels: the op marker and accumulation dtype."""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def op(fn: F) -> F:
    """Mark a ``Kernels`` method as an operation with an op spec."""
    fn._deepinfer_op = True  # type: ignore[attr-defined]
    return fn


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64 (the conformance oracle), everything else is fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32

"""Helpers shared by the reference kernels: the op marker and accumulation dtype."""

from __future__ import annotations

from typing import Callable, TypeVar, overload

import torch

F = TypeVar("F", bound=Callable)


@overload
def op(fn: F) -> F: ...
@overload
def op(*, rows: tuple[str, ...]) -> Callable[[F], F]: ...


def op(fn=None, *, rows: tuple[str, ...] = ()):
    """Mark a ``Kernels`` method as an operation with an op spec.

    ``rows`` names the arguments whose leading dimension is the op's row (a
    token, a sequence, a compressed entry); so does the leading dimension of
    each output. An op that names them promises batch invariance: with
    ``Kernels.set_batch_invariant(True)``, each output row is bitwise the same
    whatever the other rows of the call, their number and their order. The
    conformance suite checks exactly the ops that declare ``rows``.
    """

    def mark(f: F) -> F:
        f._deepinfer_op = True  # type: ignore[attr-defined]
        f._deepinfer_rows = tuple(rows)  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64 (the conformance oracle), everything else is fp32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32

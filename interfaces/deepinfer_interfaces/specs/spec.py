"""Op specs: each operation described once as data that every backend runs.

A spec generates cases (named keyword arguments in fp32 master form), says
which arguments take the dtype under test, and how outputs are compared. The
tolerance table below is the one place tolerances are set; a spec overrides it
only with a stated reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


#: Default tolerances per dtype under test (compared against an fp64/fp32 oracle).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),
}

#: An error above tolerance but within this factor of it is a quality warning, not a failure.
WARN_FACTOR = 4.0

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Case:
    """One input set: keyword arguments of the op, floats in fp32 master form."""

    name: str
    kwargs: dict[str, Any]


@dataclass
class OpSpec:
    """How to check one ``Kernels`` operation."""

    op: str
    cases: Callable[[], list[Case]]
    #: keyword arguments cast to the dtype under test (others keep their dtype)
    cast: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    #: compare outputs for exact equality (token ids, masks) instead of with tolerances
    exact: bool = False
    #: per-dtype overrides of ``TOLERANCES``; each needs ``tolerance_reason``, which the report carries
    tolerances: dict[torch.dtype, Tolerance] = field(default_factory=dict)
    tolerance_reason: str = ""
    #: turns ``(kwargs, result)`` into the tensor(s) compared; default: the result
    output: Callable[[dict[str, Any], Any], Any] | None = None
    #: the oracle runs in fp64 (True) or in fp32 when the op is defined by fp32 math
    fp64_oracle: bool = True

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return self.tolerances.get(dtype, TOLERANCES.get(dtype, TOLERANCES[torch.float32]))


SPECS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Add ``spec`` to the suite (one spec per op)."""
    if spec.op in SPECS:
        raise ValueError(f"op spec for {spec.op!r} registered twice")
    if spec.tolerances and not spec.tolerance_reason.strip():
        raise ValueError(f"op spec for {spec.op!r} overrides the tolerance table without a reason; set tolerance_reason")
    SPECS[spec.op] = spec
    return spec


def seeded(seed: int) -> torch.Generator:
    """A CPU generator for reproducible case inputs."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale

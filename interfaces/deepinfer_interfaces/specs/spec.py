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

#: Limits on the error statistic ``rms(got − expected) / rms(expected)`` of one output tensor, for the
#: specs of accumulation-sensitive ops. Rounding a correct result once to bf16 (fp16) costs about
#: 2^-9/sqrt(3) ≈ 1.1e-3 (2^-11/sqrt(3) ≈ 2.8e-4) and a 16-bit operand rounded between two matmuls as
#: much again; sums kept in bf16 over a long reduction cost several times that (docs/tolerances.md).
RMS_LIMITS: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.float16: 5e-4,
    torch.bfloat16: 4e-3,
}

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Case:
    """One input set: keyword arguments of the op, floats in fp32 master form."""

    name: str
    kwargs: dict[str, Any]
    #: the dtypes this case runs in (None: every dtype of its spec); for the costliest real-shape cases
    dtypes: tuple[torch.dtype, ...] | None = None
    #: an accumulation case: values and length chosen so that a sum the spec's ``accumulation`` rule keeps in
    #: fp32 misses by many times the tolerance when kept in 16 bits; judged with no quality-warning band
    #: (beyond tolerance fails)
    accumulation: bool = False


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
    #: per-dtype limits on the relative RMS error of each output (besides the per-element bound);
    #: each spec that sets them says why in ``rms_reason``, which docs/tolerances.md shows
    rms_limits: dict[torch.dtype, float] = field(default_factory=dict)
    rms_reason: str = ""
    #: the sums this op must keep in fp32 (fp64 for fp64 inputs) whatever the dtype under test, in words, where
    #: the model's numerics depend on them; its ``accumulation`` cases enforce it (docs/tolerances.md)
    accumulation: str = ""

    def tolerance(self, dtype: torch.dtype) -> Tolerance:
        return self.tolerances.get(dtype, TOLERANCES.get(dtype, TOLERANCES[torch.float32]))

    def rms_limit(self, dtype: torch.dtype) -> float | None:
        """The relative-RMS limit in ``dtype``, or None where the spec checks none."""
        return None if self.exact else self.rms_limits.get(dtype)


SPECS: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
    """Add ``spec`` to the suite (one spec per op)."""
    if spec.op in SPECS:
        raise ValueError(f"op spec for {spec.op!r} registered twice")
    if spec.tolerances and not spec.tolerance_reason.strip():
        raise ValueError(f"op spec for {spec.op!r} overrides the tolerance table without a reason; set tolerance_reason")
    if spec.rms_limits and not spec.rms_reason.strip():
        raise ValueError(f"op spec for {spec.op!r} sets relative-RMS limits without a reason; set rms_reason")
    if spec.accumulation.strip() and spec.exact:
        raise ValueError(f"op spec for {spec.op!r} states an accumulation rule but compares exactly; drop one")
    SPECS[spec.op] = spec
    return spec


def seeded(seed: int) -> torch.Generator:
    """A CPU generator for reproducible case inputs."""
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale

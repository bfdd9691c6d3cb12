"""Op parity: every op spec run on a backend's kernels against the reference oracle.

The oracle is the reference ``Kernels`` on the CPU with the inputs first rounded
to the dtype under test, then widened to fp64 (fp32 where the spec says the op
is defined by fp32 math), so only the backend's own arithmetic is measured.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_interfaces import Device, Kernels, NotSupportedError, PackedPool, QuantizedWeight
from deepinfer_interfaces.errors import first_line
from deepinfer_interfaces.features import Feature
from deepinfer_interfaces.version import declared_version
from deepinfer_interfaces.specs import SPECS, OpSpec

from .compare import compare
from .results import CaseResult

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}


@dataclass
class OpCaseResult(CaseResult):
    """An op parity result: a ``CaseResult`` with the relative RMS error and the spec's limit on it."""

    rms_rel_err: float | None = None
    rms_limit: float | None = None


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _map(value: Any, fn) -> Any:
    """``value`` with ``fn`` (a copy or a device move) applied to each tensor it holds."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (QuantizedWeight, PackedPool)):  # never cast: codes, scales and records are bytes
        return value.map(fn)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    return value


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """A ``cast`` argument in ``dtype``: its tensors rounded to it; a packed pool's records copied as they are,
    its rows read back in ``dtype`` (the codes of a packed cache do not depend on the dtype under test)."""
    if isinstance(value, PackedPool):
        return value.map(torch.clone, dtype)
    return _map(value, lambda t: t.to(dtype))


def _prepare(spec: OpSpec, kwargs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Round the cast arguments to ``dtype``; copy everything (ops may work in place)."""
    return {k: _cast(v, dtype) if k in spec.cast else _map(v, torch.clone) for k, v in kwargs.items()}


def override_note(spec: OpSpec, dtype: torch.dtype) -> str:
    """The report's note when ``spec`` overrides the tolerance table for ``dtype`` (else empty)."""
    if spec.exact or dtype not in spec.tolerances:
        return ""
    tol = spec.tolerances[dtype]
    return f"tolerance override atol={tol.atol:g} rtol={tol.rtol:g}: {spec.tolerance_reason}"


#: under ``--interpret`` the cases with more input elements than this (the real-shape ones) are reported
#: ``not_supported``: Triton's CPU interpreter runs them for many minutes; the device runs them in milliseconds
INTERPRET_MAX_ELEMENTS = 150_000
#: what the message of a case left out for that reason says
INTERPRET_LIMIT_NOTE = "run under Triton's interpreter"


def input_elements(kwargs: dict[str, Any]) -> int:
    """Elements in a case's tensor arguments (quantized weights counted by codes and scales, packed pools by record bytes)."""
    total = 0
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            total += value.numel()
        elif isinstance(value, QuantizedWeight):
            total += value.codes.numel() + value.scales.numel()
        elif isinstance(value, PackedPool):
            total += value.nbytes()
        elif isinstance(value, (list, tuple)):
            total += input_elements(dict(enumerate(value)))
    return total


def not_applicable_note(feature: Feature, declared: str | None) -> str:
    """Why a case of a feature newer than the kernel set's declared version is not checked."""
    return (f"{feature.name} arrived in contract {feature.since}; this kernel set declares {declared}, so the engine "
            f"runs the reference for it (declare interface_version {feature.since} or later, or list '{feature.name}' "
            "in extra_features, to have it checked)")


def selected_specs(patterns: list[str] | None) -> list[OpSpec]:
    """Specs whose op name matches any glob in ``patterns`` (all when none given)."""
    pats = patterns or ["*"]
    return [SPECS[name] for name in sorted(SPECS) if any(fnmatch.fnmatch(name, p) for p in pats)]


def run_spec(
    spec: OpSpec, kernels: Kernels, device: Device, reference: Kernels | None = None, max_elements: int | None = None,
    routed: tuple[Feature, ...] = (), declared: str | None = None,
) -> list[CaseResult]:
    """Every case of ``spec`` in every dtype it lists (``max_elements``: larger cases are not run; a case using
    one of the ``routed`` features, newer than the ``declared`` version, is ``not_applicable``)."""
    reference = reference or Kernels()
    supported = set(device.capabilities().dtypes)
    results: list[CaseResult] = []
    cases = spec.cases()
    target = device.torch_device
    for dtype in spec.dtypes:
        tol = None if spec.exact else spec.tolerance(dtype)
        tol_fields = {} if tol is None else {"atol": tol.atol, "rtol": tol.rtol}
        rms_limit = spec.rms_limit(dtype)
        override = override_note(spec, dtype)
        for case in cases:
            if case.dtypes is not None and dtype not in case.dtypes:
                continue
            base = OpCaseResult("ops", spec.op, case.name, dtype_name(dtype), "pass", **tol_fields, rms_limit=rms_limit)
            newer = next((f for f in routed if f.used_by(spec.op, case.kwargs)), None)
            if newer is not None:
                base.status, base.message = "not_applicable", not_applicable_note(newer, declared)
                results.append(base)
                continue
            if dtype not in supported:
                base.status, base.message = "not_supported", f"device does not support {dtype_name(dtype)}"
                results.append(base)
                continue
            size = input_elements(case.kwargs)
            if max_elements is not None and size > max_elements:
                base.status = "not_supported"
                base.message = (f"{size} input elements, above the {max_elements} {INTERPRET_LIMIT_NOTE}; "
                                "run it on the device, or raise --interpret-max-elements")
                results.append(base)
                continue
            rounded = _prepare(spec, case.kwargs, dtype)
            oracle_dtype = torch.float64 if spec.fp64_oracle else torch.float32
            oracle_in = {k: _cast(v, oracle_dtype) if k in spec.cast else _map(v, torch.clone) for k, v in rounded.items()}
            expected = getattr(reference, spec.op)(**oracle_in)
            if spec.output:
                expected = spec.output(oracle_in, expected)
            dev_in = {k: _map(v, lambda t: t.to(target)) for k, v in rounded.items()}
            try:
                got = getattr(kernels, spec.op)(**dev_in)
                if spec.output:
                    got = spec.output(dev_in, got)
                device.synchronize()
            except NotSupportedError as exc:
                base.status, base.message = "not_supported", str(exc).splitlines()[0] if str(exc) else "not supported"
                results.append(base)
                continue
            except Exception as exc:  # reported per case; the suite goes on
                base.status, base.message = "error", first_line(exc)
                results.append(base)
                continue
            try:
                cmp = compare(got, expected, tol, rms_limit, strict=case.accumulation)
            except Exception as exc:
                base.status, base.message = "error", first_line(exc)
                results.append(base)
                continue
            rule = f"accumulation case, no warning band: {spec.accumulation}" if case.accumulation and cmp.status == "fail" else ""
            base.status, base.message = cmp.status, "; ".join(m for m in (cmp.message, rule, override) if m)
            base.max_abs_err, base.max_rel_err, base.frac_out_of_tol = cmp.max_abs_err, cmp.max_rel_err, cmp.frac_out_of_tol
            base.rms_rel_err = cmp.rms_rel_err
            results.append(base)
    return results


def run_ops(
    kernels: Kernels, device: Device, patterns: list[str] | None = None, max_elements: int | None = None,
) -> list[CaseResult]:
    """Op parity over every selected spec, on the kernel set's conformance view; the cases of features newer
    than the set declares are ``not_applicable`` (the engine runs the reference for them)."""
    routed, declared = type(kernels).routed_features, declared_version(type(kernels), Kernels)
    kernels = kernels.for_conformance()
    reference = Kernels()
    out: list[CaseResult] = []
    for spec in selected_specs(patterns):
        out.extend(run_spec(spec, kernels, device, reference, max_elements, routed, declared))
    return out

"""Batch invariance: each op that promises it, run in batch-invariant mode over a batch, over single rows
(first, middle, last) alone, over the rows in chunks and in reverse order, compared bitwise; and the mode's batch result
against the same kernels' default mode, within the op's tolerance (the mode changes the order of sums,
not what is computed).

Which ops promise it, and which of their arguments carry the row, is the contract's own data
(``Kernels.batch_invariant_ops()``); the inputs are the op specs' cases. A case is reported once per
dtype as ``<case>_batch_invariance``: ``pass`` when every variant equals the batch bit for bit,
``fail`` naming the first variant and row that differ, ``not_supported`` when the kernel set refuses
the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_interfaces import Device, Kernels, NotSupportedError
from deepinfer_interfaces.errors import first_line
from deepinfer_interfaces.version import declared_version
from deepinfer_interfaces.specs import OpSpec

from .compare import compare
from .ops import INTERPRET_LIMIT_NOTE, _map, _prepare, dtype_name, input_elements, not_applicable_note, selected_specs
from .results import CaseResult

#: suffix of the case names this check reports
SUFFIX = "_batch_invariance"
#: rows run alone per case (the first, one in the middle, the last), so the check stays short on wide cases
ALONE_ROWS = 3
#: the first chunk's length in the chunked variant: three uneven pieces, as a prompt cut into chunks
CHUNK = 3
#: the dtypes checked (those of a case's spec among them): the bitwise question does not change with fp16
DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Variant:
    """One way to cut the batch: the calls, each over the rows it names (in the order it runs them)."""

    name: str
    calls: list[torch.Tensor]


def row_count(kwargs: dict[str, Any], rows: tuple[str, ...]) -> int | None:
    """The batch's row count: the leading dim of the first row argument present."""
    for name in rows:
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


def _take(kwargs: dict[str, Any], rows: tuple[str, ...], index: torch.Tensor) -> dict[str, Any]:
    """A copy of ``kwargs`` with each row argument cut to the rows ``index`` names."""
    out = {}
    for name, value in kwargs.items():
        if name in rows and isinstance(value, torch.Tensor) and value.dim() > 0:
            out[name] = value[index.to(value.device)].clone()
        else:
            out[name] = _map(value, torch.clone)
    return out


def _outputs(result: Any) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else [r for r in result if isinstance(r, torch.Tensor)]


def variants(n: int) -> list[Variant]:
    """Rows alone (``ALONE_ROWS`` of them, spread), the rows in three uneven chunks, the rows reversed."""
    picks = sorted({round(i * (n - 1) / max(ALONE_ROWS - 1, 1)) for i in range(min(n, ALONE_ROWS))})
    rows = torch.arange(n)
    first, last = min(CHUNK, n - 1), max(min(CHUNK, n - 1), n - 2)
    chunks = [c for c in (rows[:first], rows[first:last], rows[last:]) if c.numel()]
    return [
        Variant("alone", [rows[i : i + 1] for i in picks]),
        Variant("in chunks", chunks),
        Variant("reversed", [rows.flip(0)]),
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().reshape(-1).contiguous().view(torch.uint8)


def _differs(got: list[torch.Tensor], want: list[torch.Tensor]) -> float | None:
    """None when every output is bitwise equal (NaNs and signed zeros included), else the largest difference."""
    worst = None
    for g, w in zip(got, want):
        if g.shape == w.shape and g.dtype == w.dtype and torch.equal(_bits(g), _bits(w)):
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            return float("inf")
        gap = (g.cpu().double() - w.cpu().double()).abs().nan_to_num(nan=float("inf")).max().item()
        worst = gap if worst is None else max(worst, gap)
    return worst


def check_case(
    kernels: Kernels, spec: OpSpec, dtype: torch.dtype, rows: tuple[str, ...], kwargs: dict[str, Any], device: Device,
) -> tuple[str, float | None]:
    """``(message, largest difference)`` of one prepared case, ``kernels`` in batch-invariant mode: an empty
    message when every variant is bitwise equal and the batch agrees with the default mode."""
    fn = getattr(kernels, spec.op)
    n = row_count(kwargs, rows)
    full = [o.cpu() for o in _outputs(fn(**_take(kwargs, rows, torch.arange(n))))]
    device.synchronize()
    kernels.set_batch_invariant(False)
    try:
        plain = [o.cpu() for o in _outputs(fn(**_take(kwargs, rows, torch.arange(n))))]
    finally:
        kernels.set_batch_invariant(True)
    agree = compare(full, plain, None if spec.exact else spec.tolerance(dtype))
    if agree.status == "fail":
        return f"the batch in this mode is out of tolerance of the default mode: {agree.message}", agree.max_abs_err
    for variant in variants(n):
        for index in variant.calls:
            got = _outputs(fn(**_take(kwargs, rows, index)))
            want = [o[index] for o in full]
            gap = _differs(got, want)
            if gap is not None:
                first = int(index[0])
                where = f"row {first}" if index.numel() == 1 else f"rows {first}..{int(index[-1])}"
                return f"not batch-invariant: {where} {variant.name} differs from the batch by up to {gap:.3g}", gap
    return "", None


def run_invariance(spec: OpSpec, kernels: Kernels, device: Device, max_elements: int | None = None) -> list[CaseResult]:
    """The batch-invariance results of ``spec``'s op (none when the op makes no such promise)."""
    rows = Kernels.batch_invariant_ops().get(spec.op)
    if not rows:
        return []
    supported = set(device.capabilities().dtypes)
    previous = kernels.batch_invariant
    refusal = None
    try:
        kernels.set_batch_invariant(True)
    except NotSupportedError as exc:
        refusal = first_line(exc).removeprefix("NotSupportedError: ") or "batch-invariant mode not supported"
    results: list[CaseResult] = []
    try:
        cases = spec.cases()
        for dtype in (d for d in spec.dtypes if d in DTYPES):
            for case in cases:
                if case.dtypes is not None and dtype not in case.dtypes:
                    continue
                n = row_count(case.kwargs, rows)
                if n is None or n < 2:
                    continue  # one row or none: nothing to be invariant to
                res = CaseResult("ops", spec.op, case.name + SUFFIX, dtype_name(dtype), "pass", atol=0.0, rtol=0.0)
                results.append(res)
                size = input_elements(case.kwargs)
                if refusal is not None:
                    res.status, res.message = "not_supported", refusal
                elif dtype not in supported:
                    res.status, res.message = "not_supported", f"device does not support {dtype_name(dtype)}"
                elif max_elements is not None and size > max_elements:
                    res.status = "not_supported"
                    res.message = f"{size} input elements, above the {max_elements} {INTERPRET_LIMIT_NOTE}"
                else:
                    prepared = {k: _map(v, lambda t: t.to(device.torch_device)) for k, v in _prepare(spec, case.kwargs, dtype).items()}
                    try:
                        message, gap = check_case(kernels, spec, dtype, rows, prepared, device)
                    except NotSupportedError as exc:
                        res.status, res.message = "not_supported", first_line(exc)
                        continue
                    except Exception as exc:  # reported per case; the suite goes on
                        res.status, res.message = "error", first_line(exc)
                        continue
                    if message:
                        res.status, res.message, res.max_abs_err = "fail", message, gap
                    else:
                        res.max_abs_err = 0.0
    finally:
        if refusal is None:
            kernels.set_batch_invariant(previous)
    return results


def run_invariance_suite(
    kernels: Kernels, device: Device, patterns: list[str] | None = None, max_elements: int | None = None,
) -> list[CaseResult]:
    """The batch-invariance cases of every selected op that promises it, on the kernel set's conformance view.

    A kernel set written before the switch (it declares a contract older than the feature and does not
    list it as implemented) has its cases listed ``not_applicable``: the engine runs the reference for it
    in that mode.
    """
    newer_mode = next((f for f in type(kernels).routed_features if f.mode == "batch_invariant"), None)
    declared = declared_version(type(kernels), Kernels)
    kernels = kernels.for_conformance()
    out: list[CaseResult] = []
    for spec in selected_specs(patterns):
        # a set written before the switch: its cases are listed, none is run (no case has fewer than -1 elements)
        results = run_invariance(spec, kernels, device, max_elements if newer_mode is None else -1)
        for result in results if newer_mode is not None else ():
            result.status, result.message = "not_applicable", not_applicable_note(newer_mode, declared)
        out.extend(results)
    return out

"""Comparing a backend's output with the oracle's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_interfaces.specs import WARN_FACTOR, Tolerance


#: outputs smaller than this are judged by the per-element bound alone (their RMS is one or two roundings)
RMS_MIN_ELEMENTS = 2048


@dataclass
class Comparison:
    status: str
    max_abs_err: float
    max_rel_err: float
    frac_out_of_tol: float
    message: str = ""
    #: the largest ``rms_rel_err`` over the float outputs (None: compared exactly, or nothing to measure)
    rms_rel_err: float | None = None


def rms_rel_err(got: torch.Tensor, expected: torch.Tensor, floor: float) -> float:
    """``rms(got − expected) / max(rms(expected), floor)`` over the finite expected elements.

    An average, unlike the per-element bound: rounding errors of a correct kernel
    stay near one rounding of the output, while sums kept in a 16-bit dtype over a
    long reduction lift it by the square root of the number of roundings.
    """
    g64, e64 = got.double(), expected.double()
    finite = torch.isfinite(e64)
    if not bool(finite.any()):
        return 0.0
    diff = torch.nan_to_num((g64 - e64)[finite], nan=float("inf"), posinf=float("inf"), neginf=float("inf"))
    ref_rms = float(e64[finite].pow(2).mean().sqrt())
    return float(diff.pow(2).mean().sqrt()) / max(ref_rms, floor)


def _flatten(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    raise TypeError(f"op returned {type(out).__name__}, expected tensors")


def compare(
    got: Any, expected: Any, tol: Tolerance | None, rms_limit: float | None = None, strict: bool = False,
) -> Comparison:
    """Compare outputs exactly (``tol`` None) or within ``atol + rtol·|expected|``.

    Non-finite expected values (masked logits) must be matched exactly in both modes.
    With tolerances, each float output's ``rms_rel_err`` is measured too; above
    ``rms_limit`` (when given) the case fails whatever the per-element bound said.
    ``strict`` (an accumulation case) fails any element beyond tolerance, with no
    quality-warning band.
    """
    gots, exps = _flatten(got), _flatten(expected)
    if len(gots) != len(exps):
        return Comparison("fail", float("inf"), float("inf"), 1.0, f"returned {len(gots)} tensors, expected {len(exps)}")
    worst_abs = worst_rel = 0.0
    worst_rms: float | None = None
    bad = total = 0
    status = "pass"
    for i, (g, e) in enumerate(zip(gots, exps)):
        if tuple(g.shape) != tuple(e.shape):
            return Comparison("fail", float("inf"), float("inf"), 1.0, f"output {i} has shape {tuple(g.shape)}, expected {tuple(e.shape)}")
        g = g.detach().cpu()
        e = e.detach().cpu()
        total += e.numel()
        if e.numel() == 0:
            continue
        if tol is None or not e.is_floating_point():
            mismatch = g.to(e.dtype) != e
            if e.is_floating_point():
                mismatch &= ~(torch.isnan(g.to(e.dtype)) & torch.isnan(e))
            n = int(mismatch.sum())
            if n:
                bad += n
                status = "fail"
                diff = (g.double() - e.double()).abs()
                worst_abs = max(worst_abs, float(torch.nan_to_num(diff[mismatch], nan=float("inf")).max()))
            continue
        g64, e64 = g.double(), e.double()
        finite = torch.isfinite(e64)
        nonfinite_bad = (~finite) & (g64 != e64) & ~(torch.isnan(g64) & torch.isnan(e64))
        diff = torch.where(finite, (g64 - e64).abs(), torch.zeros_like(e64))
        diff = torch.nan_to_num(diff, nan=float("inf"))
        bound = tol.atol + tol.rtol * e64.abs()
        out = (diff > bound) | nonfinite_bad
        bad += int(out.sum())
        worst_abs = max(worst_abs, float(diff.max()), float("inf") if bool(nonfinite_bad.any()) else 0.0)
        rel = diff / e64.abs().clamp(min=tol.atol)
        worst_rel = max(worst_rel, float(rel.max()))
        if e.numel() >= RMS_MIN_ELEMENTS:  # a handful of elements says nothing about accumulation
            worst_rms = max(worst_rms or 0.0, rms_rel_err(g, e, tol.atol))
        if bool(out.any()):
            within_warn = not strict and bool(((diff <= WARN_FACTOR * bound) & ~nonfinite_bad).all())
            if within_warn and status == "pass":
                status = "warn"
            elif not within_warn:
                status = "fail"
    frac = bad / total if total else 0.0
    notes = [] if status == "pass" else [f"{bad} of {total} elements out of tolerance"]
    if rms_limit is not None and worst_rms is not None and worst_rms > rms_limit:
        status = "fail"
        notes.append(f"relative RMS error {worst_rms:.2e} above the limit {rms_limit:g}")
    return Comparison(status, worst_abs, worst_rel, frac, "; ".join(notes), worst_rms)

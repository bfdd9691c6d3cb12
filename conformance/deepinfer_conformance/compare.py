"""Comparing a backend's output with the oracle's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deepinfer_interfaces.specs import WARN_FACTOR, Tolerance


@dataclass
class Comparison:
    status: str
    max_abs_err: float
    max_rel_err: float
    frac_out_of_tol: float
    message: str = ""


def _flatten(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    raise TypeError(f"op returned {type(out).__name__}, expected tensors")


def compare(got: Any, expected: Any, tol: Tolerance | None) -> Comparison:
    """Compare outputs exactly (``tol`` None) or within ``atol + rtol·|expected|``.

    Non-finite expected values (masked logits) must be matched exactly in both modes.
    """
    gots, exps = _flatten(got), _flatten(expected)
    if len(gots) != len(exps):
        return Comparison("fail", float("inf"), float("inf"), 1.0, f"returned {len(gots)} tensors, expected {len(exps)}")
    worst_abs = worst_rel = 0.0
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
        if bool(out.any()):
            within_warn = bool(((diff <= WARN_FACTOR * bound) & ~nonfinite_bad).all())
            if within_warn and status == "pass":
                status = "warn"
            elif not within_warn:
                status = "fail"
    frac = bad / total if total else 0.0
    message = "" if status == "pass" else f"{bad} of {total} elements out of tolerance"
    return Comparison(status, worst_abs, worst_rel, frac, message)

"""Tolerances: the documented table matches the code, and an override carries its reason into the report."""

from pathlib import Path

import pytest
import torch

from deepinfer_conformance.ops import run_spec
from deepinfer_conformance.tolerances import render
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.specs import SPECS, Case, OpSpec, Tolerance, register

DOC = Path(__file__).resolve().parents[2] / "docs" / "tolerances.md"
BEGIN = "<!-- BEGIN GENERATED: python -m deepinfer_conformance.tolerances -->\n"
END = "<!-- END GENERATED -->"


def test_doc_table_is_the_generated_one():
    text = DOC.read_text()
    generated = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert generated == render(), "docs/tolerances.md is stale: paste the output of `python -m deepinfer_conformance.tolerances`"


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(0)
    return [Case("t4_d16", dict(x=torch.randn(4, 16, generator=g), weight=None, eps=1e-6))]


class _ScaledFp16(Kernels):
    def rms_norm(self, x, weight, eps):
        out = super().rms_norm(x, weight, eps)
        return out * (1 + 3e-3) if out.dtype == torch.float16 else out


def test_override_applies_and_its_reason_is_reported():
    spec = OpSpec(
        op="rms_norm", cases=_cases, cast=("x",), dtypes=(torch.float32, torch.float16),
        tolerances={torch.float16: Tolerance(atol=1e-2, rtol=1e-2)},
        tolerance_reason="a vendor's fp16 norm rounds its reciprocal early",
    )
    rows = {r.dtype: r for r in run_spec(spec, _ScaledFp16(), CPUDevice())}
    assert rows["float16"].status == "pass" and (rows["float16"].atol, rows["float16"].rtol) == (1e-2, 1e-2)
    assert rows["float16"].message == "tolerance override atol=0.01 rtol=0.01: a vendor's fp16 norm rounds its reciprocal early"
    assert rows["float32"].message == "" and rows["float32"].atol == 1e-5
    plain = OpSpec(op="rms_norm", cases=_cases, cast=("x",), dtypes=(torch.float16,))
    assert run_spec(plain, _ScaledFp16(), CPUDevice())[0].status in ("warn", "fail")


def test_override_without_reason_is_refused():
    spec = OpSpec(op="not_an_op_yet", cases=_cases, cast=("x",), tolerances={torch.float16: Tolerance(1e-2, 1e-2)})
    with pytest.raises(ValueError, match="without a reason"):
        register(spec)
    assert "not_an_op_yet" not in SPECS


def test_runner_reports_fraction_out_of_tolerance():
    spec = OpSpec(op="rms_norm", cases=_cases, cast=("x",), dtypes=(torch.float16,))
    row = run_spec(spec, _ScaledFp16(), CPUDevice())[0]
    assert 0 < row.frac_out_of_tol <= 1 and row.max_abs_err > 0

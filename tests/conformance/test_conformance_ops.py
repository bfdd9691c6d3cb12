"""The op-parity runner: passes the reference, fails a wrong kernel set on exactly the op it breaks."""

import json
import xml.etree.ElementTree as ET

import torch

from deepinfer_conformance.ops import input_elements, run_ops, run_spec
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.specs import FLOAT_DTYPES, SPECS, OpSpec
from tests.helpers.plugins import make_plugin_dist, run_cli

MUTANT = {
    "deepinfer_test_mutant": """
        import torch
        from deepinfer_interfaces import INTERFACE_VERSION, Kernels

        class NoEpsKernels(Kernels):
            name = "mutant-eps"
            interface_version = INTERFACE_VERSION
            def rms_norm(self, x, weight, eps):
                return super().rms_norm(x, weight, 0.0)

        class SlightlyOffKernels(Kernels):
            name = "slightly-off"
            interface_version = INTERFACE_VERSION
            def rope(self, x, cos, sin, inverse=False):
                out = super().rope(x, cos, sin, inverse)
                return out + 2e-5 if out.dtype == torch.float32 else out
    """
}


def _plugins(tmp_path):
    return make_plugin_dist(
        tmp_path,
        "mutant-kernels",
        {"deepinfer.kernels": {"mutant-eps": "deepinfer_test_mutant:NoEpsKernels", "slightly-off": "deepinfer_test_mutant:SlightlyOffKernels"}},
        MUTANT,
    )


def test_reference_passes_every_spec():
    results = run_ops(Kernels(), CPUDevice())
    assert {r.op for r in results} == set(SPECS)
    assert all(r.status == "pass" for r in results), [r for r in results if r.status != "pass"]


def test_cli_reports_and_exit_status(tmp_path):
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    proc = run_cli(["conformance", "--backend", "cpu", "--report", str(report), "--junit", str(junit)])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(report.read_text())
    assert {"backend", "kernels", "reference", "environment", "summary", "results"} <= set(data)
    assert data["summary"]["fail"] == 0 and data["summary"]["pass"] == len(data["results"]) > 0
    row = data["results"][0]
    assert {"op", "case", "dtype", "status", "max_abs_err", "max_rel_err", "atol", "rtol", "message"} <= set(row)
    root = ET.parse(junit).getroot()
    assert sum(int(s.get("tests")) for s in root.iter("testsuite")) == len(data["results"])
    assert "total: pass" in proc.stdout


def test_eps_ignoring_rms_norm_fails_only_that_op(tmp_path):
    report = tmp_path / "r.json"
    proc = run_cli(["conformance", "--backend", "cpu", "--kernels", "mutant-eps", "--suite", "ops", "--report", str(report)],
                   extra_path=_plugins(tmp_path))
    assert proc.returncode == 1
    results = json.loads(report.read_text())["results"]
    failing_ops = {r["op"] for r in results if r["status"] == "fail"}
    assert failing_ops == {"rms_norm"}
    assert any(r["case"] == "tiny_values_eps_dominates" and r["status"] == "fail" for r in results)
    assert "FAIL: ops.rms_norm" in proc.stdout


def test_small_excess_is_a_quality_warning_not_a_failure(tmp_path):
    report = tmp_path / "r.json"
    proc = run_cli(["conformance", "--kernels", "slightly-off", "--suite", "ops", "--ops", "rope", "--report", str(report)],
                   extra_path=_plugins(tmp_path))
    assert proc.returncode == 0, proc.stdout
    rows = json.loads(report.read_text())["results"]
    assert {r["status"] for r in rows if r["dtype"] == "float32" and r["case"] != "empty_batch"} == {"warn"}


def test_ops_glob_selects(tmp_path):
    report = tmp_path / "r.json"
    proc = run_cli(["conformance", "--backend", "cpu", "--ops", "r[mo]*", "--report", str(report)])
    assert proc.returncode == 0
    assert {r["op"] for r in json.loads(report.read_text())["results"]} == {"rms_norm", "rope"}


def test_packed_pools_reach_the_kernels_as_records_read_in_the_dtype_under_test():
    """A packed pool's uint8 records are copied (never cast) for each run; its rows decode in the dtype under test."""
    seen = []

    class Recording(Kernels):
        def cache_write(self, pool, slots, values):
            seen.append((pool.dtype, {r.data.dtype for r in pool.regions}, values.dtype))
            super().cache_write(pool, slots, values)

    spec = SPECS["cache_write"]
    case = next(c for c in spec.cases() if c.name == "packed_v41_d512_entries_and_window")
    pool = case.kwargs["pool"]
    before = [t.clone() for t in pool.tensors()]
    rows = run_spec(OpSpec(**{**vars(spec), "cases": lambda: [case]}), Recording(), CPUDevice())
    assert [r.status for r in rows] == ["pass"] * len(FLOAT_DTYPES)
    assert seen == [(dtype, {torch.uint8}, dtype) for dtype in FLOAT_DTYPES]
    assert all(torch.equal(a, b) for a, b in zip(before, pool.tensors())), "the case's own pool was written"
    assert input_elements(case.kwargs) == pool.nbytes() + case.kwargs["slots"].numel() + case.kwargs["values"].numel()

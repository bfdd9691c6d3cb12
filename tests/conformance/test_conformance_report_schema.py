"""The documented report shape (``report.schema.json``, shipped in the package) holds for real reports.

The full run here is the acceptance check: ``deepinfer conformance --backend cpu
--suite ops,comm,e2e --model <tiny>`` passes, and its JSON report validates.
"""

import json
import xml.etree.ElementTree as ET
from importlib import resources

import jsonschema
import pytest

from deepinfer_conformance.report import build_report, write_json
from deepinfer_conformance.results import CaseResult
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.plugins import run_cli


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(resources.files("deepinfer_conformance").joinpath("report.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.slow
def test_full_cpu_run_passes_and_its_reports_validate(tmp_path, validator):
    model = make_tiny_checkpoint(tmp_path, "mixed")
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    proc = run_cli([
        "conformance", "--backend", "cpu", "--suite", "ops,comm,e2e", "--model", str(model),
        "--report", str(report), "--junit", str(junit),
    ], env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    validator.validate(data)
    assert {r["suite"] for r in data["results"]} == {"ops", "comm", "e2e"}
    assert data["summary"]["fail"] == data["summary"]["error"] == 0
    assert data["e2e"]["dtype"] == "float32" and data["e2e"]["model"] == str(model)
    suites = {s.get("name"): int(s.get("tests")) for s in ET.parse(junit).getroot().iter("testsuite")}
    e2e = [r for r in data["results"] if r["suite"] == "e2e"]
    assert suites["e2e"] == len(e2e) > len(data["e2e"]["prompts"]) and sum(suites.values()) == len(data["results"])


def test_every_status_and_infinite_errors_validate(tmp_path, validator):
    rows = [
        CaseResult("ops", "rope", "c", "float32", "pass", 0.0, 0.0, 0.0, 1e-5, 1e-5),
        CaseResult("ops", "rope", "shape", "bfloat16", "fail", float("inf"), float("inf"), 1.0, 1.6e-2, 1.6e-2, "output 0 has shape (2,)"),
        CaseResult("ops", "sample", "c", "float32", "warn", 1.0, None, 0.5, None, None, "x"),
        CaseResult("comm", "dispatch", "world2_x", "float32", "error", message="rank 1: timed out"),
        CaseResult("e2e", "greedy", "prose", "bfloat16", "not_supported", message="device has no bf16"),
    ]
    path = tmp_path / "r.json"
    write_json(build_report("cpu", "reference", rows, e2e={"model": "m", "dtype": "bfloat16", "max_new_tokens": 3, "prompts": {"prose": "a"}}), str(path))
    validator.validate(json.loads(path.read_text()))


def test_schema_rejects_what_the_report_never_writes(validator):
    good = build_report("cpu", "reference", [CaseResult("ops", "rope", "c", "float32", "pass")])
    validator.validate(good)
    bad_status = json.loads(json.dumps(good))
    bad_status["results"][0]["status"] = "ok"
    missing = json.loads(json.dumps(good))
    del missing["results"][0]["message"]
    for bad in (bad_status, missing):
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(bad)

"""The vendor template installs with pip as a real distribution and passes conformance."""

import json
import subprocess
import sys

import pytest

from tests.helpers.plugins import run_cli

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(ROOT / "examples" / "vendor-plugin")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return target


def test_example_is_discovered_with_its_overrides(installed):
    proc = run_cli(["backends", "--json"], extra_path=installed)
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    ex = rows["example"]
    assert ex["available"] and ex["package"] == "deepinfer-vendor-example"
    assert set(ex["overrides"]) == {"rms_norm", "rope", "apply_token_bitmask"}


def test_example_passes_conformance(installed, tmp_path):
    report = tmp_path / "r.json"
    proc = run_cli(["conformance", "--backend", "example", "--suite", "ops,e2e", "--report", str(report)], extra_path=installed)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["backend"] == "example" and data["summary"]["fail"] == 0 and data["summary"]["error"] == 0
    assert {r["suite"] for r in data["results"]} == {"ops", "e2e"}  # e2e on the bundled model

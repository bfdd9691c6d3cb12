"""A device run selects its backend's tests by marker: ``-m cuda`` picks exactly tests/backends/cuda."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("marker", ["cuda", "ascend"])
def test_a_backend_marker_selects_its_folder(marker):
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker, "tests/backends", "tests/kernels"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert ids and all(i.startswith(f"tests/backends/{marker}/") for i in ids)
    folder = sorted((ROOT / "tests" / "backends" / marker).glob("test_*.py"))
    assert {i.split("::")[0] for i in ids} == {p.relative_to(ROOT).as_posix() for p in folder}

"""The per-vendor bring-up scripts stop cleanly, with the reason and exit status 2, on a machine without the device."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("script,reason", [
    ("ascend_check.sh", "ascend_check: no usable NPU"),
    ("cuda_check.sh", "cuda_check: no usable CUDA device"),
])
def test_bring_up_script_without_the_device_exits_2_with_the_reason(script, reason):
    try:
        import torch
    except ImportError:  # pragma: no cover - the suite always has torch
        pytest.skip("torch is not installed")
    if torch.cuda.is_available() or hasattr(torch, "npu"):
        pytest.skip("a device is present: the script would run its checks")
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert reason in proc.stderr and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    bad = subprocess.run(["bash", str(ROOT / "benchmarks" / script), "--bogus"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr

"""Running test scripts in a fresh Python: where Triton's interpreter must be chosen before Triton's first
import, or a stand-in module must be on the path, and the comparison those scripts share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: variables of the caller's environment that would change which backend or path a script takes
_CLEARED = ("TRITON_INTERPRET", "DEEPINFER_BACKEND", "DEEPINFER_ASCEND_DISABLE", "ASCEND_RT_VISIBLE_DEVICES")


def run_python(args: list[str], *, interpret: bool = False, extra_path: Path | None = None, env: dict | None = None,
               timeout: float = 180) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root, one OpenMP thread, ``TRITON_INTERPRET=1`` with ``interpret``."""
    full = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    full["OMP_NUM_THREADS"] = "1"
    if interpret:
        full["TRITON_INTERPRET"] = "1"
    if extra_path is not None:
        full["PYTHONPATH"] = os.pathsep.join([str(extra_path), str(ROOT), full.get("PYTHONPATH", "")])
    full.update(env or {})
    return subprocess.run([sys.executable, *args], env=full, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def assert_close(a, b, tol: float = 2e-5) -> None:
    """``a`` (a tensor or tuple of them) equals ``b`` within ``tol`` relative to ``1 + |b|``, infinities matching."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape, x.dtype, y.dtype)
        both_inf = x.isinf() & y.isinf() & (x == y)
        err = ((x.double() - y.double()).abs() / (1 + y.double().abs()))[~both_inf].max().item()
        assert err <= tol, err

"""benchmarks/serve_load.py end to end at tiny settings: it starts a server, loads it at two concurrency levels through
the raw and the openai clients, stops it, and its --json line has positive throughputs and latencies at every level
and client and the added latency at 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_serve_load_tiny_run_reports_every_level():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--concurrency", "1,2", "--requests", "4", "--repeat", "1",
         "--max-output", "8", "--clients", "raw,openai", "--no-startup", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    levels = figures["levels"]
    assert [(lv["concurrency"], lv["client"]) for lv in levels] == [(1, "raw"), (1, "openai"), (2, "raw"), (2, "openai")]
    for lv in levels:
        assert lv["requests"] == 4
        for key in ("server_tokens_per_s", "offline_tokens_per_s", "ratio", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            assert lv[key] > 0, (key, lv)
        assert lv["ttft_p99_ms"] >= lv["ttft_p50_ms"] and lv["itl_p99_ms"] >= lv["itl_p50_ms"]
    added = figures["added_latency"]
    assert added["requests"] == 4 and added["server_e2e_ms"] > 0 and added["offline_e2e_ms"] > 0

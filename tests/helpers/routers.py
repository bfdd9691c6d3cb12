"""The routers the field runs (``vllm-router``, ``sglang-router`` from PyPI) as real processes for tests and
benchmarks: started on a free port, waited for until they route a completion, always stopped (the process group).

- ``routing(command, log)``: any router command line (``--port`` and ``--prometheus-port`` are added).
- ``router(kind, workers, policy, log)``: a ``vllm`` or ``sglang`` router over colocated workers.
- ``vllm_router_command`` / ``sglang_router_command``: the start of either's command line, from this environment.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.helpers.servers import free_port

#: seconds a router may take to register its workers and route a first completion
READY_TIMEOUT_S = 180.0


def vllm_router_command() -> list[str]:
    """vLLM's router, from this environment."""
    return [shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or "vllm-router"]


def sglang_router_command() -> list[str]:
    """SGLang's router, from this environment."""
    return [sys.executable, "-m", "sglang_router.launch_router"]


def wait_routing(proc: subprocess.Popen, url: str, log: Path, timeout_s: float, model: str = "tiny-v4") -> None:
    """Until the router at ``url`` routes a one-token completion; fails when ``proc`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"the router exited: {log.read_text(errors='replace')[-2000:]}"
        try:
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}, timeout=60)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the router never routed: {log.read_text(errors='replace')[-2000:]}"
        time.sleep(1)


@contextmanager
def routing(command: list[str], log: Path) -> Iterator[str]:
    """The router ``command`` on a free port once it routes a completion; its URL. Stopped on exit, failure too."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([*command, "--port", str(port), "--prometheus-port", str(free_port())], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "NO_COLOR": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_routing(proc, url, log, READY_TIMEOUT_S)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@contextmanager
def router(kind: str, workers: list[str], policy: str, log: Path) -> Iterator[str]:
    """A ``vllm`` or ``sglang`` router with ``policy`` over colocated ``workers``; its URL."""
    start = vllm_router_command() if kind == "vllm" else sglang_router_command()
    with routing([*start, "--worker-urls", *workers, "--policy", policy, "--worker-startup-timeout-secs", "120"], log) as url:
        yield url

"""Communicator conformance: every verb run by N real processes on 127.0.0.1.

Each world size starts its processes once (``comm_worker``) and runs every case of
``comm_cases`` in them; each rank builds the backend's communicator through the
plugin registry and checks its own result against the single-process computation.
A case passes when every rank passes it. A world that does not finish within the
timeout is stopped and its unfinished cases are reported as errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from deepinfer_interfaces import Communicator
from deepinfer_interfaces.distributed import free_local_port

from .comm_cases import CommCase, comm_cases
from .results import CaseResult

_SEVERITY = {"pass": 0, "fail": 1, "error": 2}


def class_path(cls: type) -> str:
    """``module:qualname`` for a class a fresh process can import."""
    if "<locals>" in cls.__qualname__ or cls.__module__ == "__main__":
        raise ValueError(
            f"communicator class {cls.__qualname__} must be defined at the top level of an importable module "
            "(the suite's processes import it by name)"
        )
    return f"{cls.__module__}:{cls.__qualname__}"


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def _read_reports(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except OSError:
        return []


def run_world(
    world: int, backend: str = "cpu", kernels: str | None = None, interpret: bool = False,
    communicator_cls: type[Communicator] | None = None, timeout: float = 60.0,
) -> list[CaseResult]:
    """Every communicator case in one world of ``world`` processes."""
    cases = comm_cases(world)
    cfg = {
        "world": world, "backend": backend, "kernels": kernels, "interpret": interpret,
        "communicator": class_path(communicator_cls) if communicator_cls is not None else None,
        "init_method": f"tcp://127.0.0.1:{free_local_port()}", "sys_path": sys.path,
    }
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="deepinfer-comm-") as scratch:
        cfg["scratch"] = scratch
        cfg_path = os.path.join(scratch, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        procs = []
        for r in range(world):
            with open(os.path.join(scratch, f"rank{r}.log"), "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "deepinfer_conformance.comm_worker", str(r), cfg_path],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                ))
        deadline = time.monotonic() + timeout
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        verdicts: dict[int, dict[int, tuple[str, str]]] = {i: {} for i in range(len(cases))}
        stopped: dict[int, str] = {}
        for r, p in enumerate(procs):
            reports = _read_reports(os.path.join(scratch, f"rank{r}.jsonl"))
            for rep in reports:
                if isinstance(rep["case"], int):
                    verdicts[rep["case"]][r] = (rep["status"], rep["message"])
                elif rep["case"] == "fatal":
                    stopped[r] = rep["message"]
            if r in stopped or any(rep["case"] == "done" for rep in reports):
                continue
            if timed_out and p.returncode == -9:
                stopped[r] = f"timed out after {timeout:g} s (a collective hung in this case or an earlier one)"
            else:
                tail = _last_line(os.path.join(scratch, f"rank{r}.log"))
                stopped[r] = f"process exited with code {p.returncode}" + (f": {tail}" if tail else "")
    return [_merge(world, case, verdicts[i], stopped) for i, case in enumerate(cases)]


def _merge(world: int, case: CommCase, by_rank: dict[int, tuple[str, str]], stopped: dict[int, str]) -> CaseResult:
    """One case's result from every rank's verdict: the worst status, with that rank's reason."""
    result = CaseResult("comm", case.op, f"world{world}_{case.name}", case.dtype, "pass")
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        r = missing[0]
        result.status = "error"
        result.message = f"rank(s) {missing} reported nothing: rank {r}: {stopped.get(r, 'no report')}"
        return result
    worst = max(range(world), key=lambda r: (_SEVERITY.get(by_rank[r][0], 2), -r))
    status, message = by_rank[worst]
    if status != "pass":
        result.status, result.message = status, f"rank {worst}: {message}"
    return result


def run_comm(
    backend: str = "cpu", kernels: str | None = None, interpret: bool = False,
    communicator_cls: type[Communicator] | None = None, world_sizes: tuple[int, ...] = (2, 4),
    timeout: float = 60.0,
) -> list[CaseResult]:
    """The communicator suite on ``backend`` with its registry communicator, or ``communicator_cls``.

    A world needs one device per rank; where fewer are visible its cases are
    ``not_supported``. The CPU device runs any number of ranks.
    """
    from deepinfer.registry import select_backend

    if any(w < 2 for w in world_sizes):
        raise ValueError(f"the comm suite needs world sizes of at least 2, got {list(world_sizes)}")
    device = select_backend(backend, kernels, interpret).device
    results: list[CaseResult] = []
    for world in world_sizes:
        count = device.device_count()
        if device.type != "cpu" and count < world:
            results += [
                CaseResult("comm", c.op, f"world{world}_{c.name}", c.dtype, "not_supported",
                           message=f"needs {world} {device.type} devices, {count} visible")
                for c in comm_cases(world)
            ]
            continue
        results += run_world(world, backend, kernels, interpret, communicator_cls, timeout)
    return results

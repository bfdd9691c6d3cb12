"""Make test plugins visible through real installed-distribution metadata (a dist-info on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def make_plugin_dist(
    root: Path, dist_name: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]
) -> Path:
    """Write ``modules`` and a ``<dist>-0.1.dist-info`` declaring ``entry_points`` under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for mod, source in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist_name.replace('-', '_')}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    return root


def run_cli(args: list[str], extra_path: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``deepinfer ARGS`` in a fresh interpreter (optionally with a plugin dir on sys.path)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_") and k != "TRITON_INTERPRET"}
    if extra_path is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", *args], capture_output=True, text=True, env=full_env, timeout=timeout
    )


_CLI_BATCH = textwrap.dedent(
    """
    import contextlib, io, json, sys, traceback
    import deepinfer_conformance.cli as conformance_cli
    from deepinfer.cli import main

    # one e2e run per model, dtype and settings, shared by every kernel set the batch checks on it: the
    # reference's decodes are made once (what an E2ERun is for), each kernel set's own decodes every time
    _make_run, runs = conformance_cli.make_run, {}

    def shared_run(device, model=None, dtype=None, **settings):
        key = (device.type, str(model), str(dtype), repr(sorted(settings.items())))
        if key not in runs:
            runs[key] = _make_run(device, model, dtype, **settings)
        return runs[key]

    conformance_cli.make_run = shared_run
    done = []
    for args in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(args)
            except SystemExit as exc:
                status = exc.code
            except BaseException:
                traceback.print_exc()
                status = None
        done.append([status, out.getvalue(), err.getvalue()])
    print(json.dumps(done))
    """
)


def run_cli_batch(
    arg_lists: list[list[str]], extra_path: Path | None = None, env: dict[str, str] | None = None, workers: int = 2,
    timeout: float = 600,
) -> list[subprocess.CompletedProcess]:
    """``deepinfer ARGS`` for each of ``arg_lists``, in ``workers`` fresh interpreters side by side rather than one
    each: the commands a worker runs share its imports and, for ``conformance``, the reference's e2e decodes of
    each model. Each result is the command's exit status (None where it raised), stdout and stderr."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_") and k != "TRITON_INTERPRET"}
    if extra_path is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    shares = [list(range(i, len(arg_lists), workers)) for i in range(min(workers, len(arg_lists)))]

    def one(indices: list[int]) -> list:
        proc = subprocess.run([sys.executable, "-c", _CLI_BATCH, json.dumps([arg_lists[i] for i in indices])],
                              capture_output=True, text=True, env=full_env, timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    from concurrent.futures import ThreadPoolExecutor

    results: list[subprocess.CompletedProcess | None] = [None] * len(arg_lists)
    with ThreadPoolExecutor(max_workers=len(shares) or 1) as pool:
        for indices, done in zip(shares, pool.map(one, shares)):
            for i, (status, out, err) in zip(indices, done):
                results[i] = subprocess.CompletedProcess(["deepinfer", *arg_lists[i]], status, out, err)
    return results

"""Make test plugins visible through real installed-distribution metadata (a dist-info on sys.path)."""

from __future__ import annotations

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

"""Shared helpers for the benchmark scripts: pick a model directory, make prompts."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def model_dir(arg: str | None, variant: str = "mixed") -> Path:
    """``arg``, else the bundled model when present, else a tiny random checkpoint."""
    if arg:
        return Path(arg)
    sys.path.insert(0, str(ROOT))
    from deepinfer.engine import BUNDLED_MODEL

    if (BUNDLED_MODEL / "config.json").is_file():
        return BUNDLED_MODEL
    from tests.helpers.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(Path(tempfile.mkdtemp()), variant)


def random_tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def add_json_flag(ap) -> None:
    """``--json``: also print every figure as one JSON object, the output's last line."""
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")


def emit_json(enabled: bool, figures: dict) -> None:
    """Print ``figures`` as the last line when ``--json`` was given."""
    if enabled:
        import json

        print(json.dumps(figures, default=float))


def load_script(name: str):
    """Import ``benchmarks/<name>.py`` as a module (benchmarks are scripts, not a package), e.g. to reuse its model."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module

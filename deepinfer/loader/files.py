"""The small JSON files of an HF-layout model directory: config.json and generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import CheckpointError


def model_directory(model_dir: str | Path) -> Path:
    """The model directory as a Path, or a CheckpointError if it is not an existing directory."""
    path = Path(model_dir).expanduser()
    if not path.exists():
        raise CheckpointError(f"model directory {str(path)!r} does not exist; pass the path of an HF-layout checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is a file, not a directory; pass the directory that holds config.json")
    return path


def read_json(path: Path, what: str) -> Any:
    """Parse one JSON file, turning decode and read failures into a one-line CheckpointError."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {what} {str(path)!r}: {exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{what} {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
            "fix or re-download the file"
        ) from exc


def read_config(model_dir: str | Path) -> dict:
    """The raw config.json of a model directory, as a dict, whatever its ``model_type`` (the model
    registry parses it)."""
    path = model_directory(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"no config.json in {str(path.parent)!r}; the model directory must hold the checkpoint's config.json"
        )
    config = read_json(path, "config file")
    if not isinstance(config, dict):
        raise CheckpointError(f"config file {str(path)!r} holds a JSON {type(config).__name__}, expected an object")
    return config


def read_generation_config(model_dir: str | Path) -> dict:
    """generation_config.json as a dict, or an empty dict when the directory has none."""
    path = model_directory(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    config = read_json(path, "generation config")
    if not isinstance(config, dict):
        raise CheckpointError(f"generation config {str(path)!r} holds a JSON {type(config).__name__}, expected an object")
    return config

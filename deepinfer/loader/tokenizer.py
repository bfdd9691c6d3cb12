"""The checkpoint's tokenizer, read from its tokenizer.json."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from ..errors import CheckpointError
from .files import model_directory


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """A `tokenizers.Tokenizer` built from the directory's tokenizer.json."""
    path = model_directory(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"no tokenizer.json in {str(path.parent)!r}; copy the checkpoint's tokenizer.json into the model directory"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(
            f"tokenizer file {str(path)!r} cannot be read ({reason}); re-download the checkpoint's tokenizer.json"
        ) from exc

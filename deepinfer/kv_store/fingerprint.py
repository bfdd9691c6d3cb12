"""The store fingerprint: what must match for one engine's stored blocks to be another's.

It covers the model (config.json, and each safetensors file's size, header and
sampled content: two checkpoints with one architecture but different weights
differ), the cache dtype, the block size and layout, and the kernel-relevant
settings (backend, kernel set, interpreter, quantization mode, interface
version). Hashing every weight byte would cost minutes at start-up on a large
checkpoint; the sample reads at most ``SAMPLES`` × ``SAMPLE_BYTES`` per file.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

SAMPLES = 16
SAMPLE_BYTES = 4096


def weights_identity(model_dir: Path) -> list[list[Any]]:
    """Per safetensors file: its name, size and a digest of its header and sampled bytes."""
    out = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            head = f.read(8)
            h.update(head)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                h.update(f.read(min(n, 64 << 20)))
            for k in range(SAMPLES):
                f.seek(size * k // SAMPLES)
                h.update(f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
        out.append([path.name, size, h.hexdigest()])
    return out


def fingerprint(description: dict[str, Any]) -> str:
    """32 hex digits naming ``description`` (canonical JSON)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def describe_model(model_dir: Path) -> dict[str, Any]:
    """The model's part of a fingerprint."""
    config = Path(model_dir) / "config.json"
    try:
        text = config.read_text()
        config_json: Any = json.loads(text)
    except (OSError, ValueError):
        config_json = None
    return {"config": config_json, "weights": weights_identity(model_dir)}

"""Tiny DeepSeek V4.1 checkpoints that read images, and small images built in memory.

The checkpoint is ``write_tiny_v41``'s with a small vision tower (patch 4,
2 × 2 merge: tiny images give short spans) and the placeholder token
``<｜deepseek_image｜>`` in its tokenizer (its id is the config's
``image_token_id``, inside the vocabulary); no Engram layers.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.helpers.tiny_v41 import add_image_token, write_tiny_v41

PLACEHOLDER = "<｜deepseek_image｜>"
#: patch 4, merged 2 x 2: a 16 x 16 image (the minimum area) is 4 x 4 patches, 2 x 2 tokens: a span of 8
TINY_VISION: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4, downsample_ratio=2,
    max_image_tokens=40, min_pixels=256,
)


def write_image_checkpoint(directory: Path, vision: dict[str, Any] | None = TINY_VISION, **text: Any) -> tuple[Path, int]:
    """A tiny V4.1 checkpoint in ``directory`` whose tokenizer has the placeholder token, with the vision tower
    ``vision`` and its weights; ``vision`` None writes no ``vision_config`` (a checkpoint without a tower).
    Returns it and the placeholder's id."""
    text = {"engram_layer_ids": [], **text}
    if vision is not None:
        directory = write_tiny_v41(directory, vision=vision, **text)
        return directory, json.loads((directory / "config.json").read_text())["image_token_id"]
    directory = write_tiny_v41(directory, **text)
    return directory, add_image_token(directory)


def gradient_image(width: int, height: int, seed: int = 0):
    """An RGB PIL image of seeded random pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def png_bytes(image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_uri(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()

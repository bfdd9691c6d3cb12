"""Tiny DeepSeek V4.1 checkpoints with a vision tower: ``tiny_v41``'s text model plus random vision weights.

A small ``vision_config`` (the released patch size and merge ratio, a narrow
two-block ViT, a low pixel floor and token cap so test images stay small), the
tensors under the release's names beside the text ones, and an
``image_token_id`` inside the tiny vocabulary.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch

from .tiny_v41 import TEXT, write_tiny_v41

VISION: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=14,
    downsample_ratio=3, rope_theta=10000.0, max_image_tokens=40, min_pixels=28 * 28,
)
#: the placeholder's id: a row of the tiny vocabulary no test prompt draws
IMAGE_TOKEN_ID = 4090


def vision_shapes(vision: dict[str, Any], hidden: int) -> dict[str, tuple[int, ...]]:
    """Release name -> shape of every vision tensor (text hidden size ``hidden``)."""
    c, m, p, r = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"], vision["downsample_ratio"]
    shapes: dict[str, tuple[int, ...]] = {
        "vision.patch_embed.proj.weight": (c, 3 * p * p), "vision.patch_embed.proj.bias": (c,), "vision.norm.weight": (c,),
        "aligner.w1.weight": (hidden, c * r * r), "aligner.w1.bias": (hidden,),
        "aligner.w2.weight": (hidden, hidden), "aligner.w2.bias": (hidden,),
        "image_start": (hidden,), "image_end": (hidden,), "image_newline": (hidden,),
    }
    for i in range(vision["num_hidden_layers"]):
        b = f"vision.blocks.{i}."
        shapes |= {
            b + "norm1.weight": (c,), b + "attn.wqkv.weight": (3 * c, c), b + "attn.wqkv.bias": (3 * c,),
            b + "attn.wo.weight": (c, c), b + "attn.wo.bias": (c,), b + "norm2.weight": (c,),
            b + "mlp.w1.weight": (2 * m, c), b + "mlp.w2.weight": (c, m),
        }
    return shapes


def _random(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight"):
        return 1 + 0.2 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.1 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5


def write_tiny_v41_vision(directory: Path, seed: int = 0, vision: dict[str, Any] | None = None, **text: Any) -> Path:
    """``write_tiny_v41`` plus ``vision_config`` (``VISION`` updated by ``vision``), ``image_token_id`` and the
    vision tensors; returns the directory."""
    from safetensors.torch import load_file, save_file

    directory = write_tiny_v41(Path(directory), seed=seed, **text)
    spec = {**VISION, **(vision or {})}
    config = json.loads((directory / "config.json").read_text())
    config["vision_config"] = spec
    config["image_token_id"] = IMAGE_TOKEN_ID
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    tensors = load_file(str(directory / "model.safetensors"))
    hidden = {**TEXT, **text}["hidden_size"]
    for name, shape in vision_shapes(spec, hidden).items():
        tensors[name] = _random(name, shape, seed)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory

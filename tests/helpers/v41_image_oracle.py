"""DeepSeek V4.1's released image preprocessing, re-derived in numpy and PIL for the dense oracle.

One grid per image, no tiling: the source size is widened to ``min_pixels``
when smaller (both sides scaled by one factor, truncated), each side rounded up
to a whole number of ``patch_size`` patches; if the span that grid gives
(start, ``llm_h`` rows of ``llm_w`` tokens and a newline, end; ``llm`` =
``ceil(vit / downsample_ratio)`` per side) is longer than
``max_image_tokens``, the largest aspect-preserving grid that fits is solved
for. The pixels are the image fitted into that size with its aspect kept and
centred on gray 127 (``PIL.ImageOps.pad``, bicubic), scaled to ``[-1, 1]``,
cut into ``[3, p, p]`` patches in row-major order. Imports nothing from
``deepinfer``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps


@dataclass(frozen=True)
class VisionSpec:
    """``vision_config`` of a V4.1 checkpoint (defaults: the released config)."""

    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    patch_size: int = 14
    downsample_ratio: int = 3
    rope_theta: float = 10000.0
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: float | None = None

    @classmethod
    def of(cls, raw: dict[str, Any]) -> "VisionSpec":
        """From a composite ``config.json`` mapping (its ``vision_config``)."""
        vision = raw.get("vision_config")
        if not vision:
            raise ValueError("the checkpoint's config.json has no vision_config")
        return cls(**{k: vision[k] for k in cls.__dataclass_fields__ if k in vision})

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class Plan:
    """One image's grids: ViT patches ``vit_h × vit_w``, language-model tokens ``llm_h × llm_w``."""

    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int

    @property
    def tokens(self) -> int:
        return self.llm_h * (self.llm_w + 1) + 2

    @property
    def patches(self) -> int:
        return self.vit_h * self.vit_w


def _grid(height: int, width: int, spec: VisionSpec) -> Plan:
    p, r = spec.patch_size, spec.downsample_ratio
    vh, vw = height // p, width // p
    return Plan(vh, vw, math.ceil(vh / r), math.ceil(vw / r))


def _fit(height: float, width: float, spec: VisionSpec) -> tuple[int, int]:
    """The largest aspect-preserving pixel size whose token grid fits ``max_image_tokens``."""
    n, p = spec.max_image_tokens, spec.patch_size
    cell = p * spec.downsample_ratio
    ratio = height / width
    max_w = math.sqrt((n - 2) / ratio + 0.25) - 0.5
    max_h = max_w * ratio
    if max_w < 1:
        return (n - 2) // 2 * cell, cell
    if max_h < 1:
        return cell, (n - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / p) * p, math.floor(width * beta / p) * p


def plan(width: int, height: int, spec: VisionSpec) -> tuple[Plan, tuple[int, int]]:
    """The grids of a ``width × height`` source and the pixel size ``(width, height)`` it is fitted into."""
    w, h = float(width), float(height)
    if spec.max_wh_ratio is not None and w > h * spec.max_wh_ratio:
        w = h * spec.max_wh_ratio
    if 0 < w * h < spec.min_pixels:
        scale = math.sqrt(spec.min_pixels / (w * h))
        w, h = int(w * scale), int(h * scale)
    p = spec.patch_size
    best_w, best_h = math.ceil(w / p) * p, math.ceil(h / p) * p
    grid = _grid(best_h, best_w, spec)
    if grid.tokens > spec.max_image_tokens:
        best_h, best_w = _fit(h, w, spec)
        grid = _grid(best_h, best_w, spec)
        if grid.tokens > spec.max_image_tokens:
            raise ValueError(f"a {width}x{height} image needs {grid.tokens} tokens, over max_image_tokens {spec.max_image_tokens}")
    return grid, (best_w, best_h)


def preprocess(image: Image.Image, spec: VisionSpec) -> tuple[np.ndarray, Plan]:
    """``[P, 3·p·p]`` float32 normalised patches (row-major, each channel-major) and the image's grids."""
    image = image.convert("RGB")
    grid, (best_w, best_h) = plan(image.width, image.height, spec)
    if spec.max_wh_ratio is not None and image.width >= spec.max_wh_ratio * image.height:
        fitted = image.resize((best_w, best_h), Image.Resampling.BICUBIC)
    else:
        fitted = ImageOps.pad(image, (best_w, best_h), method=Image.Resampling.BICUBIC, color=(127, 127, 127))
    x = np.asarray(fitted, dtype=np.float32) / np.float32(255)
    x = (x - np.float32(0.5)) / np.float32(0.5)  # [H, W, 3]
    p = spec.patch_size
    patches = x.reshape(grid.vit_h, p, grid.vit_w, p, 3).transpose(0, 2, 4, 1, 3)
    return np.ascontiguousarray(patches.reshape(grid.patches, 3 * p * p)), grid

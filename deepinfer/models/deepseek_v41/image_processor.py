"""DeepSeek V4.1's image preprocessing as released: one grid per image, no tiling.

Planning (``plan_grid``): an image under ``min_pixels`` is scaled up to about
that area; each side is rounded up to a multiple of ``patch_size``; when the
span would cost more than ``max_image_tokens`` the size is shrunk, keeping the
aspect ratio, to the largest grid within the budget (degenerate shapes for very
tall or very wide images). Pixels (``pixel_patches``): the RGB image is fitted
into the planned size and centred on gray (127, 127, 127) padding (Pillow's
``ImageOps.pad``, bicubic), scaled to [-1, 1] by ``(x / 255 - 0.5) / 0.5``, and
cut into ``patch_size`` squares in row-major order, each flattened
channel-major. ``V41ImageReader`` turns a prompt's placeholders into spans.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ...errors import ConfigError
from ...image_input import ImageInputError
from ...multimodal import ImageGrid, ImageSpan
from ..common.images import expand_placeholders
from .config import DeepseekV41Config, V41VisionConfig

#: the gray the released preprocessing pads with
PAD_COLOR = (127, 127, 127)


def span_tokens(llm_h: int, llm_w: int) -> int:
    """Span length of an ``llm_h`` × ``llm_w`` token grid: start, rows each ended by a newline, end."""
    return llm_h * (llm_w + 1) + 2


def _llm_side(pixels: int, patch: int, ratio: int) -> int:
    return math.ceil((pixels // patch) / ratio)


def _shrunk(height: float, width: float, patch: int, ratio: int, budget: int) -> tuple[int, int]:
    """The largest aspect-preserving (height, width), multiples of ``patch``, whose span fits ``budget``
    tokens: ``h · (w + 1) + 2 ≤ budget`` solved for ``w`` at ``h = w · height / width``."""
    r = height / width
    max_w = math.sqrt((budget - 2) / r + 0.25) - 0.5
    max_h = max_w * r
    cell = patch * ratio
    if max_w < 1.0:  # very tall: one column
        return (budget - 2) // 2 * cell, cell
    if max_h < 1.0:  # very wide: one row
        return cell, (budget - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / patch) * patch, math.floor(width * beta / patch) * patch


def plan_grid(width: int, height: int, vision: V41VisionConfig) -> ImageGrid:
    """The grid an image of ``width`` × ``height`` pixels is resized to; an image whose span cannot fit
    ``max_image_tokens`` is an ``ImageInputError``."""
    if width < 1 or height < 1:
        raise ImageInputError(f"the image is {width} x {height} pixels; send an image with at least one pixel")
    p, ratio, budget = vision.patch_size, vision.downsample_ratio, vision.max_image_tokens
    w, h = width, height
    if vision.max_wh_ratio is not None and w > h * vision.max_wh_ratio:
        w = int(h * vision.max_wh_ratio)
    if w * h < vision.min_pixels:
        scale = (vision.min_pixels / (w * h)) ** 0.5
        w, h = int(w * scale), int(h * scale)
    best_h, best_w = math.ceil(h / p) * p, math.ceil(w / p) * p
    if span_tokens(_llm_side(best_h, p, ratio), _llm_side(best_w, p, ratio)) > budget:
        best_h, best_w = _shrunk(h, w, p, ratio, budget)
    llm_h, llm_w = _llm_side(best_h, p, ratio), _llm_side(best_w, p, ratio)
    if best_h < p or best_w < p or span_tokens(llm_h, llm_w) > budget:
        raise ImageInputError(
            f"a {width} x {height} image cannot fit the model's budget of {budget} tokens per image; "
            "crop it to a less extreme aspect ratio"
        )
    return ImageGrid(best_h // p, best_w // p, llm_h, llm_w)


def pixel_patches(image: Any, grid: ImageGrid, vision: V41VisionConfig) -> torch.Tensor:
    """``[grid.patches, 3 · p · p]`` float32: ``image`` fitted to the grid's size as released, normalised to
    [-1, 1], patches in row-major order, each flattened channel-major."""
    from PIL import ImageOps

    p = vision.patch_size
    size = (grid.vit_w * p, grid.vit_h * p)
    rgb = image.convert("RGB")
    if vision.max_wh_ratio is not None and rgb.width >= vision.max_wh_ratio * rgb.height:
        fitted = rgb.resize(size)  # wider than the ratio: the release stretches instead of padding
    else:
        fitted = ImageOps.pad(rgb, size, color=PAD_COLOR)
    values = np.asarray(fitted, dtype=np.float32) / np.float32(255)
    values = (values - np.float32(0.5)) / np.float32(0.5)  # [H, W, 3]
    tiles = values.reshape(grid.vit_h, p, grid.vit_w, p, 3).transpose(0, 2, 4, 1, 3)  # [vit_h, vit_w, 3, p, p]
    return torch.from_numpy(np.ascontiguousarray(tiles).reshape(grid.patches, 3 * p * p))


def image_digest(grid: ImageGrid, patches: torch.Tensor) -> bytes:
    """sha256 of the preprocessed image: its grid and its patches' bytes."""
    h = hashlib.sha256(np.array([grid.vit_h, grid.vit_w, grid.llm_h, grid.llm_w], dtype="<i8").tobytes())
    h.update(patches.contiguous().numpy().tobytes())
    return h.digest()


@dataclass(frozen=True)
class V41ImageReader:
    """A V4.1 checkpoint's image reader: each ``placeholder_id`` token of a prompt becomes one image's span."""

    vision: V41VisionConfig
    placeholder_id: int

    def span(self, image: Any, offset: int) -> ImageSpan:
        """One decoded image, preprocessed, its span starting at prompt position ``offset``."""
        grid = plan_grid(image.width, image.height, self.vision)
        patches = pixel_patches(image, grid, self.vision)
        return ImageSpan(offset, grid, patches, image_digest(grid, patches))

    def span_length(self, image: Any) -> int:
        return plan_grid(image.width, image.height, self.vision).tokens

    def expand(self, token_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The prompt with each placeholder expanded to its image's span (every position ``placeholder_id``), and the spans."""
        return expand_placeholders(token_ids, images, self.placeholder_id, self.span)


def image_reader(raw: Mapping[str, Any]) -> V41ImageReader:
    """The reader of the checkpoint whose ``config.json`` is ``raw``; a checkpoint without a vision tower
    raises a one-line ``ConfigError`` (what a request with images is then told)."""
    config = DeepseekV41Config.from_hf(dict(raw))
    if config.vision_config is None or config.image_token_id is None:
        missing = "vision_config" if config.vision_config is None else "image_token_id"
        raise ConfigError(f"this checkpoint reads no images: its config.json has no {missing}; send text only")
    return V41ImageReader(config.vision_config, config.image_token_id)

"""DeepSeek V4.1's released image preprocessing: grid planning (token counts worked out by hand from the
release's formulas), gray padding, normalisation and patch order against a hand computation, and the
expansion of placeholders into spans."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer.errors import ConfigError
from deepinfer.image_input import ImageInputError
from deepinfer.models.deepseek_v41.config import V41VisionConfig
from deepinfer.models.deepseek_v41.image_processor import image_reader, pixel_patches, plan_grid
from deepinfer.multimodal import ImageGrid
from tests.helpers.tiny_images import TINY_VISION, gradient_image
from tests.helpers.tiny_v41 import TEXT

RELEASED = V41VisionConfig()  # patch 14, merge 3, 1024 tokens, min_pixels 544²


def test_the_released_config_is_what_the_counts_below_assume():
    assert (RELEASED.patch_size, RELEASED.downsample_ratio, RELEASED.max_image_tokens, RELEASED.min_pixels) == (14, 3, 1024, 544 * 544)
    assert RELEASED.max_wh_ratio is None


def test_a_small_image_is_scaled_up_to_min_pixels():
    # 64 x 64 = 4096 < 295936: scale sqrt(295936 / 4096) = 8.5 -> 544 x 544; ceil(544 / 14) = 39 patches a side
    # (546 pixels); ceil(39 / 3) = 13 tokens a side; span 13 · (13 + 1) + 2 = 184
    grid = plan_grid(64, 64, RELEASED)
    assert grid == ImageGrid(vit_h=39, vit_w=39, llm_h=13, llm_w=13)
    assert grid.tokens == 184 and grid.patches == 1521


def test_a_full_hd_image_is_shrunk_to_the_token_budget():
    # unshrunk: ceil(1920 / 14) = 138, ceil(1080 / 14) = 78 patches -> 46 x 26 tokens -> 26 · 47 + 2 = 1224 > 1024.
    # shrink: r = 1080 / 1920 = 0.5625, max_w = sqrt(1022 / r + 0.25) - 0.5 = 42.13, max_h = 23.70, cell 42;
    # beta = min(42 · 42 / 1920, 23 · 42 / 1080) = 966 / 1080; height 966 = 69 · 14, width floor(1717.3 / 14) · 14 = 122 · 14
    # -> 69 x 122 patches, ceil(69 / 3) = 23 x ceil(122 / 3) = 41 tokens: 23 · 42 + 2 = 968
    assert math.isclose(math.sqrt(1022 / 0.5625 + 0.25) - 0.5, 42.128, abs_tol=1e-3)
    grid = plan_grid(1920, 1080, RELEASED)
    assert grid == ImageGrid(vit_h=69, vit_w=122, llm_h=23, llm_w=41)
    assert grid.tokens == 968 <= RELEASED.max_image_tokens


def test_an_image_within_budget_keeps_its_rounded_size():
    # 640 x 480: ceil(640 / 14) = 46, ceil(480 / 14) = 35 patches -> 16 x 12 tokens: 12 · 17 + 2 = 206
    assert plan_grid(640, 480, RELEASED) == ImageGrid(vit_h=35, vit_w=46, llm_h=12, llm_w=16)


def test_extreme_aspect_ratios_collapse_to_one_row_or_one_column():
    # 50000 x 20: 3572 patches wide -> 1191 tokens, too many; r = 0.0004, max_h = sqrt(1022 r) < 1: one row of
    # (1024 - 3) tokens, height one cell (42 px = 3 patches): 1 · 1022 + 2 = 1024
    assert plan_grid(50000, 20, RELEASED) == ImageGrid(vit_h=3, vit_w=3063, llm_h=1, llm_w=1021)
    # 20 x 50000: max_w = sqrt(1022 / 2500 + 0.25) - 0.5 = 0.31 < 1: one column, (1024 - 2) // 2 = 511 rows
    assert plan_grid(20, 50000, RELEASED) == ImageGrid(vit_h=1533, vit_w=3, llm_h=511, llm_w=1)


def test_max_wh_ratio_clips_the_planned_width():
    vision = V41VisionConfig(max_wh_ratio=2)
    # 2000 x 500 -> width clipped to 1000; ceil(1000 / 14) = 72, ceil(500 / 14) = 36 -> 24 x 12 tokens: 12 · 25 + 2 = 302
    assert plan_grid(2000, 500, vision) == ImageGrid(vit_h=36, vit_w=72, llm_h=12, llm_w=24)


def test_a_budget_no_grid_fits_is_a_one_line_error():
    with pytest.raises(ImageInputError, match=r"^a 100 x 100 image cannot fit the model's budget of 3 tokens per image; crop"):
        plan_grid(100, 100, V41VisionConfig(max_image_tokens=3))


def test_padding_normalisation_and_patch_order_by_hand():
    # a 4 x 2 image, patch 2, min_pixels 8: no scaling; 4 x 2 rounds to itself: no padding, 1 x 2 patches
    vision = V41VisionConfig(patch_size=2, downsample_ratio=2, min_pixels=8, max_image_tokens=64)
    pixels = np.arange(4 * 2 * 3, dtype=np.uint8).reshape(2, 4, 3) * 10  # [row, col, channel]
    image = Image.fromarray(pixels, "RGB")
    grid = plan_grid(4, 2, vision)
    assert grid == ImageGrid(1, 2, 1, 1)
    patches = pixel_patches(image, grid, vision)
    expected = [[(pixels[y, 2 * k + x, c] / 255 - 0.5) / 0.5 for c in range(3) for y in range(2) for x in range(2)] for k in range(2)]
    torch.testing.assert_close(patches, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_the_fitted_image_is_centred_on_gray():
    # 4 x 2 with min_pixels 16: scale sqrt(2) -> int(5.66) x int(2.83) = 5 x 2 -> rounded up to 6 x 2 (3 patches);
    # the 4 x 2 image fits unscaled and sits at column round((6 - 4) / 2) = 1: columns 0 and 5 are gray 127
    vision = V41VisionConfig(patch_size=2, downsample_ratio=2, min_pixels=16, max_image_tokens=64)
    pixels = np.full((2, 4, 3), 250, dtype=np.uint8)
    grid = plan_grid(4, 2, vision)
    assert grid == ImageGrid(1, 3, 1, 2)
    patches = pixel_patches(Image.fromarray(pixels, "RGB"), grid, vision).reshape(3, 3, 2, 2)  # [patch, c, y, x]
    canvas = patches.permute(2, 0, 3, 1).reshape(2, 6, 3)  # back to [row, col, channel]
    gray, white = (127 / 255 - 0.5) / 0.5, (250 / 255 - 0.5) / 0.5
    expected = torch.full((2, 6, 3), white)
    expected[:, [0, 5]] = gray
    torch.testing.assert_close(canvas, expected, atol=1e-6, rtol=0)


def test_any_mode_is_read_as_rgb():
    vision = V41VisionConfig(patch_size=2, downsample_ratio=2, min_pixels=4, max_image_tokens=64)
    gray = Image.new("L", (2, 2), 51)
    patches = pixel_patches(gray, plan_grid(2, 2, vision), vision)
    torch.testing.assert_close(patches, torch.full((1, 12), (51 / 255 - 0.5) / 0.5), atol=1e-6, rtol=0)


def _raw(**top):
    """A tiny V4.1 config.json (no Engram) with ``top``'s top-level fields."""
    return {"model_type": "deepseek_v41", "text_config": {**TEXT, "engram_layer_ids": []}, **top}


def _reader():
    return image_reader(_raw(image_token_id=99, vision_config=TINY_VISION))


def test_placeholders_expand_to_spans_at_their_offsets():
    reader = _reader()
    small, wide = gradient_image(16, 16), gradient_image(32, 16, seed=1)
    ids, spans = reader.expand([1, 99, 2, 3, 99, 4], [small, wide])
    # 16 x 16: 4 x 4 patches, 2 x 2 tokens -> 2 · 3 + 2 = 8; 32 x 16: 8 x 4 patches, 4 x 2 tokens -> 2 · 5 + 2 = 12
    assert [s.grid for s in spans] == [ImageGrid(4, 4, 2, 2), ImageGrid(4, 8, 2, 4)]
    assert [(s.offset, s.length) for s in spans] == [(1, 8), (11, 12)]
    assert ids == [1] + [99] * 8 + [2, 3] + [99] * 12 + [4]
    assert spans[0].patches.shape == (16, 48) and spans[0].patches.dtype == torch.float32
    again = reader.expand([99], [gradient_image(16, 16)])[1][0]
    assert again.digest == spans[0].digest and len(again.digest) == 32
    assert reader.expand([99], [gradient_image(16, 16, seed=2)])[1][0].digest != spans[0].digest


def test_placeholder_and_image_counts_must_match():
    reader = _reader()
    with pytest.raises(ImageInputError, match=r"^the prompt has 2 image placeholders \(token 99\) but 1 images; put one"):
        reader.expand([99, 5, 99], [gradient_image(16, 16)])
    with pytest.raises(ImageInputError, match=r"has 1 image placeholders \(token 99\) but 0 images"):
        reader.expand([99], [])
    assert reader.expand([5, 6], []) == ([5, 6], ())


def test_a_checkpoint_without_a_vision_tower_has_no_reader():
    with pytest.raises(ConfigError, match=r"^this checkpoint reads no images: its config.json has no vision_config; send text only$"):
        image_reader(_raw())
    with pytest.raises(ConfigError, match=r"has no image_token_id"):
        image_reader(_raw(image_token_id=None, vision_config=TINY_VISION))
    reader = _reader()
    assert reader.placeholder_id == 99 and reader.vision == V41VisionConfig(**TINY_VISION)

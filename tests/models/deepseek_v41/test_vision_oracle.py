"""DeepSeek V4.1 with images against a dense oracle of the released vision tower, preprocessing and splice.

``tests/helpers/v41_vision_oracle.py`` (with ``v41_image_oracle.py`` for the
preprocessing) re-derives the released vision path in float64 from the
published math, reading the tiny checkpoint's tensors under the release's names;
``v41_oracle.Splice`` carries the images into the dense text forward. The
first tests pin the oracle itself to values it cannot reach by accident: token
counts worked by hand from the released formulas, pixels of a padded image, the
ViT against a differently written computation (complex rotary, PyTorch's
scaled-dot-product attention per image), the aligner's merge order on a
hand-built grid, the span rule for Engram n-grams, and that the image rules
move the logits. The engine then must match the oracle (mean absolute
log-probability within ``MEAN_ATOL``): the tower's span rows, images of several
sizes and aspect ratios, two images in one prompt, images after and under a
prefix hit, a span cut by chunked prefill.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from deepinfer.llm import LLM
from deepinfer.models.registry import load_model
from deepinfer.multimodal import ImageGrid, ImageSpan
from deepinfer_interfaces import Kernels
from tests.helpers.oracle_tensors import CheckpointTensors
from tests.helpers.tiny_v41 import write_tiny_v41
from tests.helpers.trained_kv import MEAN_ATOL, Completion, agreement, greedy
from tests.helpers.v41_image_oracle import VisionSpec, plan, preprocess
from tests.helpers.v41_oracle import engram_hash_ids, oracle_forward
from tests.helpers.v41_vision_oracle import (
    OracleImage, expand, load_spec, merge_tiles, oracle_forward_images, span_rows, splice, vit,
)

pytestmark = pytest.mark.usefixtures("one_thread")

#: head and indexer widths where the published QAT rounding is inert (the oracle's unrounded math applies)
TEXT = dict(head_dim=24, qk_rope_head_dim=8, index_head_dim=12)
ENGINE = dict(backend="cpu", dtype="float64", max_model_len=256, kv_cache_memory=64 << 20, max_num_seqs=4,
              speculative_method=None, kv_cache_dtype="model", swa_replay="exact")
#: (width, height) at the tiny vision config (``tiny_v41.VISION``): square, wide, a small tall one widened to the
#: pixel floor, a wide one, one over the token cap (shrunk)
SIZES = [(64, 64), (100, 40), (20, 30), (150, 90), (400, 250)]
#: the tower's span rows, engine against oracle
ROWS_ATOL = {torch.float32: 1e-5, torch.float64: 1e-5}


def _image(width: int, height: int, seed: int) -> Image.Image:
    """Smooth colour gradients plus noise, so resampling and padding both show in the pixels."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def _text(n: int, seed: int) -> list[int]:
    return torch.randint(5, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_v41(tmp_path_factory.mktemp("v41_vision") / "tiny", seed=3, vision=True, **TEXT)


@pytest.fixture(scope="module")
def spec(ckpt) -> tuple[VisionSpec, int]:
    return load_spec(ckpt)


# ----------------------------------------------------------------------------- the oracle itself


def test_token_counts_follow_the_released_formulas():
    released = VisionSpec()
    # 64 x 64: under the 544^2 floor, scaled by sqrt(295936 / 4096) = 8.5 to 544 x 544, rounded up to 39 patches
    # a side (546 px), merged to ceil(39 / 3) = 13 a side: 13 rows of 13 + a newline, plus two delimiters
    small, pixels = plan(64, 64, released)
    assert (small.vit_h, small.vit_w, small.llm_h, small.llm_w, small.tokens, pixels) == (39, 39, 13, 13, 184, (546, 546))
    # 1920 x 1080: 138 x 78 patches -> 46 x 26 tokens -> 26 * 47 + 2 = 1224 > 1024, so shrunk: r = 0.5625,
    # max_w = sqrt(1022 / r + 0.25) - 0.5 = 42.13, max_h = 23.70, beta = min(42 * 42 / 1920, 23 * 42 / 1080) =
    # 966 / 1080 -> 966 x 1708 px, 69 x 122 patches, 23 x 41 tokens, 23 * 42 + 2 = 968
    hd, pixels = plan(1920, 1080, released)
    assert (hd.vit_h, hd.vit_w, hd.llm_h, hd.llm_w, hd.tokens, pixels) == (69, 122, 23, 41, 968, (1708, 966))
    # exactly at the floor and a multiple of 14 on both sides: kept
    assert plan(546, 546, released)[0] == small
    # a 5 x 5000 strip: widened to 17 x 17202 px, 2 x 1229 patches, 1 x 410 tokens = 822
    strip, _ = plan(5, 5000, released)
    assert (strip.vit_w, strip.vit_h, strip.llm_w, strip.llm_h, strip.tokens) == (2, 1229, 1, 410, 822)


def test_preprocessing_fits_centres_on_gray_and_cuts_channel_major_patches(spec):
    vision, _ = spec
    red = Image.new("RGB", (100, 40), (255, 0, 0))
    patches, grid = preprocess(red, vision)
    # 100 x 40 -> 112 x 42 px (8 x 3 patches, 3 x 1 tokens); the image fits as 105 x 42, centred: columns
    # 0-3 and 109-111 are gray 127
    assert (grid.vit_h, grid.vit_w, grid.llm_h, grid.llm_w, grid.tokens) == (3, 8, 1, 3, 6)
    gray = (127 / 255 - 0.5) / 0.5
    first = patches[0].reshape(3, 14, 14)  # row 0, column 0: pixel columns 0-13
    np.testing.assert_allclose(first[:, :, :4], gray, atol=1e-7)
    np.testing.assert_allclose(first[0, :, 4:], 1.0, atol=1e-6)
    np.testing.assert_allclose(first[1:, :, 4:], -1.0, atol=1e-6)
    last = patches[7].reshape(3, 14, 14)  # row 0, column 7: pixel columns 98-111
    np.testing.assert_allclose(last[:, :, 11:], gray, atol=1e-7)
    np.testing.assert_allclose(last[0, :, :11], 1.0, atol=1e-6)
    assert patches.dtype == np.float32 and patches.shape == (24, 588)


def _sdpa_vit(tensors: CheckpointTensors, patches: torch.Tensor, vit_h: int, vit_w: int, spec: VisionSpec,
              col_first: bool = False) -> torch.Tensor:
    """The ViT written another way: the rotary as complex multiplication, attention by ``F.scaled_dot_product_attention``."""
    w = lambda name: tensors(name)  # noqa: E731
    x = F.linear(patches.double(), w("vision.patch_embed.proj.weight"), w("vision.patch_embed.proj.bias"))
    n, hd = spec.num_attention_heads, spec.head_dim
    d = hd // 2
    freqs = torch.pow(torch.tensor(spec.rope_theta, dtype=torch.float32), -torch.arange(0, d, 2, dtype=torch.float32) / d)
    row, col = torch.meshgrid(torch.arange(vit_h), torch.arange(vit_w), indexing="ij")
    first, second = (col, row) if col_first else (row, col)
    angles = torch.cat([first.reshape(-1, 1).float() * freqs, second.reshape(-1, 1).float() * freqs], -1)
    angles = angles.double()  # the angles as the fp32 tables hold them, their cos / sin in fp64
    turn = torch.polar(torch.ones_like(angles), angles)[:, None, :]

    def rotary(t: torch.Tensor) -> torch.Tensor:
        z = torch.complex(t[..., :d], t[..., d:]) * turn
        return torch.cat([z.real, z.imag], dim=-1)

    def rms(t: torch.Tensor, name: str) -> torch.Tensor:
        return t / torch.sqrt(torch.mean(t * t, -1, keepdim=True) + 1e-6) * w(name)

    for i in range(spec.num_hidden_layers):
        p = f"vision.blocks.{i}."
        q, k, v = F.linear(rms(x, p + "norm1.weight"), w(p + "attn.wqkv.weight"), w(p + "attn.wqkv.bias")).split(n * hd, -1)
        q, k, v = (t.reshape(-1, n, hd) for t in (q, k, v))
        out = F.scaled_dot_product_attention(rotary(q).transpose(0, 1), rotary(k).transpose(0, 1), v.transpose(0, 1))
        x = x + F.linear(out.transpose(0, 1).reshape(-1, n * hd), w(p + "attn.wo.weight"), w(p + "attn.wo.bias"))
        h = F.linear(rms(x, p + "norm2.weight"), w(p + "mlp.w1.weight"))
        x = x + F.linear(F.silu(h[:, : spec.intermediate_size]) * h[:, spec.intermediate_size :], w(p + "mlp.w2.weight"))
    return rms(x, "vision.norm.weight")


def test_the_vit_oracle_equals_an_sdpa_computation_per_image(ckpt, spec):
    vision, _ = spec
    tensors = CheckpointTensors(ckpt)
    for seed, size in enumerate([(150, 90), (64, 64)]):
        patches, g = preprocess(_image(*size, seed), vision)
        got = vit(tensors, torch.from_numpy(patches), g.vit_h, g.vit_w, vision)
        want = _sdpa_vit(tensors, torch.from_numpy(patches), g.vit_h, g.vit_w, vision)
        # the oracle's cos / sin are fp32 (the published tables): ~6e-8 apart from fp64 ones
        assert float((got - want).abs().max()) < 1e-6
        # the rotary's (row, column) order shows: the grid is the only position signal a patch carries
        swapped = _sdpa_vit(tensors, torch.from_numpy(patches), g.vit_h, g.vit_w, vision, col_first=True)
        assert float((got - swapped).abs().max()) > 1e-3


def test_the_aligner_merges_zero_padded_tiles_channel_major_in_row_major_order():
    vit_h, vit_w, c, r = 4, 5, 2, 3
    value = lambda y, x, ch: 100 * y + 10 * x + ch + 1  # noqa: E731  (never 0: padding shows)
    grid = torch.tensor([[[value(y, x, ch) for ch in range(c)] for x in range(vit_w)] for y in range(vit_h)], dtype=torch.float64)
    got = merge_tiles(grid.reshape(-1, c), vit_h, vit_w, r)
    assert got.shape == (4, c * 9)  # 2 x 2 tiles
    for ty in range(2):
        for tx in range(2):
            for ch in range(c):
                for dy in range(r):
                    for dx in range(r):
                        y, x = ty * r + dy, tx * r + dx
                        want = value(y, x, ch) if y < vit_h and x < vit_w else 0
                        assert got[ty * 2 + tx, ch * 9 + dy * 3 + dx] == want
    # the same as F.unfold over the zero-padded channel-first grid
    padded = F.pad(grid.permute(2, 0, 1), (0, 1, 0, 2))
    assert torch.equal(got, F.unfold(padded[None], r, stride=r)[0].t())


def test_a_span_holds_its_delimiters_and_aligner_rows_row_major(ckpt, spec):
    vision, _ = spec
    tensors = CheckpointTensors(ckpt)
    image = OracleImage.of(_image(150, 90, 0), 0, vision)
    rows = span_rows(tensors, image, vision)
    g = image.plan
    assert (g.llm_h, g.llm_w) == (3, 4) and rows.shape == (g.tokens, 64)
    assert torch.equal(rows[0], tensors("image_start")) and torch.equal(rows[-1], tensors("image_end"))
    for i in range(g.llm_h):
        assert torch.equal(rows[1 + i * (g.llm_w + 1) + g.llm_w], tensors("image_newline"))
    body = rows[1:-1].view(g.llm_h, g.llm_w + 1, -1)[:, : g.llm_w].reshape(g.llm_h * g.llm_w, -1)
    assert len({tuple(r.tolist()) for r in body}) == g.llm_h * g.llm_w  # every patch token its own row


def test_an_image_cuts_the_engram_ngrams_reaching_it(ckpt, spec):
    import json

    _, token = spec
    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    tail = [11, 12, 13]
    # the tokens after an image hash as the same tokens at the start of a sequence
    after = engram_hash_ids(text, [7, 8, 9, token, token] + tail, ckpt / "tokenizer.json", [False] * 3 + [True] * 2 + [False] * 3)
    start = engram_hash_ids(text, tail, ckpt / "tokenizer.json")
    plain = engram_hash_ids(text, [7, 8, 9, token, token] + tail, ckpt / "tokenizer.json")
    for layer in start:
        assert torch.equal(after[layer][5:], start[layer])
        assert not torch.equal(plain[layer][5:], start[layer])  # without the cut the n-grams read the image ids


def _mean_gap(a: torch.Tensor, b: torch.Tensor, ids: list[int]) -> float:
    """Mean absolute difference of the log-probabilities two logit sets give each next prompt token."""
    la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    index = torch.tensor(ids[1:])[:, None]
    return float((la[:-1].gather(1, index) - lb[:-1].gather(1, index)).abs().mean())


def test_the_image_rules_move_the_oracles_logits(ckpt, spec):
    """Routing image positions with ``gate.bias`` or splicing no rows at all moves the oracle's log-probabilities
    well past the engine's tolerance: the parity below tells these rules apart."""
    vision, token = spec
    ids, images = expand(_text(12, 1) + [token] + _text(10, 2), [_image(150, 90, 0)], vision, token)
    right = oracle_forward_images(ckpt, ids, images, rounding=False)
    tensors = CheckpointTensors(ckpt)
    text_bias = {f"layers.{i}.ffn.gate.bias_vl": tensors.raw(f"layers.{i}.ffn.gate.bias") for i in range(8)}
    wrong = {
        "image positions routed with gate.bias": oracle_forward_images(ckpt, ids, images, rounding=False, overrides=text_bias),
        "no rows spliced": oracle_forward(ckpt, [t if t != token else 5 for t in ids], rounding=False),
    }
    for name, result in wrong.items():
        gap = _mean_gap(right.logits, result.logits, ids)
        assert gap > 10 * MEAN_ATOL, f"{name}: the log-probabilities moved only {gap:.2e}"


# ----------------------------------------------------------------------------- the engine against the oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_towers_span_rows_equal_the_oracles(ckpt, spec, dtype):
    vision, _ = spec
    model = load_model(ckpt, Kernels(), dtype=dtype)
    tensors = CheckpointTensors(ckpt)
    images = [OracleImage.of(_image(w, h, i), 0, vision) for i, (w, h) in enumerate(SIZES)]
    spans = [
        ImageSpan(0, ImageGrid(im.plan.vit_h, im.plan.vit_w, im.plan.llm_h, im.plan.llm_w), torch.from_numpy(im.patches), bytes([i]))
        for i, im in enumerate(images)
    ]
    got = model.encode_images(spans)  # every image in one batched pass
    assert len(got) == len(images)
    for image, rows in zip(images, got):
        want = span_rows(tensors, image, vision)
        assert rows.dtype == dtype and rows.shape == want.shape
        err = float((rows.double() - want).abs().max())
        assert err <= ROWS_ATOL[dtype], f"{image.plan}: max |tower - oracle| {err:.2e}"


def _run(llm: LLM, ids: list[int], images: list[Image.Image], params) -> Completion:
    (out,) = llm.generate([{"prompt": ids, "multi_modal_data": {"image": images}}], params)
    assert out.error is None, out.error
    return Completion.of(out)


def _check(ckpt, spec, done: Completion, ids: list[int], images: list[Image.Image]) -> float:
    """The completion against the oracle over the same expanded prompt; returns the mean gap."""
    vision, token = spec
    want, placed = expand(ids, images, vision, token)
    assert done.prompt == want, "the engine's expanded prompt differs from the released span layout"
    result = oracle_forward_images(ckpt, done.ids, placed, rounding=False)
    assert result.min_margin > 2e-6, f"a near tie in a top-k choice ({result.min_margin:.2e}): pick another prompt"
    agree = agreement(done, result.logits)
    assert agree.mean <= MEAN_ATOL and agree.same_tokens, str(agree)
    return agree.mean


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_images_of_several_sizes_match_the_oracle(ckpt, spec, dtype):
    _, token = spec
    llm = LLM(model=str(ckpt), **dict(ENGINE, dtype=dtype))
    for i, size in enumerate(SIZES):
        ids, images = _text(9, 10 + i) + [token] + _text(7, 20 + i), [_image(*size, i)]
        gap = _check(ckpt, spec, _run(llm, ids, images, greedy(3, True)), ids, images)
        assert dtype == "float32" or gap < 1e-6, f"{size}: float64 mean gap {gap:.2e}"


def test_two_images_in_one_prompt_match_the_oracle(ckpt, spec):
    _, token = spec
    llm = LLM(model=str(ckpt), **ENGINE)
    ids = _text(6, 30) + [token] + _text(5, 31) + [token] + _text(4, 32)
    images = [_image(100, 40, 5), _image(20, 30, 6)]
    _check(ckpt, spec, _run(llm, ids, images, greedy(3, True)), ids, images)
    # the same two images the other way round are another prompt
    swapped = _run(llm, ids, images[::-1], greedy(3, True))
    _check(ckpt, spec, swapped, ids, images[::-1])


def test_images_after_and_under_a_prefix_hit_match_the_oracle(ckpt, spec):
    """A text prefix of five blocks (longer than the exact replay, 8 layers x the window of 8), then an image: a
    later prompt with the same image hits past it and reuses it; one with another image hits the text only and
    computes its own."""
    _, token = spec
    llm = LLM(model=str(ckpt), **ENGINE)
    prefix = _text(80, 40)
    first = prefix + [token] + _text(20, 41)
    a, b = _image(150, 90, 7), _image(64, 64, 8)
    _check(ckpt, spec, _run(llm, first, [a], greedy(2, True)), first, [a])
    span_end = len(prefix) + 17
    same = _run(llm, prefix + [token] + _text(20, 41)[:18] + _text(6, 42), [a], greedy(4, False))
    assert same.cached_tokens >= span_end, f"cached {same.cached_tokens}: the hit stopped before the image's end"
    _check(ckpt, spec, same, prefix + [token] + _text(20, 41)[:18] + _text(6, 42), [a])
    other = _run(llm, first, [b], greedy(4, False))
    assert 0 < other.cached_tokens <= len(prefix), f"cached {other.cached_tokens}: another image must miss from its span on"
    _check(ckpt, spec, other, first, [b])


def test_a_span_cut_by_chunked_prefill_matches_the_oracle(ckpt, spec):
    _, token = spec
    llm = LLM(model=str(ckpt), **dict(ENGINE, max_num_batched_tokens=16, max_prefill_chunk=16))
    ids, images = _text(5, 50) + [token] + _text(12, 51), [_image(400, 250, 9)]  # a span over three chunks
    _check(ckpt, spec, _run(llm, ids, images, greedy(3, True)), ids, images)


def test_span_rows_of_the_oracle_splice_cover_exactly_the_spans(ckpt, spec):
    vision, token = spec
    ids, images = expand(_text(4, 60) + [token] + [token] + _text(3, 61), [_image(64, 64, 1), _image(20, 30, 2)], vision, token)
    s = splice(ckpt, len(ids), images)
    assert s.mask.tolist() == [t == token for t in ids]
    assert math.isclose(float(s.rows[~s.mask].abs().sum()), 0.0)
    with pytest.raises(ValueError, match="placeholders"):
        expand([token], [], vision, token)

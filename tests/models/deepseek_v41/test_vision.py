"""DeepSeek V4.1's vision tower: ``encode_images`` against a per-image computation of the released math written
with plain torch (scaled-dot-product attention, ``F.pad`` + ``F.unfold``), batching, the span layout, the
``vit_attention`` reference against a naive softmax, the config's vision fields, loading and ``inspect``."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer.errors import ConfigError
from deepinfer.loader.names import model_name
from deepinfer.loader.tokenizer import load_tokenizer
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from deepinfer.multimodal import ImageGrid, ImageSpan
from deepinfer.weight_memory import weight_memory
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.specs import SPECS
from tests.helpers.published import V41_FLASH
from tests.helpers.tiny_v41 import IMAGE_TOKEN, VISION, write_tiny_v41

K = Kernels()
#: (vit_h, vit_w): a 3-aligned grid, one padded on both sides, a tall narrow one, a single patch
GRIDS = ((6, 6), (4, 5), (7, 2), (1, 1))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_v41(tmp_path_factory.mktemp("v41v") / "ckpt", vision=True)


@pytest.fixture(scope="module")
def model(checkpoint):
    return DeepseekV41Model.from_pretrained(checkpoint, K, dtype=torch.float32)


def _span(vit_h: int, vit_w: int, seed: int, offset: int = 0) -> ImageSpan:
    g = torch.Generator().manual_seed(seed)
    grid = ImageGrid(vit_h, vit_w, -(-vit_h // 3), -(-vit_w // 3))
    return ImageSpan(offset, grid, torch.rand(grid.patches, 3 * 14 * 14, generator=g) * 2 - 1, bytes([seed]))


def _dense(params: dict[str, torch.Tensor], span: ImageSpan) -> torch.Tensor:
    """One image's span embedding from the released math, computed alone (fp64)."""
    p = {n: t.double() for n, t in params.items()}
    c, layers, heads = VISION["hidden_size"], VISION["num_hidden_layers"], VISION["num_attention_heads"]
    hd, r = c // heads, VISION["downsample_ratio"]
    g = span.grid

    def norm(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    rope = hd // 2
    inv = 1.0 / (10000.0 ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope))
    rows = torch.arange(g.vit_h, dtype=torch.float64).repeat_interleave(g.vit_w)
    cols = torch.arange(g.vit_w, dtype=torch.float64).repeat(g.vit_h)
    ang = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=1)[:, None, :]

    def rotate(x):
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)

    x = span.patches.double() @ p["vision.patch_embed.proj.weight"].T + p["vision.patch_embed.proj.bias"]
    n = x.shape[0]
    for i in range(layers):
        b = f"vision.blocks.{i}."
        qkv = norm(x, p[b + "norm1.weight"]) @ p[b + "attn.wqkv.weight"].T + p[b + "attn.wqkv.bias"]
        q, k, v = (t.reshape(n, heads, hd) for t in qkv.split(c, dim=-1))
        o = F.scaled_dot_product_attention(rotate(q).transpose(0, 1), rotate(k).transpose(0, 1), v.transpose(0, 1))
        x = x + o.transpose(0, 1).reshape(n, c) @ p[b + "attn.wo.weight"].T + p[b + "attn.wo.bias"]
        gate, up = (norm(x, p[b + "norm2.weight"]) @ p[b + "mlp.w1.weight"].T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ p[b + "mlp.w2.weight"].T
    x = norm(x, p["vision.norm.weight"])
    grid = F.pad(x.T.reshape(1, c, g.vit_h, g.vit_w), (0, -g.vit_w % r, 0, -g.vit_h % r))
    tiles = F.unfold(grid, r, stride=r)[0].T  # [llm_h · llm_w, C · r²]
    merged = F.gelu(tiles @ p["aligner.w1.weight"].T + p["aligner.w1.bias"]) @ p["aligner.w2.weight"].T + p["aligner.w2.bias"]
    out = [p["image_start"][None]]
    for row in merged.reshape(g.llm_h, g.llm_w, -1):
        out += [row, p["image_newline"][None]]
    return torch.cat(out + [p["image_end"][None]])


@pytest.mark.parametrize("vit", GRIDS)
def test_each_grid_matches_the_released_math(model, vit):
    span = _span(*vit, seed=sum(vit))
    (got,) = model.encode_images([span])
    assert got.shape == (span.length, model.config.hidden_size) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _dense(model.named_parameters(), span), atol=2e-5, rtol=2e-5)


def test_images_batched_in_one_call_equal_each_encoded_alone(model):
    spans = [_span(4, 5, 1), _span(7, 2, 2, offset=40), _span(6, 6, 3)]
    together = model.encode_images(spans)
    for span, got in zip(spans, together):
        (alone,) = model.encode_images([span])
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    assert model.encode_images([]) == []


def test_the_span_takes_the_delimiters_where_its_token_types_say(model):
    span = _span(7, 2, 5)  # 3 rows of 1 token
    (got,) = model.encode_images([span])
    v = model.vision
    assert torch.equal(got[0], v.image_start) and torch.equal(got[-1], v.image_end)
    assert all(torch.equal(got[i], v.image_newline) for i in (2, 4, 6))
    assert not any(torch.equal(got[i], v.image_newline) for i in (1, 3, 5))


def test_bf16_model_encodes_in_its_dtype_close_to_fp32(checkpoint, model):
    half = DeepseekV41Model.from_pretrained(checkpoint, K, dtype=torch.bfloat16)
    span = _span(4, 5, 7)
    (got,) = half.encode_images([span])
    (want,) = model.encode_images([span])
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()


def test_bad_patches_are_one_line_errors(model):
    grid = ImageGrid(2, 2, 1, 1)
    with pytest.raises(ValueError, match="needs 588 values per patch; got 10"):
        model.encode_images([ImageSpan(0, grid, torch.zeros(4, 10), b"")])
    with pytest.raises(ValueError, match=r"merges 3 × 3 into 1 × 1 tokens; its grid says 2 × 1"):
        model.encode_images([ImageSpan(0, ImageGrid(2, 2, 2, 1), torch.zeros(4, 588), b"")])


def test_text_only_model_says_it_has_no_tower(tmp_path):
    model = DeepseekV41Model.from_pretrained(write_tiny_v41(tmp_path / "t"), K, dtype=torch.float32)
    assert model.vision is None and not any(n.startswith("vision.") for n in model.named_parameters())
    with pytest.raises(ValueError, match="has no vision tower"):
        model.encode_images([_span(3, 3, 0)])


# ---- the checkpoint, config and names -----------------------------------------------------------------------------


def test_the_placeholder_is_a_special_token_of_the_written_tokenizer(checkpoint, model):
    tok = load_tokenizer(checkpoint)
    ids = tok.encode(f"a{IMAGE_TOKEN}b", add_special_tokens=False).ids
    assert model.config.image_token_id in ids and model.config.image_token_id < model.config.vocab_size


def test_vision_config_fields():
    raw = {**V41_FLASH, "vision_config": {**V41_FLASH["vision_config"], "num_hidden_layers": 0}}
    assert DeepseekV41Config.from_hf(raw).to_model_config().vision is None
    full = DeepseekV41Config.from_hf(V41_FLASH).to_model_config()
    assert full.vision.head_dim == 64 and full.image_token_id == 129264
    bad = {**V41_FLASH, "vision_config": {**V41_FLASH["vision_config"], "num_attention_heads": 12}}
    with pytest.raises(ConfigError, match="heads of a multiple of 4 channels"):
        DeepseekV41Config.from_hf(bad)
    with pytest.raises(ConfigError, match="image_token_id 200000 must be a token id below vocab_size 129280"):
        DeepseekV41Config.from_hf({**V41_FLASH, "image_token_id": 200000}).to_model_config()


def test_transformers_style_names_load_under_the_release_names():
    assert model_name("model.vision.blocks.3.attn.wqkv.bias") == "vision.blocks.3.attn.wqkv.bias"
    assert model_name("model.aligner.w2.weight") == "aligner.w2.weight"
    assert model_name("model.image_newline") == "image_newline" and model_name("image_end") == "image_end"


def test_inspect_counts_the_vision_tower(checkpoint, model):
    mem = weight_memory(checkpoint)
    vision = {n: t for n, t in model.named_parameters().items() if model.inventory_part(n) == "vision"}
    norms = sum(t.numel() for n, t in vision.items() if n.endswith("norm.weight") or ".norm" in n)
    params = sum(t.numel() for t in vision.values())
    c, hid, layers = VISION["hidden_size"], model.config.hidden_size, VISION["num_hidden_layers"]
    per_block = 2 * c + 3 * c * c + 3 * c + c * c + c + 3 * VISION["intermediate_size"] * c  # norms, wqkv, wo, w1 (gate|up), w2
    assert params == 3 * 196 * c + c + layers * per_block + c + 9 * c * hid + hid + hid * hid + hid + 3 * hid
    assert norms == (2 * layers + 1) * c
    assert mem.parts["vision"].total_bytes == 2 * (params - norms) + 4 * norms  # bf16, norms in fp32
    assert mem.parts["vision"].per_rank_bytes == mem.parts["vision"].total_bytes


# ---- the attention op ---------------------------------------------------------------------------------------------


def _naive(q, k, v, cu, scale):
    t = q.shape[0]
    seg = torch.bucketize(torch.arange(t), cu[1:].long(), right=True)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    scores = scores.masked_fill((seg[:, None] != seg[None, :])[None], float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v.double())


@pytest.mark.parametrize("lengths", [[5], [3, 0, 9, 1], [300, 41]])
def test_vit_attention_reference_is_a_softmax_within_each_image(lengths):
    g = torch.Generator().manual_seed(len(lengths))
    t, h, d = sum(lengths), 16, 8
    q, k, v = (torch.randn(t, h, d, generator=g) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    got = K.vit_attention(q, k, v, cu, d**-0.5)
    torch.testing.assert_close(got.double(), _naive(q, k, v, cu, d**-0.5), atol=1e-5, rtol=1e-5)


def test_vit_attention_is_a_contract_op_with_a_spec():
    assert "vit_attention" in Kernels.ops() and "vit_attention" in SPECS
    names = [c.name for c in SPECS["vit_attention"].cases()]
    assert "one_image_t9_h2_d16" in names and "empty_batch" in names
    assert math.isclose(SPECS["vit_attention"].rms_limit(torch.bfloat16), 4e-3)

"""Tiny random DeepSeek V4.1 checkpoints: the release's composite config.json, tensors under its names.

Eight layers exercise every role: sliding (0, 1), a ratio-2 group (source 2, a
reindexing layer 3, a reusing layer 4) and a ratio-1 group (source 5, the
candidate source, with a reindexing layer 6 confined to its candidate blocks
and a reusing layer 7); Engram tables on layers 1 and 4, FP8 codes with UE8M0
scales, the bundled model's tokenizer for the compressed vocabulary.

``vision=True`` adds a small vision tower (``VISION``: 2 blocks of width 32, 14 × 14
patches merged 3 × 3, at most 64 tokens an image) with random weights, and the
image placeholder ``IMAGE_TOKEN`` as an added special token of the written
tokenizer (the bundled one has none), whose id becomes ``image_token_id``; the
vocabulary grows by one to hold it.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch

from deepinfer.engine import BUNDLED_MODEL
from deepinfer.loader.tokenizer import load_tokenizer
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import EngramLayout, compressed_vocabulary
from deepinfer_interfaces import Kernels

TEXT: dict[str, Any] = dict(
    vocab_size=4096, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=8, num_attention_heads=4,
    head_dim=32, qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=16, o_groups=2,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, routed_scaling_factor=1.5, gate_temp=1.25,
    sliding_window=8, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1],
    kv_source_layer_ids=[2, 5], index_source_layer_ids=[2, 3, 5, 6],
    index_n_heads=2, index_head_dim=16, index_topk=6,
    candidate_source_layer_id=5, candidate_topk_blocks=3, candidate_block_size=4,
    hc_mult=4, hc_sinkhorn_iters=20, rms_norm_eps=1e-6, max_position_embeddings=4096,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    engram_layer_ids=[1, 4], engram_max_ngram_size=4, engram_vocab_size=40, engram_n_heads=2, engram_head_dim=32,
    engram_pad_token_id=2, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1,
)

#: a small ``vision_config`` (the release's fields)
VISION: dict[str, Any] = dict(
    model_type="deepseek_v41_vision", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    patch_size=14, downsample_ratio=3, rope_theta=10000.0, max_image_tokens=64, min_pixels=56 * 56, max_wh_ratio=None,
)
#: the release's image placeholder token
IMAGE_TOKEN = "<｜deepseek_image｜>"


def release_name(name: str) -> str:
    """The release's name of a model parameter (the inverse of ``loader/names.py`` for V4.1's tensors)."""
    if name == "model.embed_tokens.weight":
        return "embed.weight"
    if name == "model.norm.weight":
        return "norm.weight"
    if name.startswith("model.layers."):
        name = name.removeprefix("model.")
        return name.replace(".attn.norm.weight", ".attn.kv_norm.weight")
    return name


def _engram_fields(text: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The compressed-vocabulary size and table row counts that ``text``'s Engram layout and the tokenizer give."""
    _, size = compressed_vocabulary(load_tokenizer(directory))
    layout = EngramLayout.build(
        text["engram_layer_ids"], text["engram_max_ngram_size"], text["engram_n_heads"], text["engram_vocab_size"], size,
    )
    return {"engram_compressed_vocab_size": size, "engram_num_embeddings": [layer.rows for layer in layout.layers]}


def _random(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Seeded by the name, so a tensor's values do not depend on which other tensors a config has."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
        return 1 + 0.2 * torch.randn(shape, generator=gen)
    if leaf.endswith("_fn"):
        return 0.05 * torch.randn(shape, generator=gen)
    if leaf.endswith("_base"):
        return 0.5 * torch.randn(shape, generator=gen)
    if leaf.endswith("_scale"):
        return 0.5 + torch.rand(shape, generator=gen)
    if leaf in ("attn_sink", "bias", "bias_vl"):
        return (1.0 if leaf == "attn_sink" else 0.1) * torch.randn(shape, generator=gen)
    if leaf in ("q_weight", "k_weight"):
        return 1 + 0.3 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5


def _table(rows: int, head_dim: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rows)
    codes = torch.randn(rows, head_dim, generator=gen).to(torch.float8_e4m3fn)
    scales = torch.randint(125, 129, (rows, head_dim // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return {"embed.weight": codes, "embed.scale": scales}


#: the release's quantization: FP8 e4m3 linears in 32 x 32 blocks with UE8M0 scales, FP4 experts
QUANTIZATION = {
    "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
    "activation_scheme": "dynamic", "expert_dtype": "fp4",
}


def add_image_token(directory: Path) -> int:
    """Add ``IMAGE_TOKEN`` to ``directory``'s tokenizer.json as a special token; returns its id."""
    from tokenizers import AddedToken, Tokenizer

    path = directory / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tok.save(str(path))
    return tok.token_to_id(IMAGE_TOKEN)


def write_tiny_v41(
    directory: Path, seed: int = 0, engram_value_zero: bool = False, quantized: bool = False,
    vision: bool | dict[str, Any] = False, **text: Any,
) -> Path:
    """Write a tiny V4.1 checkpoint into ``directory`` (``text`` overrides ``TEXT``); returns it.

    ``engram_value_zero``: every Engram projection's value rows are zero, so the layers add nothing.
    ``quantized``: stored as the release stores them (``QUANTIZATION``, top-level ``quantization_config``;
    the vision tower in BF16).
    ``vision``: with a vision tower (``VISION``, or the ``vision_config`` given) and the image placeholder token."""
    from safetensors.torch import save_file

    from deepinfer.models.deepseek_v41.model import DeepseekV41Model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, directory / name)
    fields = {**TEXT, **text}
    image_token = add_image_token(directory) if vision else None
    if image_token is not None:
        fields["vocab_size"] = max(fields["vocab_size"], image_token + 1)
    if fields["engram_layer_ids"]:
        fields.update(_engram_fields(fields, directory))
    raw = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": fields}
    if vision:
        raw.update(vision_config=VISION if vision is True else vision, image_token_id=image_token)
    if quantized:
        raw["quantization_config"] = QUANTIZATION
    (directory / "config.json").write_text(json.dumps(raw, indent=1))
    config = DeepseekV41Config.from_hf(raw).to_model_config()
    model = DeepseekV41Model(config, Kernels(), dtype=torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in sorted(model.named_parameters().items()):
        tensors[release_name(name)] = _random(name, tuple(param.shape), seed).to(param.dtype)
    d = config.hidden_size
    for layer, rows in zip(fields["engram_layer_ids"], fields.get("engram_num_embeddings", [])):
        for key, value in _table(rows, fields["engram_head_dim"], seed).items():
            tensors[f"layers.{layer}.engram.{key}"] = value
        if engram_value_zero:
            tensors[f"layers.{layer}.engram.wkv.weight"][config.hc_mult * d :] = 0
    if quantized:
        from .published import _stored

        release = {"quantization_config": QUANTIZATION, "expert_dtype": "fp4"}
        tensors = {k: v for name, t in tensors.items() for k, v in _stored(name, t, release).items()} | {
            name: t for name, t in tensors.items() if ".engram.embed." in name
        }
    save_file(tensors, str(directory / "model.safetensors"))
    return directory

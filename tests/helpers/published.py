"""Tiny DeepSeek-V4 checkpoints in the layout DeepSeek publishes, and the release's V4-Flash config.

``make_published_checkpoint`` writes what a user downloads, at toy size: the
release's ``config.json`` fields (``compress_ratios`` with a trailing entry for
the draft layer, ``qk_rope_head_dim``, ``num_hash_layers``, ``rope_scaling``
YaRN, ``topk_method``, ``expert_dtype``, ``quantization_config``), raw tensor
names without the ``model.`` prefix, FP8 e4m3 linears with 128 x 128 block
scales named ``.scale`` (``F8_E8M0`` exponents, or float32 as V4-Flash-Base
has them), routed experts as ``I8``-packed FP4 pairs with 1 x 32 ``F8_E8M0``
scales (or FP8), BF16 elsewhere, F32 hyper-connections, an ``mtp.0`` block, two
shards and ``model.safetensors.index.json``.

With ``draft="dspark"`` the draft is V4-Flash-DSpark's instead of the NextN
block: ``dspark_*`` config fields (the stage count left to the ``mtp.{i}``
prefixes, ``num_nextn_predict_layers`` 1 as the release has it) and stages
``mtp.0..{S-1}`` under the release's names (``attn.kv_norm``, ``hc_head_fn``,
``markov_head.markov_w1``, ...) in its dtypes: FP8 ``main_proj`` and stage
linears, FP4 routed experts, BF16 norms and heads, F32 hyper-connections.

The weights come from a seeded transformers model, so values are realistic and
the codes and exponents vary block by block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from deepinfer_interfaces.quant import quantize

from .checkpoints import BOS_ID, EOS_ID, VOCAB_SIZE, _randomise, save_byte_tokenizer

#: published names of the linears the release stores in FP8 e4m3, 128 x 128 blocks
FP8_WEIGHTS = re.compile(
    r"^(mtp\.\d+|layers\.\d+)\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|e_proj|h_proj|main_proj)\.weight$"
)
#: published names of the routed experts' weights (FP4 e2m1 in 1 x 32 blocks, or FP8)
EXPERT_WEIGHTS = re.compile(r"^(mtp\.\d+|layers\.\d+)\.ffn\.experts\.\d+\.w[123]\.weight$")
#: published names the release keeps in float32
F32_TENSORS = re.compile(r"((^|\.)hc_(head|attn|ffn)_(fn|base|scale)|\.attn_sink|\.ape|\.gate\.bias)$")

# One layer of each attention type with two 128-column FP8 blocks in the hidden dimension;
# every dimension is a whole number of blocks or below one block (transformers' dequantizer
# reads the block size off the scale grid).
TINY_RELEASE: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=VOCAB_SIZE,
    hidden_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    qk_rope_head_dim=16,
    q_lora_rank=128,
    o_lora_rank=128,
    o_groups=2,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    topk_method="noaux_tc",
    num_hash_layers=1,
    compress_ratios=[0, 4, 128, 0],
    compress_rope_theta=160000.0,
    rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
    sliding_window=8,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=64,
    hc_mult=2,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    swiglu_limit=10.0,
    num_nextn_predict_layers=1,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    expert_dtype="fp4",
    quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
    },
)


def published_name(saved: str) -> str:
    """The release's name of a tensor transformers' ``save_pretrained`` names ``saved``."""
    rules = (
        (r"^model\.embed_tokens\.weight$", "embed.weight"),
        (r"^model\.norm\.weight$", "norm.weight"),
        (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
        (r"^model\.layers\.(\d+)\.attn\.norm\.weight$", r"layers.\1.attn.kv_norm.weight"),
        (r"^model\.layers\.(\d+)\.(.+)$", r"layers.\1.\2"),
    )
    for pattern, replacement in rules:
        if re.match(pattern, saved):
            return re.sub(pattern, replacement, saved)
    return saved


def release_config(**overrides: Any) -> dict[str, Any]:
    """``TINY_RELEASE`` with ``overrides`` (``quantization_config`` keys merge into it)."""
    cfg = json.loads(json.dumps(TINY_RELEASE))
    quant = overrides.pop("quantization_config", None)
    cfg.update(overrides)
    if quant is not None:
        cfg["quantization_config"] = {**cfg["quantization_config"], **quant}
    return cfg


def _hf_model(release: dict[str, Any], seed: int):
    """The seeded, randomised transformers model of a release config (fp32, eval mode)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    fields = {k: v for k, v in release.items() if k not in ("architectures", "torch_dtype", "quantization_config", "expert_dtype")}
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**fields))
    _randomise(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def _mtp_block(layer0: dict[str, torch.Tensor], d: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A draft block in the release's names: layer 0's tensors under ``mtp.0`` plus its own projections and norms."""
    out = {name.replace("layers.0.", "mtp.0.", 1): t.clone() for name, t in layer0.items()}
    out.update({
        "mtp.0.enorm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
        "mtp.0.hnorm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
        "mtp.0.norm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
        "mtp.0.e_proj.weight": torch.randn(d, d, generator=gen) * d**-0.5,
        "mtp.0.h_proj.weight": torch.randn(d, d, generator=gen) * d**-0.5,
    })
    return out


#: the DSpark fields of the tiny release's config.json (the stage count comes from the ``mtp.{i}`` prefixes)
DSPARK_FIELDS: dict[str, Any] = dict(
    dspark_block_size=5,
    dspark_noise_token_id=VOCAB_SIZE - 1,
    dspark_target_layer_ids=[1, 2],
    dspark_markov_rank=16,
)
DSPARK_STAGES = 3


def _dspark_stages(tensors: dict[str, torch.Tensor], release: dict[str, Any], stages: int,
                   gen: torch.Generator) -> dict[str, torch.Tensor]:
    """V4-Flash-DSpark's draft in the release's names: each stage is layer 0's attention (sliding window) and
    layer 1's routed MoE, perturbed per stage; ``main_*`` on the first stage, the heads on the last."""
    d, v, r = release["hidden_size"], release["vocab_size"], release["dspark_markov_rank"]
    width = len(release["dspark_target_layer_ids"]) * d
    attn = re.compile(r"^layers\.0\.(attn\.|attn_norm\.|hc_attn_)")
    ffn = re.compile(r"^layers\.1\.(ffn\.|ffn_norm\.|hc_ffn_)")
    out: dict[str, torch.Tensor] = {}
    for i in range(stages):
        for name, t in tensors.items():
            if attn.match(name) or ffn.match(name):
                shake = 1 + 0.05 * torch.randn(t.shape, generator=gen) if t.is_floating_point() else 1
                out[f"mtp.{i}." + name.split(".", 2)[2]] = t * shake
    last = f"mtp.{stages - 1}"
    out.update({
        "mtp.0.main_proj.weight": torch.randn(d, width, generator=gen) * width**-0.5,
        "mtp.0.main_norm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
        f"{last}.norm.weight": 1 + 0.1 * torch.randn(d, generator=gen),
        f"{last}.markov_head.markov_w1.weight": torch.randn(v, r, generator=gen) * 0.5,
        f"{last}.markov_head.markov_w2.weight": torch.randn(v, r, generator=gen) * 0.5,
        f"{last}.confidence_head.proj.weight": torch.randn(1, d + r, generator=gen) * (d + r) ** -0.5,
    })
    for part in ("fn", "base", "scale"):
        out[f"{last}.hc_head_{part}"] = tensors[f"hc_head_{part}"] * (1 + 0.05 * torch.randn(tensors[f"hc_head_{part}"].shape, generator=gen))
    return out


def _stored(name: str, t: torch.Tensor, release: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``name``'s tensors as the release stores them: codes plus ``.scale``, F32, or BF16."""
    quant = release.get("quantization_config")
    expert_dtype = release.get("expert_dtype", "fp8")
    ue8m0 = quant is not None and quant.get("scale_fmt") == "ue8m0"
    scale_name = name[: -len("weight")] + "scale"
    if quant is not None and (FP8_WEIGHTS.match(name) or (EXPERT_WEIGHTS.match(name) and expert_dtype == "fp8")):
        q = quantize(t, "e4m3", tuple(quant["weight_block_size"]), ue8m0=ue8m0)
        scale = q.scales.view(torch.float8_e8m0fnu) if ue8m0 else q.scales
        return {name: q.codes, scale_name: scale}
    if quant is not None and EXPERT_WEIGHTS.match(name) and expert_dtype == "fp4":
        q = quantize(t, "e2m1", (1, 32), ue8m0=True)
        return {name: q.codes.view(torch.int8), scale_name: q.scales.view(torch.float8_e8m0fnu)}
    if F32_TENSORS.search(name) or not t.is_floating_point():
        return {name: t.contiguous()}
    return {name: t.to(torch.bfloat16).contiguous()}


def make_published_checkpoint(
    tmp_path: Path, seed: int = 0, name: str = "published", *, draft: str = "nextn", stages: int = DSPARK_STAGES, **overrides: Any
) -> Path:
    """Write a tiny checkpoint in DeepSeek's published layout (see the module docstring); returns its directory.

    ``draft`` is ``"nextn"`` (an ``mtp.0`` NextN block) or ``"dspark"`` (``stages`` DSpark stages and the
    ``dspark_*`` fields). ``overrides`` change ``TINY_RELEASE`` fields, e.g. ``expert_dtype="fp8"`` or
    ``quantization_config={"scale_fmt": "float"}`` (V4-Flash-Base).
    """
    from safetensors.torch import load_file, save_file

    if draft not in ("nextn", "dspark"):
        raise ValueError(f"draft {draft!r} is not 'nextn' or 'dspark'")
    if draft == "dspark":
        base = release_config()
        ratios = base["compress_ratios"][: base["num_hidden_layers"]] + [0] * stages
        overrides = {**DSPARK_FIELDS, "compress_ratios": ratios, **overrides}
    release = release_config(**overrides)
    out = Path(tmp_path) / name
    model = _hf_model(release, seed)
    model.save_pretrained(str(out / "saved"))
    saved: dict[str, torch.Tensor] = {}
    for f in sorted((out / "saved").glob("*.safetensors")):
        saved.update(load_file(str(f)))
    for f in (out / "saved").iterdir():
        f.unlink()
    (out / "saved").rmdir()

    tensors = {published_name(k): v for k, v in saved.items()}
    gen = torch.Generator().manual_seed(seed + 2)
    if draft == "dspark":
        tensors.update(_dspark_stages(tensors, release, stages, gen))
    else:
        layer0 = {k: v for k, v in tensors.items() if k.startswith("layers.0.")}
        tensors.update(_mtp_block(layer0, release["hidden_size"], gen))
    stored: dict[str, torch.Tensor] = {}
    for k, v in tensors.items():
        stored.update(_stored(k, v, release))

    # two shards split by layer, the draft block last, as the release orders them
    first = {k: v for k, v in stored.items() if not k.startswith("mtp.") and not re.match(r"^layers\.[1-9]", k)}
    second = {k: v for k, v in stored.items() if k not in first}
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    weight_map = {}
    for file, part in shards.items():
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in part})
    total = sum(t.numel() * t.element_size() for t in stored.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(release, indent=1))
    save_byte_tokenizer(out)
    return out


# ---- the release's V4-Flash, for sizing on the meta device ----------------------------

#: DeepSeek-V4-Flash's config.json fields that size its weights
V4_FLASH: dict[str, Any] = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_lora_rank=1024,
    o_groups=8,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=6,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    topk_method="noaux_tc",
    num_hash_layers=3,
    compress_ratios=[0, 0] + [4 if i % 2 else 128 for i in range(1, 42)] + [0],
    compress_rope_theta=160000.0,
    rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    swiglu_limit=10.0,
    num_nextn_predict_layers=1,
    max_position_embeddings=1048576,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    expert_dtype="fp4",
    quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
    },
)


def stored_bytes(release: dict[str, Any], with_mtp: bool = False) -> int:
    """Bytes the release's layout stores for ``release``'s main model, counted from shapes alone.

    Written from the published tensor list (one transformer block per layer,
    ``mtp.*`` only with ``with_mtp``), independently of the engine's model code.
    """
    d, v, n = release["hidden_size"], release["vocab_size"], release["num_hidden_layers"]
    h, hd, q_rank = release["num_attention_heads"], release["head_dim"], release["q_lora_rank"]
    o_rank, groups = release["o_lora_rank"], release["o_groups"]
    inter, experts, shared = release["moe_intermediate_size"], release["n_routed_experts"], release["n_shared_experts"]
    ih, ihd, hc = release["index_n_heads"], release["index_head_dim"], release["hc_mult"]
    ratios = release["compress_ratios"][:n]
    n_hash = release["num_hash_layers"]
    bn, bk = release["quantization_config"]["weight_block_size"]
    ue8m0 = release["quantization_config"]["scale_fmt"] == "ue8m0"
    expert_fp4 = release.get("expert_dtype") == "fp4"

    def fp8(rows: int, cols: int) -> int:
        return rows * cols + -(-rows // bn) * -(-cols // bk) * (1 if ue8m0 else 4)

    def expert(rows: int, cols: int) -> int:
        return rows * cols // 2 + rows * (cols // 32) if expert_fp4 else fp8(rows, cols)

    bf16, f32 = 2, 4
    mix = (2 + hc) * hc
    total = 2 * v * d * bf16 + d * bf16 + (hc * hc * d + hc + 1) * f32  # embed, head, norm, hc head
    for i in range(n):
        layer = 2 * d * bf16 + 2 * (mix * hc * d + mix + 3) * f32  # two norms, two hyper-connections
        layer += fp8(q_rank, d) + q_rank * bf16 + fp8(h * hd, q_rank) + fp8(hd, d) + hd * bf16
        layer += fp8(groups * o_rank, h * hd // groups) + fp8(d, groups * o_rank) + h * f32  # wo_a, wo_b, sinks
        ratio = ratios[i]
        if ratio:
            width = 2 * hd if ratio == 4 else hd  # overlapping windows in CSA
            layer += 2 * width * d * bf16 + ratio * width * f32 + hd * bf16  # wkv, wgate, ape, norm
            if ratio == 4:
                iwidth = 2 * ihd
                layer += fp8(ih * ihd, q_rank) + ih * d * bf16  # indexer wq_b, weights_proj
                layer += 2 * iwidth * d * bf16 + ratio * iwidth * f32 + ihd * bf16
        layer += experts * d * bf16  # router
        layer += experts * f32 if i >= n_hash else v * release["num_experts_per_tok"] * 8  # bias, or the int64 hash table
        layer += experts * (2 * expert(inter, d) + expert(d, inter))
        layer += shared * (2 * fp8(inter, d) + fp8(d, inter))
        total += layer
    return total


# ---- the release's DeepSeek V4.1-Flash (model_type deepseek_v41), for its config and sizing ----------

#: DeepSeek-V4.1-Flash's composite config.json, as released (deepseek-ai/DeepSeek-V4.1-Flash, revision dba1be0a)
V41_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "image_token_id": 129264,
    "quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4",
    },
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304, "num_hidden_layers": 40,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
        "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
        "tie_word_embeddings": False, "max_position_embeddings": 1048576, "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536},
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
        "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
        "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    },
    "vision_config": {
        "model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16,
        "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3,
        "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None,
    },
}
#: one routed expert as stored: w1, w2, w3 of 2304 x 5120 in FP4 e2m1 with one E8M0 scale per 32 columns
V41_ROUTED_EXPERT_BYTES = 18_800_640
#: one Engram table row: 256 FP8 e4m3 codes and 8 E8M0 scales (``layers.N.engram.embed.weight`` / ``.scale``)
V41_ENGRAM_ROW_BYTES = 264
#: rows of the two Engram tables (layers 1 and 14)
V41_ENGRAM_NUM_EMBEDDINGS = (384_006_168, 384_016_682)
#: ``metadata.total_size`` of the release's model.safetensors.index.json (vision tower included)
V41_CHECKPOINT_BYTES = 510_286_023_000
#: the release's parameter counts: DSpark draft (routed experts, shared experts, markov head, the rest)
V41_DRAFT_PARAMS = 13_589_544_960 + 106_168_320 + 66_191_360 + 463_457_890
#: the vision tower, aligner and image delimiters, as stored (BF16)
V41_VISION_PARAMS = 485_268_480


def v41_norm_elements(text: dict[str, Any] = V41_FLASH["text_config"]) -> tuple[int, int]:
    """Elements of the norms (and the draft's confidence head) a V4.1 checkpoint stores in BF16 and the
    engine holds in fp32: (backbone, draft). Per layer the kv, q, attention and FFN norms; per KV source the
    compressor's and the indexer key's; the final norm; per draft stage the same four, then the draft's
    main and last norms and its confidence head."""
    d, hd, q = text["hidden_size"], text["head_dim"], text["q_lora_rank"]
    per_layer = hd + q + 2 * d
    sources = len(text["kv_source_layer_ids"])
    backbone = text["num_hidden_layers"] * per_layer + sources * (hd + text["index_head_dim"]) + d
    draft = text["num_nextn_predict_layers"] * per_layer + 2 * d + d + text["dspark_markov_rank"]
    return backbone, draft

"""Tiny random DeepSeek-V4 checkpoints written by transformers, for parity and engine tests.

``make_tiny_checkpoint(tmp_path, variant)`` builds ``DeepseekV4ForCausalLM`` from
one of the ``VARIANTS`` with a fixed seed, gives every parameter and buffer a
non-trivial random value (transformers initialises norms to 1, sinks / biases /
position biases to 0 and the hash table to expert 0, which would hide bugs),
saves it with ``save_pretrained`` next to a byte-level tokenizer, and adds a
shard of ``mtp.*`` tensors like the real checkpoint's draft layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

BOS_TOKEN = "<|begin▁of▁sentence|>"
EOS_TOKEN = "<|end▁of▁sentence|>"
BYTE_VOCAB = 256
BOS_ID, EOS_ID = BYTE_VOCAB, BYTE_VOCAB + 1
VOCAB_SIZE = BYTE_VOCAB + 4

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    moe_intermediate_size=16,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=24,
    partial_rotary_factor=0.5,
    n_routed_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    index_n_heads=2,
    index_head_dim=8,
    index_topk=64,
    o_lora_rank=8,
    hc_sinkhorn_iters=20,
    initializer_range=0.1,
    max_position_embeddings=4096,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)

#: name -> DeepseekV4Config keywords on top of ``_COMMON``
VARIANTS: dict[str, dict[str, Any]] = {
    # every layer type once, hash then routed MoE, grouped output projection
    "mixed": dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_mult=2,
        o_groups=2,
    ),
    # compressed layers with a YaRN compress rope, four streams, an active SwiGLU clamp
    "compressed_yarn": dict(
        num_hidden_layers=4,
        layer_types=[
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "sliding_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        hc_mult=4,
        o_groups=4,
        swiglu_limit=0.3,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=256,
    ),
    # sliding and heavily compressed only, one output group, more experts, LM head tied to the embedding
    "sliding_hca": dict(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "heavily_compressed_attention"],
        mlp_layer_types=["moe", "moe"],
        hc_mult=2,
        o_groups=1,
        n_routed_experts=6,
        num_experts_per_tok=3,
        routed_scaling_factor=2.0,
        tie_word_embeddings=True,
    ),
    # the lightning indexer keeps 3 of up to 11 compressed entries, with 8 heads so scores rarely tie
    "csa_topk": dict(
        num_hidden_layers=2,
        layer_types=["compressed_sparse_attention", "compressed_sparse_attention"],
        mlp_layer_types=["moe", "moe"],
        hc_mult=2,
        o_groups=2,
        index_n_heads=8,
        index_topk=3,
    ),
    # a million-token position range (YaRN over a 64K original range) with V4-Flash's ratios 4 and 128:
    # one layer of each kind, for long-context prefill
    "long_context": dict(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_mult=2,
        o_groups=2,
        index_topk=16,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
        max_position_embeddings=1 << 20,
    ),
}


def tiny_config(variant: str):
    """The transformers ``DeepseekV4Config`` of ``variant``."""
    from transformers import DeepseekV4Config

    if variant not in VARIANTS:
        raise KeyError(f"unknown tiny variant {variant!r}; choose from {sorted(VARIANTS)}")
    return DeepseekV4Config(**{**_COMMON, **VARIANTS[variant]})


def _randomise(model, gen: torch.Generator) -> None:
    """Replace transformers' constant initialisations by seeded random values."""
    num_experts = model.config.n_routed_experts
    top_k = model.config.num_experts_per_tok
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif leaf in ("position_bias", "sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif leaf in ("base", "hc_base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif leaf in ("scale", "hc_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            elif name.endswith("tid2eid"):
                rows = [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))


def build_hf_model(variant: str, seed: int = 0):
    """The seeded, randomised transformers model of ``variant`` (fp32, eval mode)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(tiny_config(variant))
    gen = torch.Generator().manual_seed(seed + 1)
    _randomise(model, gen)
    return model.eval()


def save_byte_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer without merges: one token per byte, plus BOS/EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in enumerate(sorted(alphabet, key=lambda ch: _byte_of(ch)))}
    vocab = {ch: b for b, ch in byte_to_char.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS_TOKEN, EOS_TOKEN])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)
    fast.save_pretrained(str(directory))


def _byte_of(ch: str) -> int:
    """The byte GPT-2's byte-to-unicode table maps to ``ch``."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def _mtp_tensors(model, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Stand-ins for the checkpoint's DSpark draft-layer tensors (``mtp.*``)."""
    d = model.config.hidden_size
    return {
        "mtp.0.enorm.weight": torch.randn(d, generator=gen),
        "mtp.0.hnorm.weight": torch.randn(d, generator=gen),
        "mtp.0.e_proj.weight": torch.randn(d, d, generator=gen),
    }


def byte_tokens(n: int, seed: int) -> list[int]:
    """``n`` token ids of the byte tokenizer's range, the same for the same ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def make_tiny_checkpoint(tmp_path: Path, variant: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """Write the ``variant`` checkpoint (weights in ``dtype``, fp32-kept modules in fp32)
    with tokenizer and an ``mtp.safetensors`` shard; returns its directory."""
    from safetensors.torch import save_file

    model = build_hf_model(variant, seed)
    if dtype != torch.float32:
        keep = tuple(model._keep_in_fp32_modules_strict)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not any(k in name.split(".") for k in keep):
                    p.data = p.data.to(dtype)
    out = Path(tmp_path) / f"tiny-{variant}-{str(dtype).removeprefix('torch.')}"
    model.save_pretrained(str(out))
    save_byte_tokenizer(out)
    save_file(_mtp_tensors(model, torch.Generator().manual_seed(seed + 2)), str(out / "mtp.safetensors"))
    return out

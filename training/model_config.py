"""The shapes of the bundled tiny DeepSeek-V4 target (and of the seconds-long smoke model)."""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"

#: every V4 mechanism at toy scale: all three attention types, hash then routed MoE, mHC
TINY: dict[str, Any] = dict(
    hidden_size=128,
    moe_intermediate_size=128,
    num_hidden_layers=4,
    layer_types=[SLIDING, CSA, HCA, CSA],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    num_attention_heads=4,
    head_dim=32,
    partial_rotary_factor=0.5,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    sliding_window=32,
    compress_rates={CSA: 4, HCA: 16},
    index_n_heads=2,
    index_head_dim=16,
    index_topk=16,
    hc_mult=2,
    hc_sinkhorn_iters=20,
    swiglu_limit=10.0,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    compress_rope_theta=40000.0,
    initializer_range=0.02,
    tie_word_embeddings=False,
)

#: a micro model for the seconds-long smoke run of the training script
SMOKE: dict[str, Any] = dict(
    TINY,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    layer_types=[SLIDING, CSA, HCA],
    mlp_layer_types=["hash_moe", "moe", "moe"],
    num_attention_heads=2,
    head_dim=16,
    q_lora_rank=16,
    o_lora_rank=16,
    sliding_window=8,
    index_n_heads=1,
    index_head_dim=8,
    index_topk=4,
    n_routed_experts=8,
)


def hf_config(shape: dict[str, Any], vocab_size: int, bos_id: int, eos_id: int):
    """The transformers ``DeepseekV4Config`` of ``shape`` for a vocabulary of ``vocab_size``."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        **shape,
        vocab_size=vocab_size,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        attn_implementation="eager",
    )

"""ModelConfig parsing: the transformers layout, legacy fields, rope tables, clear errors."""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.models.common import CSA, HCA, SLIDING, ModelConfig
from deepinfer.models.common.rope import Rotary
from deepinfer.models.registry import load_config, parse_config


BASE = dict(
    model_type="deepseek_v4",
    vocab_size=64,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=24,
    n_routed_experts=4,
    num_experts_per_tok=2,
    o_groups=2,
    o_lora_rank=8,
)

LEGACY = dict(
    BASE,
    compress_ratios=[0, 4, 128, 4, 0],  # one extra entry for the MTP layer, as real checkpoints ship
    num_hash_layers=2,
    qk_rope_head_dim=8,
    compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
)


def _hf(raw: dict):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"})


def _assert_rope_matches(ours: ModelConfig, raw: dict):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    hf = DeepseekV4RotaryEmbedding(_hf(raw))
    for label, params in (("main", ours.rope_main), ("compress", ours.rope_compress)):
        rot = Rotary(params, ours.qk_rope_head_dim, ours.max_position_embeddings, "cpu")
        assert torch.equal(rot.inv_freq, getattr(hf, f"{label}_inv_freq")), label
        assert rot.attention_scaling == getattr(hf, f"{label}_attention_scaling"), label


def test_legacy_fields_fold_like_transformers():
    ours = parse_config(LEGACY)
    hf = _hf(LEGACY)
    assert ours.layer_types == hf.layer_types == [SLIDING, CSA, HCA, CSA]
    assert ours.mlp_layer_types == hf.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert ours.num_hash_layers == 2
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim == 8
    assert ours.rope_compress.rope_type == "yarn" and ours.rope_compress.attention_factor == 1.0
    assert ours.compress_ratio(CSA) == 4 and ours.compress_ratio(HCA) == 128 and ours.compress_ratio(SLIDING) == 0
    _assert_rope_matches(ours, LEGACY)


def test_defaults_follow_transformers_schedule():
    ours = parse_config(dict(BASE, num_hidden_layers=6))
    hf = _hf(dict(BASE, num_hidden_layers=6))
    assert ours.layer_types == hf.layer_types
    assert ours.mlp_layer_types == hf.mlp_layer_types
    assert ours.qk_rope_head_dim == 2  # 64/512 of head_dim 16
    _assert_rope_matches(ours, dict(BASE, num_hidden_layers=6))


def test_nested_yarn_without_attention_factor_uses_mscale():
    raw = dict(
        BASE,
        partial_rotary_factor=0.5,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000.0},
            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 8.0, "original_max_position_embeddings": 32},
        },
    )
    ours = parse_config(raw)
    rot = Rotary(ours.rope_compress, ours.qk_rope_head_dim, ours.max_position_embeddings, "cpu")
    assert rot.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(8.0)).item() + 1)
    _assert_rope_matches(ours, raw)


def test_saved_config_round_trips(tmp_path):
    from tests.helpers.checkpoints import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path, "compressed_yarn")
    cfg = load_config(ckpt)
    assert cfg.layer_types == [HCA, CSA, SLIDING, CSA]
    assert cfg.compress_ratio(HCA) == 16 and cfg.hc_mult == 4 and cfg.swiglu_limit == 0.3
    assert cfg.rope_compress.rope_type == "yarn"


@pytest.mark.parametrize(
    "raw, words",
    [
        (dict(BASE, model_type="llama"), ["model_type 'llama'", "deepseek_v4"]),
        ({k: v for k, v in BASE.items() if k != "model_type"}, ["model_type None"]),
        ({k: v for k, v in BASE.items() if k != "head_dim"}, ["head_dim", "missing"]),
        (dict(BASE, layer_types=[SLIDING] * 3), ["layer_types has 3 entries", "num_hidden_layers is 4"]),
        (dict(BASE, layer_types=[SLIDING, "full_attention", SLIDING, SLIDING]), ["full_attention"]),
        (dict(BASE, compress_ratios=[0, 4, 8, 0]), ["compress_ratios holds [8]"]),
        (dict(BASE, num_key_value_heads=2), ["num_key_value_heads"]),
        (dict(BASE, o_groups=3), ["o_groups=3"]),
        (dict(BASE, rope_parameters={"rope_type": "llama3", "factor": 2.0}), ["llama3"]),
    ],
)
def test_bad_configs_raise_one_line_errors(raw, words):
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg

"""deepinfer.loader: config/tokenizer files, streaming safetensors into params, FP8/FP4 dequantization."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepinfer.errors import CheckpointError, DeepInferError
from deepinfer.models.registry import load_config
from deepinfer.loader import (
    load_tokenizer,
    load_weights,
    model_name,
    read_config,
    read_generation_config,
)

from deepinfer_interfaces.quant import quantize


def quantize_fp8_blockwise(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and float32 block scales of ``w`` (as V3 and V4-Flash-Base checkpoints store them)."""
    q = quantize(w, "e4m3", block, ue8m0=False)
    return q.codes, q.scales


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def write_config(directory: Path, **extra) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 8, **extra}))


def params_like(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Preallocated params under the model names of the checkpoint's tensors, their shapes, filled with a sentinel."""
    out = {}
    for name, t in tensors.items():
        out[model_name(name)] = torch.full(t.shape, 7, dtype=dtype or t.dtype)
    return out


def block_reference(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Dequantization written block by block, independent of the loader's vectorised version."""
    out = torch.empty(values.shape, dtype=torch.float32)
    rows, cols = values.shape[-2:]
    bm, bn = block
    for i in range(math.ceil(rows / bm)):
        for j in range(math.ceil(cols / bn)):
            r, c = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
            out[..., r, c] = values[..., r, c].float() * scale[..., i, j].float()[..., None, None]
    return out


@pytest.fixture
def simple_ckpt(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "embed.weight": torch.randn(16, 8),
        "layers.0.attn.wq_a.weight": torch.randn(4, 8).to(torch.bfloat16),
        "layers.0.ffn.gate.tid2eid": torch.randint(0, 4, (16, 2), dtype=torch.int64),
        "norm.weight": torch.randn(8),
        "mtp.0.enorm.weight": torch.randn(8),
    }
    write_config(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


# ----------------------------------------------------------------- config files


def test_read_config_and_generation_config(tmp_path):
    write_config(tmp_path, num_hidden_layers=3)
    assert read_config(tmp_path) == {"model_type": "deepseek_v4", "hidden_size": 8, "num_hidden_layers": 3}
    assert read_config(str(tmp_path))["num_hidden_layers"] == 3
    assert read_generation_config(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos_token_id": 1}))
    assert read_generation_config(tmp_path) == {"temperature": 0.6, "eos_token_id": 1}


def test_read_config_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"model directory .*nope.* does not exist"):
        read_config(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no config.json in"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4",')
    with pytest.raises(CheckpointError, match=r"config.json.* is not valid JSON \(.* at line 1"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert read_config(tmp_path) == {"model_type": "llama"}  # the loader reads; the model registry refuses
    with pytest.raises(CheckpointError) as err:
        load_config(tmp_path)
    assert str(err.value) == "unknown model_type 'llama': deepinfer runs deepseek_v4 and deepseek_v41 checkpoints"
    assert isinstance(err.value, DeepInferError)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"generation_config.json.* is not valid JSON"):
        read_generation_config(tmp_path)


# -------------------------------------------------------------------- tokenizer


def test_load_tokenizer_trained_bpe(tmp_path):
    from training.tokenizer import train_tokenizer

    corpus = ["the quick brown fox jumps over the lazy dog", "deep seek infers tokens quickly", "héllo wörld ✓"] * 20
    tok = train_tokenizer(corpus, 300, ["<|begin▁of▁sentence|>", "<|end▁of▁sentence|>"])
    tok.save(str(tmp_path / "tokenizer.json"))

    loaded = load_tokenizer(tmp_path)
    text = "the lazy fox infers héllo ✓"
    assert loaded.encode(text).ids == tok.encode(text).ids
    assert loaded.decode(loaded.encode(text).ids) == text
    assert loaded.token_to_id("<|end▁of▁sentence|>") == 1
    assert loaded.get_vocab_size() == tok.get_vocab_size()


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"no tokenizer.json in .*copy the checkpoint's tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(CheckpointError, match=r"tokenizer file .*tokenizer.json.* cannot be read \("):
        load_tokenizer(tmp_path)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        load_tokenizer(tmp_path / "missing")


# ---------------------------------------------------------------- load_weights


def test_load_single_file_casts_and_keeps_mtp(simple_ckpt):
    directory, tensors = simple_ckpt
    main = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    params = params_like(main)
    params[model_name("embed.weight")] = torch.zeros(16, 8, dtype=torch.bfloat16)  # cast fp32 -> bf16
    params[model_name("layers.0.attn.wq_a.weight")] = torch.nn.Parameter(torch.zeros(4, 8))  # cast bf16 -> fp32, grad param
    params[model_name("layers.0.ffn.gate.tid2eid")] = torch.zeros(16, 2, dtype=torch.int32)  # int64 -> int32
    kept = load_weights(params, directory)

    assert torch.equal(params[model_name("embed.weight")], tensors["embed.weight"].to(torch.bfloat16))
    assert torch.equal(params[model_name("layers.0.attn.wq_a.weight")].data, tensors["layers.0.attn.wq_a.weight"].float())
    assert torch.equal(params[model_name("layers.0.ffn.gate.tid2eid")], tensors["layers.0.ffn.gate.tid2eid"].int())
    assert torch.equal(params[model_name("norm.weight")], tensors["norm.weight"])
    assert list(kept) == ["mtp.0.enorm.weight"]
    assert torch.equal(kept["mtp.0.enorm.weight"], tensors["mtp.0.enorm.weight"])


def test_load_sharded_with_index_and_cross_shard_scale(tmp_path):
    torch.manual_seed(1)
    w = torch.randn(40, 24)
    w_fp8, scale = quantize_fp8_blockwise(w, block=(16, 16))
    shards = {
        "model-00001-of-00003.safetensors": {"embed.weight": torch.randn(10, 6), "layers.0.attn.wq_a.weight": w_fp8},
        "model-00002-of-00003.safetensors": {"layers.0.attn.wq_a.weight_scale_inv": scale, "norm.weight": torch.randn(6)},
        "model-00003-of-00003.safetensors": {"head.weight": torch.randn(10, 6), "mtp.0.hnorm.weight": torch.randn(6)},
    }
    write_config(tmp_path, quantization_config={"quant_method": "fp8", "weight_block_size": [16, 16]})
    weight_map = {}
    for file, tensors in shards.items():
        save_file(tensors, str(tmp_path / file))
        weight_map.update({name: file for name in tensors})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"stray.weight": torch.ones(1)}, str(tmp_path / "not-in-index.safetensors"))  # ignored: not indexed

    params = {
        model_name("embed.weight"): torch.zeros(10, 6),
        model_name("layers.0.attn.wq_a.weight"): torch.zeros(40, 24),
        model_name("norm.weight"): torch.zeros(6),
        "head.weight": torch.zeros(10, 6, dtype=torch.float16),
    }
    kept = load_weights(params, tmp_path)
    assert torch.equal(params[model_name("embed.weight")], shards["model-00001-of-00003.safetensors"]["embed.weight"])
    assert torch.equal(params["head.weight"], shards["model-00003-of-00003.safetensors"]["head.weight"].half())
    assert torch.equal(params[model_name("layers.0.attn.wq_a.weight")], block_reference(w_fp8, scale, (16, 16)))
    assert set(kept) == {"mtp.0.hnorm.weight"}


def test_keep_prefixes_and_declared_scales_load_raw(tmp_path):
    w_fp8, scale = quantize_fp8_blockwise(torch.randn(8, 8), block=(4, 4))
    save_file(
        {"a.weight": w_fp8, "a.weight_scale_inv": scale, "draft.x": torch.ones(2), "mtp.0.y": torch.ones(2)},
        str(tmp_path / "model.safetensors"),
    )
    # the V3 name of a block scale loads into the model's ``.scale``
    params = {"a.weight": torch.zeros(8, 8, dtype=torch.float8_e4m3fn), "a.scale": torch.zeros(2, 2)}
    kept = load_weights(params, tmp_path, keep_prefixes=("draft.", "mtp."))
    assert torch.equal(params["a.weight"].view(torch.uint8), w_fp8.view(torch.uint8))
    assert torch.equal(params["a.scale"], scale)
    assert sorted(kept) == ["draft.x", "mtp.0.y"]
    with pytest.raises(CheckpointError, match=r"checkpoint tensor\(s\) have no matching model param: 'mtp.0.y'"):
        load_weights(dict(params), tmp_path, keep_prefixes=("draft.",))


def test_unexpected_tensor_error(simple_ckpt):
    directory, tensors = simple_ckpt
    params = params_like({k: v for k, v in tensors.items() if k not in ("norm.weight", "mtp.0.enorm.weight")})
    with pytest.raises(CheckpointError) as err:
        load_weights(params, directory)
    msg = str(err.value)
    assert "1 checkpoint tensor(s) have no matching model param: 'norm.weight'" in msg
    assert "'model.safetensors'" in msg and "keep_prefixes" in msg and "\n" not in msg
    assert torch.all(params[model_name("embed.weight")] == 7)  # nothing copied before validation failed


def test_missing_tensor_error_lists_first_names_and_count(simple_ckpt):
    directory, tensors = simple_ckpt
    params = params_like({k: v for k, v in tensors.items() if not k.startswith("mtp.")})
    for i in range(7):
        params[f"layers.{i}.extra.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError) as err:
        load_weights(params, directory)
    msg = str(err.value)
    assert "lacks 7 tensor(s) the model needs: 'layers.0.extra.weight', 'layers.1.extra.weight'" in msg
    assert "'layers.4.extra.weight' and 2 more" in msg and "layers.5.extra" not in msg


def test_shape_mismatch_error(simple_ckpt):
    directory, tensors = simple_ckpt
    params = params_like({k: v for k, v in tensors.items() if not k.startswith("mtp.")})
    params[model_name("layers.0.attn.wq_a.weight")] = torch.zeros(8, 4)
    with pytest.raises(CheckpointError) as err:
        load_weights(params, directory)
    assert str(err.value) == (
        "checkpoint tensor 'layers.0.attn.wq_a.weight' in 'model.safetensors' has shape [4, 8] but the model "
        "expects [8, 4]; the checkpoint does not match config.json"
    )


def test_dtype_errors(simple_ckpt, tmp_path):
    directory, tensors = simple_ckpt
    params = params_like({k: v for k, v in tensors.items() if not k.startswith("mtp.")})
    params[model_name("norm.weight")] = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(CheckpointError, match=r"'norm.weight' in 'model.safetensors' is float32 but the model param is int32"):
        load_weights(params, directory)

    fp8_dir = tmp_path / "fp8_no_scale"
    fp8_dir.mkdir()
    save_file({"w.weight": torch.randn(4, 4).to(torch.float8_e4m3fn)}, str(fp8_dir / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_weights({"w.weight": torch.zeros(4, 4)}, fp8_dir)
    assert "'w.weight' in 'model.safetensors' is float8_e4m3fn with no block-scale tensor" in str(err.value)
    assert "'w.weight_scale_inv' or 'w.scale'" in str(err.value)

    w_fp8, scale = quantize_fp8_blockwise(torch.randn(4, 4), block=(2, 2))
    save_file({"w.weight": w_fp8, "w.weight_scale_inv": scale}, str(fp8_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"is block-quantized float8_e4m3fn .* its param is int8"):
        load_weights({"w.weight": torch.zeros(4, 4, dtype=torch.int8)}, fp8_dir)


def test_truncated_and_corrupt_files(simple_ckpt):
    directory, tensors = simple_ckpt
    params = params_like({k: v for k, v in tensors.items() if not k.startswith("mtp.")})
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError) as err:
        load_weights(params, directory)
    assert str(err.value).startswith("checkpoint file 'model.safetensors' is truncated or corrupt (safetensors: ")
    assert "incomplete metadata" in str(err.value) and str(err.value).endswith("re-download it")
    path.write_bytes(b"\x00" * 4)
    with pytest.raises(CheckpointError, match=r"'model.safetensors' is truncated or corrupt \(safetensors: .*header"):
        load_weights(params, directory)


def test_index_errors(tmp_path):
    write_config(tmp_path)
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_weights({"a": torch.zeros(2), "b": torch.zeros(2)}, tmp_path)
    assert str(err.value).startswith(
        "model.safetensors.index.json names shard 'model-00002-of-00002.safetensors', which is not in"
    )
    assert "download the missing shard or fix the index" in str(err.value)

    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"places tensor 'b' in 'model-00001-of-00002.safetensors', but that shard"):
        load_weights({"a": torch.zeros(2), "b": torch.zeros(2)}, tmp_path)

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=r"has no 'weight_map' object"):
        load_weights({"a": torch.zeros(2)}, tmp_path)


def test_no_safetensors_and_duplicate_tensor(tmp_path):
    write_config(tmp_path)
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files in .*model\*.safetensors shards"):
        load_weights({}, tmp_path)
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-1.safetensors"))
    save_file({"a": torch.ones(2)}, str(tmp_path / "model-2.safetensors"))
    with pytest.raises(CheckpointError, match=r"'a' is stored twice, in 'model-1.safetensors' and 'model-2.safetensors'"):
        load_weights({"a": torch.zeros(2)}, tmp_path)


# ------------------------------------------------------------------------- FP8


def test_quantize_fp8_blockwise_shapes_and_zero_blocks():
    w = torch.zeros(130, 260)
    w[:128, :128] = torch.randn(128, 128)
    w_fp8, scale = quantize_fp8_blockwise(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == (130, 260)
    assert scale.dtype == torch.float32 and scale.shape == (2, 3)
    assert torch.equal(scale[0, 0], w[:128, :128].abs().max() / 448)
    assert torch.all(scale.flatten()[1:] == 1) and torch.all(w_fp8.float()[128:] == 0)
    assert w_fp8.float()[:128, :128].abs().max() == 448


@pytest.mark.parametrize("naming", ["weight_scale_inv", "scale"])
def test_fp8_dequantize_on_load_edge_blocks(tmp_path, naming):
    torch.manual_seed(2)
    block = (64, 32)
    originals = {"layers.0.attn.wq_a.weight": torch.randn(150, 70) * 3, "layers.0.ffn.experts.w": torch.randn(3, 70, 45)}
    tensors, scales = {}, {}
    for name, w in originals.items():
        w_fp8, scale = quantize_fp8_blockwise(w, block=block)
        assert scale.shape == (*w.shape[:-2], math.ceil(w.shape[-2] / 64), math.ceil(w.shape[-1] / 32))
        if naming == "scale":  # DeepSeek-V4 stores E8M0 (power-of-two) scales under `.scale`
            scale = torch.exp2(torch.ceil(torch.log2(scale))).to(torch.float8_e8m0fnu)
            w_fp8 = (w / block_reference(torch.ones_like(w), scale, block)).to(torch.float8_e4m3fn)
        if name.endswith(".weight"):
            companion = name[: -len("weight")] + naming
        else:
            companion = name + ("_scale_inv" if naming == "weight_scale_inv" else ".scale")
        tensors[name], tensors[companion], scales[name] = w_fp8, scale, scale
    write_config(tmp_path, quantization_config={"quant_method": "fp8", "weight_block_size": list(block)})
    save_file(tensors, str(tmp_path / "model.safetensors"))

    params = {model_name(name): torch.zeros(w.shape) for name, w in originals.items()}
    assert load_weights(params, tmp_path) == {}
    for name, w in originals.items():
        reference = block_reference(tensors[name], scales[name], block)
        assert torch.equal(params[model_name(name)], reference)  # exact: the same per-block products
        block_scale = block_reference(torch.ones_like(w), scales[name], block)
        # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative, and 2^-10 of the scale among subnormals
        err_bound = (w.abs() * 2**-4 + block_scale * 2**-10) * 1.0001
        assert torch.all((params[model_name(name)] - w).abs() <= err_bound)
        assert not torch.equal(params[model_name(name)], w)
    bf16 = {model_name(name): torch.zeros(w.shape, dtype=torch.bfloat16) for name, w in originals.items()}
    load_weights(bf16, tmp_path)
    for name in originals:
        assert torch.equal(bf16[model_name(name)], block_reference(tensors[name], scales[name], block).to(torch.bfloat16))


def test_fp8_scale_grid_mismatch_error(tmp_path):
    w_fp8, scale = quantize_fp8_blockwise(torch.randn(100, 100), block=(32, 32))  # grid 4x4
    save_file({"w.weight": w_fp8, "w.scale": scale[:3]}, str(tmp_path / "model.safetensors"))
    write_config(tmp_path, quantization_config={"weight_block_size": [32, 32]})
    with pytest.raises(CheckpointError) as err:
        load_weights({"w.weight": torch.zeros(100, 100)}, tmp_path)
    assert str(err.value).startswith(
        "scale tensor 'w.scale' in 'model.safetensors' has shape [3, 4], which does not tile weight 'w.weight' "
        "of shape [100, 100] with weight_block_size [32, 32]"
    )
    write_config(tmp_path, quantization_config={"weight_block_size": [128]})
    with pytest.raises(CheckpointError, match=r"weight_block_size is \[128\]; it must be two positive integers"):
        load_weights({"w.weight": torch.zeros(100, 100)}, tmp_path)


# ------------------------------------------------------------------------- FP4


@pytest.mark.parametrize("storage", [torch.float4_e2m1fn_x2, torch.int8])
def test_fp4_experts_dequantize_on_load(tmp_path, storage):
    torch.manual_seed(3)
    rows, cols = 6, 64
    codes = torch.randint(0, 16, (rows, cols), dtype=torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(storage)
    exponents = torch.randint(120, 130, (rows, cols // 32), dtype=torch.uint8)
    scale = exponents.view(torch.float8_e8m0fnu)
    expected = torch.tensor([[E2M1[int(c)] for c in row] for row in codes]) * torch.exp2(
        exponents.float() - 127
    ).repeat_interleave(32, dim=1)
    name = "layers.0.ffn.experts.0.w1.weight"
    write_config(tmp_path, quantization_config={"weight_block_size": [128, 128], "scale_fmt": "ue8m0"})
    save_file({name: packed, "layers.0.ffn.experts.0.w1.scale": scale}, str(tmp_path / "model.safetensors"))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor(name).dtype == storage
    params = {model_name(name): torch.zeros(rows, cols)}
    load_weights(params, tmp_path)
    assert torch.equal(params[model_name(name)], expected)


# ---------------------------------------------------------------- transformers


def tiny_v4_config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=16,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        hc_mult=2, hc_sinkhorn_iters=2, sliding_window=8, o_groups=2, o_lora_rank=8,
        index_n_heads=2, index_head_dim=8, index_topk=4, partial_rotary_factor=0.5,
        max_position_embeddings=64,
    )  # fmt: skip


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_reads_transformers_save_pretrained(tmp_path, max_shard_size):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(4)
    model = DeepseekV4ForCausalLM(tiny_v4_config())
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (max_shard_size is not None)

    config = read_config(tmp_path)
    assert config["model_type"] == "deepseek_v4" and config["num_hidden_layers"] == 3
    assert read_generation_config(tmp_path)["eos_token_id"] == 1

    stored = stored_tensors(tmp_path)
    params = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in stored.items()}
    assert load_weights(params, tmp_path) == {}
    for name, tensor in stored.items():
        assert torch.equal(params[name], tensor), name
    state = model.state_dict()
    assert torch.equal(params["model.embed_tokens.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(params["head.weight"], state["lm_head.weight"])
    assert torch.equal(params["model.layers.1.attn.wq_a.weight"], state["model.layers.1.self_attn.q_a_proj.weight"])
    assert torch.equal(params["model.layers.0.ffn.gate.tid2eid"], state["model.layers.0.mlp.gate.tid2eid"])

    params.pop("model.norm.weight")
    with pytest.raises(CheckpointError, match=r"1 checkpoint tensor\(s\) have no matching model param: 'model.norm.weight'"):
        load_weights(params, tmp_path)

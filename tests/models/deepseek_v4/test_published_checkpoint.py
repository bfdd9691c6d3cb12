"""Checkpoints laid out as DeepSeek publishes them: names, FP8/FP4 weights held as stored, parity with
transformers (which renames and dequantizes the same directory on the CPU), and one-line errors for
broken ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams
from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_interfaces import Kernels
from tests.helpers.checkpoints import BOS_ID
from deepinfer.models.common.linear import QuantPlan
from tests.helpers.published import EXPERT_WEIGHTS, FP8_WEIGHTS, V4_FLASH, make_published_checkpoint, release_config, stored_bytes
from deepinfer.models.registry import parse_config

PROMPT = [BOS_ID] + list(b"A checkpoint as DeepSeek publishes it: FP8 linears, FP4 experts, two shards, ") * 2


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return make_published_checkpoint(tmp_path_factory.mktemp("published"))


@pytest.fixture(scope="module")
def hf_model(published):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(str(published), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def model(published):
    return DeepseekV4Model.from_pretrained(published, Kernels(), dtype=torch.float32)


def _stored(directory) -> dict[str, tuple[torch.dtype, int]]:
    """Every stored tensor: (dtype, bytes)."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                out[k] = (t.dtype, t.numel() * t.element_size())
    return out


def test_published_layout_loads_with_nothing_missing_or_unexpected(published, model):
    stored = _stored(published)
    assert len({f for f in json.loads((published / "model.safetensors.index.json").read_text())["weight_map"].values()}) == 2
    assert "embed.weight" in stored and "layers.0.attn.kv_norm.weight" in stored and "hc_head_fn" in stored
    mtp = {k for k in stored if k.startswith("mtp.")}
    assert set(model.extra_tensors) == mtp  # the draft block is kept aside, as stored
    assert model.extra_tensors["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    params = model.named_parameters()
    # every other stored tensor is one parameter: a weight, or a quantized weight's codes or scales
    assert len(params) == len(stored) - len(mtp)


def test_quantized_weights_are_held_in_their_checkpoint_dtypes(published, model):
    stored = _stored(published)
    fp8 = [k for k in stored if FP8_WEIGHTS.match(k) and not k.startswith("mtp.")]
    experts = [k for k in stored if EXPERT_WEIGHTS.match(k) and not k.startswith("mtp.")]
    assert all(stored[k][0] == torch.float8_e4m3fn for k in fp8) and all(stored[k][0] == torch.int8 for k in experts)
    held = model.named_parameters()
    codes = {n: p for n, p in held.items() if p.dtype in (torch.float8_e4m3fn, torch.uint8) and not n.endswith(".scale")}
    scales = {n: p for n, p in held.items() if n.endswith(".scale")}
    assert {p.dtype for p in codes.values()} == {torch.float8_e4m3fn, torch.uint8}
    assert {p.dtype for p in scales.values()} == {torch.uint8}  # UE8M0 exponent bytes
    quantized = [k for k in fp8 + experts] + [k[: -len("weight")] + "scale" for k in fp8 + experts]
    stored_bytes = sum(stored[k][1] for k in quantized)
    held_bytes = sum(p.numel() * p.element_size() for p in list(codes.values()) + list(scales.values()))
    assert held_bytes == stored_bytes
    # FP4 experts: two values per byte; nothing of them is held in a wider dtype
    assert not any(".experts" in n and p.dtype.itemsize > 1 for n, p in held.items())
    plain = sum(p.numel() * p.element_size() for n, p in held.items() if n not in codes and n not in scales)
    dequantized = DeepseekV4Model.from_pretrained(published, Kernels(), dtype=torch.float32, quantization="dequantize")
    total = sum(p.numel() * p.element_size() for p in dequantized.named_parameters().values())
    assert total > 3 * (held_bytes + plain) / 2  # fp32 weights take four bytes a value


def test_prompt_logprobs_and_greedy_tokens_match_transformers(published, hf_model):
    # transformers rounds no KV: compare the plain cache (``auto`` would round as the release was trained)
    llm = LLM(model=str(published), backend="cpu", dtype="float32", max_model_len=512, kv_cache_dtype="model")
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, ignore_eos=True))[0]
    assert out.error is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([PROMPT])).logits[0].float(), -1)
    errors = [abs(out.prompt_logprobs[i][PROMPT[i]].logprob - ref[i - 1, PROMPT[i]].item()) for i in range(1, len(PROMPT))]
    assert max(errors) < 1e-4
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):].tolist()
    assert list(out.outputs[0].token_ids) == expected


def test_quantized_model_matches_its_dequantized_weights(published, model):
    from tests.helpers.reference import greedy_alone

    dequantized = DeepseekV4Model.from_pretrained(published, Kernels(), dtype=torch.float32, quantization="dequantize")
    assert greedy_alone(model, PROMPT[:40], 6) == greedy_alone(dequantized, PROMPT[:40], 6)


def test_base_layout_fp8_experts_with_float32_scales(tmp_path):
    # V4-Flash-Base: FP8 experts; a whole number of 128-row blocks per expert, so the stack stays FP8
    base = make_published_checkpoint(
        tmp_path, expert_dtype="fp8", moe_intermediate_size=128, quantization_config={"scale_fmt": "float"}
    )
    stored = _stored(base)
    assert stored["layers.1.ffn.experts.0.w1.weight"][0] == torch.float8_e4m3fn
    assert stored["layers.1.ffn.experts.0.w1.scale"][0] == torch.float32
    model = DeepseekV4Model.from_pretrained(base, Kernels(), dtype=torch.float32)
    held = model.named_parameters()
    assert held["model.layers.1.ffn.experts.0.w1.scale"].dtype == torch.float32
    assert held["model.layers.1.ffn.experts.0.w1.weight"].dtype == torch.float8_e4m3fn
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    from tests.helpers.reference import greedy_alone

    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT[:30]]), max_new_tokens=6, do_sample=False)[0, 30:].tolist()
    assert greedy_alone(model, PROMPT[:30], 6) == expected


# ---- broken checkpoints: one line naming the tensor or field and the fix ---------------------


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(directory, **fields):
    cfg = json.loads((directory / "config.json").read_text())
    for key, value in fields.items():
        if key == "quantization_config":
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    (directory / "config.json").write_text(json.dumps(cfg))


def _load_error(directory) -> str:
    with pytest.raises((CheckpointError, ConfigError)) as info:
        DeepseekV4Model.from_pretrained(directory, Kernels(), dtype=torch.float32)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_shard_named_in_the_index(published, tmp_path):
    broken = _copy(published, tmp_path / "broken")
    (broken / "model-00002-of-00002.safetensors").unlink()
    msg = _load_error(broken)
    assert "model-00002-of-00002.safetensors" in msg and "index" in msg


def test_scale_that_does_not_match_its_block_grid(published, tmp_path):
    broken = _copy(published, tmp_path / "broken")
    shard = broken / "model-00001-of-00002.safetensors"
    tensors = load_file(str(shard))
    tensors["layers.0.attn.wq_a.scale"] = tensors["layers.0.attn.wq_a.scale"][:, :1].contiguous()
    save_file(tensors, str(shard))
    msg = _load_error(broken)
    assert "layers.0.attn.wq_a.scale" in msg and "[1, 1]" in msg and "[1, 2]" in msg


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(quantization_config={"scale_fmt": "ue4m3"}), "scale_fmt"),
        (dict(expert_dtype="fp2"), "expert_dtype"),
        (dict(quantization_config={"quant_method": "awq"}), "quant_method"),
        (dict(quantization_config={"fmt": "e5m2"}), "fmt"),
        (dict(topk_method="group_limited_greedy"), "topk_method"),
        (dict(rope_scaling={"type": "longrope", "factor": 4.0}), "rope_type"),
        (dict(compress_ratios=[0, 4, 64, 0]), "compress_ratios"),
    ],
)
def test_fields_the_engine_cannot_honour_are_refused_by_name(published, tmp_path, fields, named):
    broken = _copy(published, tmp_path / "broken")
    _edit_config(broken, **fields)
    assert named in _load_error(broken)


def test_v41_checkpoint_is_refused_with_the_reason(published, tmp_path):
    broken = _copy(published, tmp_path / "broken")
    _edit_config(broken, model_type="deepseek_v41")
    assert "'deepseek_v41', not 'deepseek_v4'" in _load_error(broken)


def test_cli_reports_a_broken_checkpoint_in_one_line_with_status_2(published, tmp_path):
    broken = _copy(published, tmp_path / "broken")
    _edit_config(broken, quantization_config={"quant_method": "gptq"})
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "generate", "--model", str(broken), "--prompt", "hi", "--max-tokens", "2"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "quant_method" in lines[0] and "Traceback" not in proc.stderr


# ---- sizing without a download --------------------------------------------------------------


def _inspect(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "deepinfer.cli", "inspect", *args, "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_stored_size_formula_counts_the_published_layout(published):
    stored = _stored(published)
    assert stored_bytes(release_config()) == sum(size for k, (_, size) in stored.items() if not k.startswith("mtp."))


def test_inspect_gives_the_bytes_the_loaded_model_holds(published, model):
    got = _inspect("--model", str(published), "--ep", "3", "--dtype", "float32")
    held = model.named_parameters()
    assert got["total_bytes"] == sum(p.numel() * p.element_size() for p in held.values())
    experts = sum(p.numel() * p.element_size() for n, p in held.items() if ".ffn.experts." in n)
    assert got["by_kind"]["experts"] == experts and got["ep"] == 3
    assert got["per_rank_bytes"] == got["total_bytes"] - experts + experts // 4 * 2  # 4 experts a layer: 2 on the largest rank
    assert got["checkpoint_bytes"] == json.loads((published / "model.safetensors.index.json").read_text())["metadata"]["total_size"]


def test_v4_flash_on_the_meta_device_takes_its_stored_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(V4_FLASH))
    config = parse_config(dict(V4_FLASH))
    model = DeepseekV4Model(config, Kernels(), dtype=torch.bfloat16, device="meta", plan=QuantPlan.from_config(config))
    held = sum(p.numel() * p.element_size() for p in model.named_parameters().values())
    stored = stored_bytes(V4_FLASH)
    assert 150e9 < stored < 165e9  # about 160 GB on disk
    assert abs(held - stored) <= 0.1 * stored
    got = _inspect("--model", str(tmp_path), "--ep", "8")
    assert got["total_bytes"] == held
    assert set(got["by_kind"]) == {"quantized linears", "experts", "rest"} and got["by_kind"]["experts"] > 0.9 * held
    assert got["per_rank_bytes"] == held - got["by_kind"]["experts"] * 7 // 8
    dequantized = _inspect("--model", str(tmp_path), "--quantization", "dequantize")["total_bytes"]
    assert dequantized > 3.5 * held  # about 569 GB in bf16

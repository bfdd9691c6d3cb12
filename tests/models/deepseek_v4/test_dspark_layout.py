"""The DSpark draft in V4-Flash-DSpark's published layout: config fields, tensor names and their other spellings,
FP8 / FP4 tensors held as stored, the forward's published semantics, and one-line errors for broken drafts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.loader import read_config
from deepinfer.loader.names import model_name
from deepinfer.models.common.dspark import DSparkConfig, DSparkDraft, DSparkRing, stage_count
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_interfaces import Kernels, QuantizedWeight
from tests.helpers.published import DSPARK_FIELDS, DSPARK_STAGES, make_published_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

#: committed positions of context before the anchor
CONTEXT = 24


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    return make_published_checkpoint(tmp_path_factory.mktemp("dspark"), draft="dspark")


@pytest.fixture(scope="module")
def target(published):
    return DeepseekV4Model.from_pretrained(published, Kernels(), dtype=torch.float32)


@pytest.fixture(scope="module")
def draft(published, target):
    return DSparkDraft.from_target(target, read_config(published))


def _stored(directory) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _rewrite(src, dst, edit) -> None:
    """Copy checkpoint ``src`` to ``dst`` with every shard's tensors passed through ``edit``."""
    dst.mkdir()
    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors = edit(load_file(str(f)))
        save_file(tensors, str(dst / f.name))
        weight_map.update({k: f.name for k in tensors})
    index["weight_map"] = weight_map
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (dst / f.name).write_bytes(f.read_bytes())


def _load_draft(directory, **kwargs) -> DSparkDraft:
    target = DeepseekV4Model.from_pretrained(directory, Kernels(), dtype=torch.float32)
    return DSparkDraft.from_target(target, read_config(directory), **kwargs)


def _load_error(directory) -> str:
    with pytest.raises((CheckpointError, ConfigError)) as info:
        _load_draft(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


def _propose(draft: DSparkDraft, seed: int = 0, temperature: float = 0.0, noise_seed: int | None = None):
    """Fill a ring with context from seeded target hidden states and draft one block for two sequences."""
    gen = torch.Generator().manual_seed(seed)
    layers, d = len(draft.config.dspark_target_layer_ids), draft.model_config.hidden_size
    ring = DSparkRing(draft, 2)
    for slot in range(2):
        hidden = torch.randn(CONTEXT, layers, d, generator=gen)
        ctx = draft.context(hidden)
        pos = torch.arange(CONTEXT)
        ring.write(slot, pos, draft.context_kv(ctx, pos))
    anchor_pos = torch.full((2,), CONTEXT)
    anchors = torch.randint(3, 200, (2,), generator=gen)
    noise = None
    if noise_seed is not None:
        g = torch.Generator().manual_seed(noise_seed)
        noise = torch.empty(2, draft.config.dspark_block_size, draft.model_config.vocab_size).exponential_(generator=g)
    out = draft.draft(anchors, anchor_pos, ring.kv, ring.rows([0, 1], anchor_pos), temperature=temperature, noise=noise)
    return out, anchors


# ---- config ------------------------------------------------------------------------------------


def test_published_fields_give_the_stage_count_from_the_mtp_prefixes(published, target, draft):
    raw = read_config(published)
    assert raw["num_nextn_predict_layers"] == 1 and "dspark_num_stages" not in raw and "n_mtp_layers" not in raw
    assert len(draft.stages) == DSPARK_STAGES == draft.config.dspark_num_stages
    assert draft.config.dspark_context_window == 128
    assert draft.config.dspark_block_size == DSPARK_FIELDS["dspark_block_size"]
    assert draft.config.dspark_target_layer_ids == DSPARK_FIELDS["dspark_target_layer_ids"]
    assert DSparkConfig.from_hf(raw, target.config).dspark_num_stages is None  # nothing to count without the names
    assert stage_count(["mtp.0.a", "mtp.1.b", "mtp.3.c", "layers.2.x"]) == 2


def test_stage_count_and_window_spellings(target):
    base = {**DSPARK_FIELDS}
    names = [f"mtp.{i}.norm.weight" for i in range(3)]
    assert DSparkConfig.from_hf({**base, "n_mtp_layers": 2}, target.config, names).dspark_num_stages == 2
    assert DSparkConfig.from_hf({**base, "dspark_num_stages": 4}, target.config, names).dspark_num_stages == 4
    assert DSparkConfig.from_hf({**base, "dspark_window_size": 64}, target.config).dspark_context_window == 64
    assert DSparkConfig.from_hf({**base, "dspark_context_window": 32}, target.config).dspark_context_window == 32
    assert DSparkConfig.from_hf({"num_nextn_predict_layers": 3}, target.config) is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (dict(dspark_markov_head_type="gated"), "dspark_markov_head_type"),
        (dict(dspark_confidence_temperatures=[1.0, 2.0]), "dspark_confidence_temperatures"),
        (dict(dspark_confidence_temperatures=[1.0, 1.0, 0.0, 1.0, 1.0]), "dspark_confidence_temperatures"),
        (dict(dspark_num_stages=3, n_mtp_layers=2), "stage counts"),
        (dict(dspark_target_layer_ids=[7]), "dspark_target_layer_ids"),
        (dict(n_mtp_layers=0), "stage count"),
    ],
)
def test_bad_fields_are_refused_by_name(target, fields, named):
    with pytest.raises(ConfigError) as info:
        DSparkConfig.from_hf({**DSPARK_FIELDS, **fields}, target.config)
    assert named in str(info.value) and "\n" not in str(info.value)


# ---- names -------------------------------------------------------------------------------------


def test_other_spellings_map_to_the_release_names():
    assert model_name("mtp.1.attn.kv_norm.weight") == "mtp.1.attn.kv_norm.weight"
    assert model_name("mtp.1.attn.norm.weight") == "mtp.1.attn.kv_norm.weight"  # transformers' spelling
    assert model_name("mtp.2.hc_head.hc_fn") == "mtp.2.hc_head_fn"
    assert model_name("mtp.2.markov_head.embed.weight") == "mtp.2.markov_head.markov_w1.weight"
    assert model_name("mtp.2.markov_head.proj.weight") == "mtp.2.markov_head.markov_w2.weight"
    assert model_name("mtp.0.main_proj.weight_scale_inv") == "mtp.0.main_proj.scale"
    assert model_name("mtp.0.attn.attn_sink") == "mtp.0.attn.attn_sink"
    assert model_name("layers.1.attn.kv_norm.weight") == "model.layers.1.attn.norm.weight"


def test_every_published_draft_tensor_loads_into_a_parameter(published, draft):
    stored = {k for k in _stored(published) if k.startswith("mtp.")}
    assert set(draft.named_parameters()) == stored
    assert {"mtp.0.main_proj.scale", "mtp.2.hc_head_fn", "mtp.2.markov_head.markov_w1.weight",
            "mtp.1.attn.kv_norm.weight", "mtp.2.confidence_head.proj.weight"} <= stored


def test_transformers_spellings_load_the_same_draft(published, draft, tmp_path):
    renames = {"mtp.2.hc_head_fn": "mtp.2.hc_head.hc_fn", "mtp.2.hc_head_base": "mtp.2.hc_head.hc_base",
               "mtp.2.hc_head_scale": "mtp.2.hc_head.hc_scale"}

    def respell(tensors):
        out = {}
        for k, v in tensors.items():
            k = renames.get(k, k)
            if k.startswith("mtp.") and k.endswith(".attn.kv_norm.weight"):
                k = k.replace(".kv_norm.", ".norm.")
            if k.startswith("mtp.") and k.endswith(".scale") and "hc_" not in k:
                k = k[: -len("scale")] + "weight_scale_inv"
            out[k] = v
        return out

    _rewrite(published, tmp_path / "respelled", respell)
    other = _load_draft(tmp_path / "respelled")
    got, _ = _propose(other)
    want, _ = _propose(draft)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.confidence, want.confidence)


# ---- quantized tensors held as stored -----------------------------------------------------------


def test_quantized_draft_tensors_are_held_as_stored(published, draft):
    stored = _stored(published)
    assert isinstance(draft.main_proj, QuantizedWeight) and draft.main_proj.codes.dtype == torch.float8_e4m3fn
    assert stored["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["mtp.0.main_proj.scale"].dtype == torch.float8_e8m0fnu
    stage = draft.stages[1]
    assert isinstance(stage.ffn.w13, QuantizedWeight) and stage.ffn.w13.fmt == "e2m1"
    assert isinstance(stage.attn.wkv, QuantizedWeight) and isinstance(stage.attn.wo_b, QuantizedWeight)
    held = draft.named_parameters()
    for name in ("mtp.1.ffn.experts.3.w2.weight", "mtp.1.ffn.experts.3.w2.scale", "mtp.0.main_proj.scale"):
        assert torch.equal(held[name], stored[name].view(torch.uint8))  # byte for byte
    assert torch.equal(held["mtp.2.attn.wq_b.weight"].view(torch.uint8), stored["mtp.2.attn.wq_b.weight"].view(torch.uint8))
    # routed experts: nothing held wider than a byte, as many bytes as the checkpoint stores
    experts = {n: p for n, p in held.items() if ".ffn.experts." in n}
    assert all(p.element_size() == 1 for p in experts.values())
    assert sum(p.numel() for p in experts.values()) == sum(t.numel() for n, t in stored.items() if ".ffn.experts." in n and n.startswith("mtp."))


def test_quantized_draft_proposes_what_its_dequantized_copy_does(published, target, draft):
    plain = DSparkDraft.from_target(target, read_config(published), quantization="dequantize")
    assert not any(isinstance(w, QuantizedWeight) for w in (plain.main_proj, plain.stages[0].ffn.w13, plain.stages[0].attn.wkv))
    for temperature, noise_seed in ((0.0, None), (1.0, 7)):
        got, _ = _propose(draft, temperature=temperature, noise_seed=noise_seed)
        want, _ = _propose(plain, temperature=temperature, noise_seed=noise_seed)
        assert torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.accept_probs, want.accept_probs, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got.token_probs, want.token_probs, rtol=1e-4, atol=1e-6)


def test_a_dequantized_target_gets_a_dequantized_draft(published):
    target = DeepseekV4Model.from_pretrained(published, Kernels(), dtype=torch.float32, quantization="dequantize")
    draft = DSparkDraft.from_target(target, read_config(published))
    assert not isinstance(draft.stages[0].ffn.w13, QuantizedWeight)


# ---- forward semantics ---------------------------------------------------------------------------


def test_context_is_normed_after_the_projection_and_its_rows_skip_attn_norm(draft):
    k, eps = draft.kernels, draft.eps
    hidden = torch.randn(6, 2, draft.model_config.hidden_size, generator=torch.Generator().manual_seed(3))
    w = draft.main_proj.dequantize()
    projected = hidden.reshape(6, -1) @ w.t()
    want = projected * torch.rsqrt(projected.pow(2).mean(-1, keepdim=True) + eps) * draft.main_norm
    ctx = draft.context(hidden)
    torch.testing.assert_close(ctx, want, rtol=1e-4, atol=1e-5)
    pos = torch.arange(6)
    cos, sin = draft.rope(pos)
    a = draft.stages[1].attn
    row = k.rope(k.rms_norm(ctx @ a.wkv.dequantize().t(), a.kv_norm, eps), cos, sin)
    torch.testing.assert_close(draft.context_kv(ctx, pos)[1], row, rtol=1e-4, atol=1e-5)


def test_confidence_reads_the_previous_token_and_never_the_drafted_one(draft):
    greedy, anchors = _propose(draft)
    sampled, _ = _propose(draft, temperature=1.0, noise_seed=11)
    assert not torch.equal(greedy.tokens[:, 0], sampled.tokens[:, 0])
    # position 0's previous token is the anchor in both, whatever each drafted there
    torch.testing.assert_close(greedy.accept_probs[:, 0], sampled.accept_probs[:, 0], rtol=0, atol=0)
    # and each position's chance is the head's on (collapsed hidden state, previous token)
    ring = DSparkRing(draft, 2)
    gen = torch.Generator().manual_seed(0)
    layers, d = len(draft.config.dspark_target_layer_ids), draft.model_config.hidden_size
    for slot in range(2):
        ctx = draft.context(torch.randn(CONTEXT, layers, d, generator=gen))
        ring.write(slot, torch.arange(CONTEXT), draft.context_kv(ctx, torch.arange(CONTEXT)))
    anchor_pos = torch.full((2,), CONTEXT)
    h = draft.hidden(anchors, anchor_pos, ring.kv, ring.rows([0, 1], anchor_pos))
    prev = torch.cat([anchors[:, None], sampled.tokens[:, :-1]], dim=1)
    torch.testing.assert_close(sampled.accept_probs, torch.sigmoid(draft.accept_logit(h, prev)))
    torch.testing.assert_close(sampled.confidence, sampled.accept_probs.cumprod(dim=1))


def test_confidence_temperatures_scale_the_logits(published, target, draft):
    temps = [2.0, 1.0, 0.5, 1.0, 4.0]
    tempered = DSparkDraft.from_target(target, {**read_config(published), "dspark_confidence_temperatures": temps})
    plain, _ = _propose(draft)
    got, _ = _propose(tempered)
    assert torch.equal(got.tokens, plain.tokens)
    logit = torch.logit(plain.accept_probs.double()).float()
    torch.testing.assert_close(got.accept_probs, torch.sigmoid(logit / torch.tensor(temps)), rtol=1e-4, atol=1e-6)


# ---- broken drafts: one line naming the tensor -----------------------------------------------------


def test_missing_draft_tensor_is_named(published, tmp_path):
    _rewrite(published, tmp_path / "broken", lambda t: {k: v for k, v in t.items() if k != "mtp.1.attn.kv_norm.weight"})
    msg = _load_error(tmp_path / "broken")
    assert "'mtp.1.attn.kv_norm.weight'" in msg and "lacks" in msg


def test_wrong_shape_is_named_with_both_shapes(published, tmp_path):
    def widen(tensors):
        if "mtp.0.main_norm.weight" in tensors:  # deepinfer's earlier layout normed the [L·D] concatenation
            tensors["mtp.0.main_norm.weight"] = torch.ones(512, dtype=torch.bfloat16)
        return tensors

    _rewrite(published, tmp_path / "broken", widen)
    msg = _load_error(tmp_path / "broken")
    assert "'mtp.0.main_norm.weight'" in msg and "[512]" in msg and "[256]" in msg


def test_wrong_expert_scale_grid_is_named(published, tmp_path):
    name = "mtp.2.ffn.experts.1.w1.scale"

    def crop(tensors):
        if name in tensors:
            tensors[name] = tensors[name][:, :4].contiguous()
        return tensors

    _rewrite(published, tmp_path / "broken", crop)
    msg = _load_error(tmp_path / "broken")
    assert "mtp.2.ffn.experts.1.w1" in msg


def test_tensor_of_no_draft_parameter_is_named(published, tmp_path):
    def add_bias(tensors):
        if "mtp.2.confidence_head.proj.weight" in tensors:
            tensors["mtp.2.confidence_head.proj.bias"] = torch.zeros(1, dtype=torch.bfloat16)
        return tensors

    _rewrite(published, tmp_path / "broken", add_bias)
    msg = _load_error(tmp_path / "broken")
    assert "'mtp.2.confidence_head.proj.bias'" in msg


def test_a_nextn_block_is_not_a_dspark_draft(tmp_path):
    nextn = make_published_checkpoint(tmp_path, draft="nextn", **DSPARK_FIELDS)
    msg = _load_error(nextn)
    assert "lacks DSpark tensors" in msg and "mtp.0." in msg


def test_fp8_weight_without_its_scale_is_named(published, tmp_path):
    _rewrite(published, tmp_path / "broken", lambda t: {k: v for k, v in t.items() if k != "mtp.0.attn.wkv.scale"})
    msg = _load_error(tmp_path / "broken")
    assert "mtp.0.attn.wkv" in msg


# ---- through the engine ------------------------------------------------------------------------------


def test_engine_speculates_with_the_published_draft_losslessly(published):
    from deepinfer import LLM, SamplingParams

    prompt = [256] + list(b"A checkpoint as DeepSeek publishes it, with its DSpark draft")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for method in ("dspark", None):
        llm = LLM(model=str(published), backend="cpu", dtype="float32", max_model_len=512,
                  speculative_method=method, speculative_policy="all")
        out = llm.generate([prompt], params)[0]
        assert out.error is None
        tokens[method] = list(out.outputs[0].token_ids)
    assert tokens["dspark"] == tokens[None]

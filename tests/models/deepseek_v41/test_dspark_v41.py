"""DeepSeek V4.1's DSpark draft: its layout under the release's names (own expert count and top-k, no
``hc_head``), its proposals, and the engine's speculative loop on a tiny random V4.1 checkpoint
(``tests/helpers/tiny_v41_draft.py``): greedy decoding with drafts verified equals decoding without."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.loader import read_config
from deepinfer.loader.names import model_name
from deepinfer.models.common.dspark import DSparkConfig, DSparkDraft, DSparkRing
from deepinfer.models.deepseek_v41.draft import DSparkDraftV41
from deepinfer.models.deepseek_v41.layer import DecoderLayerV41
from deepinfer_interfaces import Kernels
from tests.helpers.tiny_v41 import write_tiny_v41
from tests.helpers.dspark_planting import plant_bigrams
from tests.helpers.tiny_v41_draft import DRAFT_EXPERTS, DRAFT_FIELDS, STAGES, draft_shapes, write_tiny_v41_draft
from deepinfer.models.registry import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[(37 * i + 11) % 4000 + 5 for i in range(40)], [(13 * i + 7) % 4000 + 5 for i in range(25)], [5, 6, 7, 8, 9, 10]]
#: committed positions of context before the anchor
CONTEXT = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_v41_draft(tmp_path_factory.mktemp("v41_draft") / "tiny")


@pytest.fixture(scope="module")
def target(ckpt):
    return load_model(ckpt, Kernels(), dtype=torch.float32)


@pytest.fixture(scope="module")
def draft(ckpt, target):
    return DSparkDraft.from_target(target, read_config(ckpt))


def test_the_config_is_read_from_text_config(ckpt, target, draft):
    raw = read_config(ckpt)
    assert "dspark_block_size" not in raw and raw["text_config"]["num_nextn_predict_layers"] == STAGES
    cfg = draft.config
    assert cfg.dspark_num_stages == STAGES and cfg.dspark_block_size == DRAFT_FIELDS["dspark_block_size"]
    assert cfg.dspark_target_layer_ids == DRAFT_FIELDS["dspark_target_layer_ids"]
    assert (cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok) == (DRAFT_EXPERTS, 2)
    assert cfg.dspark_noise_token_id == DRAFT_FIELDS["dspark_noise_token_id"]
    silent = {**raw, "text_config": {k: v for k, v in raw["text_config"].items() if k != "dspark_block_size"}}
    assert DSparkConfig.from_hf(silent, target.config).dspark_block_size == 4  # the validated text config's value


def test_a_v41_checkpoint_without_draft_stages_declares_none(tmp_path):
    plain = write_tiny_v41(tmp_path / "plain")
    model = load_model(plain, Kernels(), dtype=torch.float32)
    assert DSparkConfig.from_hf(read_config(plain), model.config) is None


def test_the_draft_loads_under_the_release_names_with_its_own_experts(ckpt, target, draft):
    assert isinstance(draft, DSparkDraftV41) and len(draft.stages) == STAGES
    released = draft_shapes(read_config(ckpt)["text_config"])
    assert "mtp.2.markov_head.head.weight" in released  # the release's spelling, loaded as markov_w2
    assert set(draft.named_parameters()) == {model_name(name) for name in released}
    assert not any("hc_head" in name for name in draft.named_parameters())
    d, i = target.config.hidden_size, target.config.moe_intermediate_size
    for stage in draft.stages:
        assert isinstance(stage, DecoderLayerV41)
        assert stage.attn.compressor is None and stage.attn.indexer is None and stage.engram is None
        assert stage.ffn.w13.shape == (DRAFT_EXPERTS, 2 * i, d) and stage.ffn.w2.shape == (DRAFT_EXPERTS, d, i)
        assert stage.ffn.top_k == 2 and stage.ffn.bias.shape == (DRAFT_EXPERTS,)
    assert target.layers[0].ffn.w13.shape[0] == target.config.n_routed_experts == 8 and target.layers[0].ffn.top_k == 2
    assert draft.main_proj.shape == (d, 3 * d)
    stored = target.extra_tensors["mtp.1.ffn.experts.3.w2.weight"]
    assert torch.equal(draft.named_parameters()["mtp.1.ffn.experts.3.w2.weight"], stored)


def _propose(draft, ring_seed: int = 0, anchors=(17, 230)):
    """Fill a ring with context from seeded target hidden states and draft one block for two sequences."""
    gen = torch.Generator().manual_seed(ring_seed)
    layers, d = len(draft.config.dspark_target_layer_ids), draft.model_config.hidden_size
    ring = DSparkRing(draft, 2)
    for slot in range(2):
        pos = torch.arange(CONTEXT)
        ring.write(slot, pos, draft.context_kv(draft.context(torch.randn(CONTEXT, layers, d, generator=gen)), pos))
    anchor_pos = torch.full((2,), CONTEXT)
    rows = ring.rows([0, 1], anchor_pos)
    ids = torch.tensor(anchors)
    return draft.draft(ids, anchor_pos, ring.kv, rows), draft.hidden(ids, anchor_pos, ring.kv, rows)


def test_proposes_a_block_with_survival_probabilities(draft):
    out, h = _propose(draft)
    gamma = draft.config.dspark_block_size
    assert out.tokens.shape == out.confidence.shape == (2, gamma)
    assert ((out.tokens >= 0) & (out.tokens < draft.model_config.vocab_size)).all()
    assert ((out.accept_probs > 0) & (out.accept_probs < 1)).all()
    assert torch.allclose(out.confidence, torch.cumprod(out.accept_probs, dim=1))
    assert (out.confidence[:, 1:] <= out.confidence[:, :-1]).all()
    # greedy: each token is the argmax of its logits given the one before it
    prev = torch.cat([torch.tensor([[17], [230]]), out.tokens[:, :-1]], dim=1)
    assert torch.equal(out.tokens, draft.logits(h, prev).argmax(-1))
    again, _ = _propose(draft)
    assert torch.equal(again.tokens, out.tokens)
    _, other = _propose(draft, ring_seed=1)
    assert not torch.allclose(other, h)  # the block reads its context ring


def _generate(ckpt, **engine):
    llm = LLM(model=str(ckpt), backend="cpu", max_prefill_chunk=32, max_model_len=256, **engine)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs], llm.get_metrics()


def test_greedy_with_speculation_equals_without(ckpt):
    plain, plain_stats = _generate(ckpt, speculative_method=None)
    spec, stats = _generate(ckpt, speculative_method="dspark", speculative_policy="all")
    assert spec == plain and all(len(t) == 8 for t in spec)
    assert plain_stats["spec_verifications"] == 0
    assert stats["spec_verifications"] > 0 and stats["spec_verified_tokens"] >= stats["spec_verifications"]
    assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_verified_tokens"]


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_accepted_drafts_keep_greedy_decoding_unchanged(ckpt, tmp_path):
    """A draft planted with bigrams of the target's own greedy continuations gets drafts accepted (and the
    rest rejected and rolled back) without changing a token."""
    plain, _ = _generate(ckpt, speculative_method=None)
    follows: dict[int, set[int]] = {}
    for prompt, tokens in zip(PROMPTS, plain):
        seq = [prompt[-1], *tokens]
        for a, b in zip(seq, seq[1:]):
            follows.setdefault(a, set()).add(b)
    pairs = dict(list({a: next(iter(bs)) for a, bs in follows.items() if len(bs) == 1}.items())[: DRAFT_FIELDS["dspark_markov_rank"]])
    assert pairs
    planted = _copy(ckpt, tmp_path / "planted")
    plant_bigrams(planted, pairs)
    spec, stats = _generate(planted, speculative_method="dspark", speculative_policy="all")
    assert spec == plain
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_verified_tokens"]


def test_more_experts_per_token_than_the_draft_has_is_refused_in_one_line(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path / "bad")
    raw = json.loads((bad / "config.json").read_text())
    raw["text_config"]["dspark_num_experts_per_tok"] = DRAFT_EXPERTS + 1
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        LLM(model=str(bad), backend="cpu", speculative_method="dspark")
    message = str(info.value)
    assert "\n" not in message and "dspark_num_experts_per_tok=5" in message and "4 routed experts" in message


def test_dspark_on_a_v41_checkpoint_without_draft_is_refused(tmp_path):
    plain = write_tiny_v41(tmp_path / "plain")
    with pytest.raises(ConfigError, match="num_nextn_predict_layers is 0"):
        LLM(model=str(plain), backend="cpu", speculative_method="dspark")

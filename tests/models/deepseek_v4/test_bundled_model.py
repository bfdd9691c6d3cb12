"""The bundled checkpoint deepinfer/bundled/tiny-v4: trained by training/train_tiny.py, loaded by the engine,
agreeing with transformers, better than a unigram model, and carrying a working DSpark draft."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.engine import BUNDLED_MODEL
from deepinfer.loader import read_config
from deepinfer.models.common import Batch, ContiguousCache
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.common.dspark import DSparkDraft, DSparkRing
from deepinfer_interfaces import Kernels


PROMPT = "def read_file(path):"
#: the engine's greedy continuation of PROMPT, recorded once from the committed checkpoint:
#: '\n    """Return the file object for the given object."""' then EOS
EXPECTED_IDS: list[int] = [263, 294, 396, 271, 378, 424, 333, 271, 599, 424, 308, 1]
#: prose longer than the sliding window (32) and several HCA windows (16), so every attention type engages
PARITY_TEXT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result "
    "in descending order."
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> DeepseekV4Model:
    return DeepseekV4Model.from_pretrained(BUNDLED_MODEL, Kernels(), dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))


def test_checkpoint_layout_and_shape():
    names = {p.name for p in BUNDLED_MODEL.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert sum(p.stat().st_size for p in BUNDLED_MODEL.iterdir()) <= 25 * 2**20
    cfg = read_config(BUNDLED_MODEL)
    assert set(cfg["layer_types"]) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert cfg["mlp_layer_types"][0] == "hash_moe" and "moe" in cfg["mlp_layer_types"]
    assert cfg["n_routed_experts"] >= 8 and cfg["hc_mult"] >= 2
    from safetensors import safe_open

    with safe_open(str(BUNDLED_MODEL / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.embed_tokens.weight", "head.weight", "model.layers.1.attn.indexer.wq_b.weight"} <= keys
    # the draft under the names DeepSeek's release gives V4-Flash-DSpark's (stage count: the mtp.{i} prefixes)
    assert {
        "mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.1.attn.kv_norm.weight", "mtp.2.hc_head_fn",
        "mtp.2.markov_head.markov_w1.weight", "mtp.2.markov_head.markov_w2.weight", "mtp.2.confidence_head.proj.weight",
    } <= keys
    assert not {k for k in keys if k.startswith("mtp.") and (".attn.norm." in k or ".hc_head." in k or "proj.bias" in k)}
    assert "dspark_num_stages" not in cfg and not any(k.startswith("mtp.3.") for k in keys)


def test_tokenizer_loads_in_transformers(tokenizer):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast.from_pretrained(str(BUNDLED_MODEL))
    cfg = read_config(BUNDLED_MODEL)
    assert fast.bos_token_id == cfg["bos_token_id"] and fast.eos_token_id == cfg["eos_token_id"]
    assert fast.convert_tokens_to_ids("<|noise|>") == cfg["dspark_noise_token_id"]
    assert fast(PROMPT, add_special_tokens=False).input_ids == tokenizer.encode(PROMPT).ids
    assert fast.decode(tokenizer.encode(PARITY_TEXT).ids) == PARITY_TEXT


def test_engine_greedy_generation_matches_recorded():
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(backend="cpu", kv_cache_memory=64 << 20, max_num_seqs=2)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert list(out.token_ids) == EXPECTED_IDS
    assert out.text == '\n    """Return the file object for the given object."""'
    assert out.finish_reason == "stop"


def test_logits_match_transformers(target, tokenizer):
    from transformers import DeepseekV4ForCausalLM

    ids = tokenizer.encode(PARITY_TEXT).ids
    assert len(ids) > 32
    cache = ContiguousCache(target.config, 1, 128, dtype=torch.float32)
    ours = target(Batch.build([ids], [cache.allocate()], [0], logits="all"), cache).float()
    hf = DeepseekV4ForCausalLM.from_pretrained(str(BUNDLED_MODEL)).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4


def test_heldout_perplexity_far_below_unigram(target, tokenizer):
    from training.corpus import build_corpus
    from training.data import corpus_streams, fixed_windows

    train, heldout = corpus_streams(tokenizer, build_corpus())
    windows = fixed_windows(heldout, 128, limit=4)
    cache = ContiguousCache(target.config, len(windows), 128, dtype=torch.float32)
    seqs = windows.tolist()
    logits = target(Batch.build(seqs, [cache.allocate() for _ in seqs], [0] * len(seqs), logits="all"), cache).float()
    logits = logits.view(len(seqs), 128, -1)[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))
    freq = torch.bincount(train, minlength=target.config.vocab_size).double() + 1
    unigram = -(freq / freq.sum()).log()[windows[:, 1:]].mean()
    assert nll.exp() < 0.25 * unigram.exp(), (nll.exp().item(), unigram.exp().item())


def _draft_after(target: DeepseekV4Model, draft: DSparkDraft, seqs: list[list[int]]):
    """Prefill each sequence through the engine's target, fill the draft's rings, draft one block after each."""
    layers = tuple(draft.config.dspark_target_layer_ids)
    cache = ContiguousCache(target.config, len(seqs), 256, dtype=torch.float32)
    slots = [cache.allocate() for _ in seqs]
    first = target(Batch.build(seqs, slots, [0] * len(seqs)), cache, hidden_layers=layers)
    hidden = torch.stack([target.hidden_states[i] for i in layers], dim=1)
    ring = DSparkRing(draft, len(seqs))
    start = 0
    for slot, seq in zip(slots, seqs):
        pos = torch.arange(len(seq) - 1)  # the last token is the anchor: its hidden state is not context yet
        ctx = draft.context(hidden[start : start + len(seq) - 1])
        ring.write(slot, pos, draft.context_kv(ctx, pos))
        start += len(seq)
    anchor_pos = torch.tensor([len(s) - 1 for s in seqs])
    rows = ring.rows(slots, anchor_pos)
    out = draft.draft(torch.tensor([s[-1] for s in seqs]), anchor_pos, ring.kv, rows)
    return out, cache, slots, first


def test_dspark_drafts_five_tokens_with_confidences(target, tokenizer):
    draft = DSparkDraft.from_target(target, read_config(BUNDLED_MODEL))
    assert draft.config.dspark_block_size == 5 and len(draft.stages) == 3
    prompts = [
        'def read_file(path):\n    """Return the contents of the file',
        'class Queue:\n    """Create a queue object with a given maximum size.',
        'def join(a, *p):\n    """Join two or more pathname components, inserting',
    ]
    seqs = [tokenizer.encode(p).ids for p in prompts]
    out, cache, slots, first = _draft_after(target, draft, seqs)
    assert out.tokens.shape == (3, 5) and out.confidence.shape == (3, 5)
    assert ((out.confidence >= 0) & (out.confidence <= 1)).all()
    assert (out.confidence[:, 1:] <= out.confidence[:, :-1] + 1e-7).all()
    assert ((out.token_probs > 0) & (out.token_probs <= 1)).all()
    # the target's greedy continuation of each prompt, decoded one token at a time through the cache
    greedy = [first.argmax(-1).tolist()]
    pos = [len(s) for s in seqs]
    for _ in range(4):
        logits = target(Batch.build([[t] for t in greedy[-1]], slots, pos), cache)
        greedy.append(logits.argmax(-1).tolist())
        pos = [p + 1 for p in pos]
    truth = torch.tensor(greedy).t()
    accepted = (out.tokens == truth).long().cumprod(dim=1).sum(1)
    assert accepted.float().mean() >= 1.0, (out.tokens.tolist(), truth.tolist())


def test_training_smoke(tmp_path):
    from training import train_tiny

    out = tmp_path / "micro"
    report = train_tiny.main(["--smoke", "--out", str(out)])
    assert report["perplexity"] > 0 and report["unigram_perplexity"] > 0
    assert len(report["expert_load"]) == 3
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dspark_block_size"] == 5
    target = DeepseekV4Model.from_pretrained(out, Kernels(), dtype=torch.float32)
    draft = DSparkDraft.from_target(target, cfg)
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(str(out)).eval()
    # 20 tokens: past the sliding window (8) and an HCA window (16), with every CSA entry still visible; beyond
    # that the barely trained indexer's top-k meets exact ReLU-zero score ties, which either side may break its own way
    ids = list(range(3, 23))
    cache = ContiguousCache(target.config, 1, 64, dtype=torch.float32)
    ours = target(Batch.build([ids], [cache.allocate()], [0], logits="all"), cache).float()
    with torch.no_grad():
        assert (ours - hf(torch.tensor([ids])).logits[0]).abs().max().item() <= 1e-4
    acc = report["acceptance"]
    assert acc["samples"] == 4 and sum(acc["accepted_histogram"]) == acc["draft_passes"] > 0
    assert sum(acc["first_pass_histogram"]) <= acc["samples"]
    assert 0 <= acc["mean_accepted"] <= draft.config.dspark_block_size
    assert all(0 <= p <= 1 for p in acc["survival_predicted"])

"""DeepseekV4Model against transformers' DeepseekV4ForCausalLM on tiny random checkpoints.

Each variant is written by transformers (``save_pretrained``) and loaded through
``deepinfer.loader``; our forward runs the three sequences as one flattened batch.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.models.common import Batch, ContiguousCache
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_interfaces import Kernels
from tests.helpers.checkpoints import VARIANTS, build_hf_model, make_tiny_checkpoint


FP32_ATOL = 1e-4
#: bf16 vs fp32 logits where both runs make the same discrete choices (measured <= 0.08)
BF16_ATOL = 0.15
#: bf16 vs fp32 mean absolute logit error over all positions
BF16_MEAN_ATOL = 0.02
#: longer than the sliding window (8) and than twice the HCA ratio (16)
SEQ_LENS = (45, 13, 37)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {v: make_tiny_checkpoint(root, v) for v in VARIANTS}


@pytest.fixture(scope="module")
def hf_models() -> dict:
    return {v: build_hf_model(v) for v in VARIANTS}


@pytest.fixture(scope="module")
def models(checkpoints) -> dict:
    return {v: DeepseekV4Model.from_pretrained(d, Kernels(), dtype=torch.float32) for v, d in checkpoints.items()}


def sequences() -> list[list[int]]:
    return [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in SEQ_LENS]


def prefill_all(model: DeepseekV4Model, seqs: list[list[int]], dtype=torch.float32) -> list[torch.Tensor]:
    """Per-sequence ``[len, vocab]`` logits of one batched forward over whole sequences."""
    cache = ContiguousCache(model.config, len(seqs), 64, dtype=dtype)
    slots = [cache.allocate() for _ in seqs]
    out = model(Batch.build(seqs, slots, [0] * len(seqs), logits="all"), cache)
    return list(out.float().split([len(s) for s in seqs]))


def hf_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].float()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefill_logits_match_transformers(variant, models, hf_models):
    seqs = sequences()
    ours = prefill_all(models[variant], seqs)
    for seq, got in zip(seqs, ours):
        err = (got - hf_logits(hf_models[variant], seq)).abs().max().item()
        assert err <= FP32_ATOL, f"{variant} len {len(seq)}: max-abs {err:.2e}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_token_by_token_decode_reproduces_prefill(variant, models):
    model = models[variant]
    seqs = sequences()
    full = prefill_all(model, seqs)
    cache = ContiguousCache(model.config, len(seqs), 64, max_step_tokens=1, dtype=torch.float32)
    slots = [cache.allocate() for _ in seqs]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    for p in range(max(SEQ_LENS)):
        live = [i for i, s in enumerate(seqs) if p < len(s)]
        out = model(Batch.build([[seqs[i][p]] for i in live], [slots[i] for i in live], [p] * len(live)), cache)
        for r, i in enumerate(live):
            rows[i].append(out[r])
    for i, seq in enumerate(seqs):
        err = (torch.stack(rows[i]) - full[i]).abs().max().item()
        assert err <= FP32_ATOL, f"{variant} len {len(seq)}: max-abs {err:.2e}"
        assert cache.lengths[slots[i]] == len(seq)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_generation_matches_transformers_generate(variant, models, hf_models):
    model, hf = models[variant], hf_models[variant]
    prompt = sequences()[1]
    hf.generation_config.eos_token_id = None  # run all 32 steps, as our loop does
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    cache = ContiguousCache(model.config, 1, 64, dtype=torch.float32)
    slot = cache.allocate()
    logits = model(Batch.build([prompt], [slot], [0]), cache)
    got = []
    for _ in range(32):
        got.append(int(logits[0].argmax()))
        logits = model(Batch.build([[got[-1]]], [slot], [cache.lengths[slot]]), cache)
    assert got == expected


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chunked_prefill_mixed_with_decode_matches_prefill(variant, models):
    """Random chunk sizes per step, prefill chunks and single tokens of other sequences together."""
    model = models[variant]
    seqs = sequences()
    full = prefill_all(model, seqs)
    rng = random.Random(variant)
    cache = ContiguousCache(model.config, len(seqs), 64, max_step_tokens=7, dtype=torch.float32)
    slots = [cache.allocate() for _ in seqs]
    done = [0] * len(seqs)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(d < len(s) for d, s in zip(done, seqs)):
        live = [i for i, s in enumerate(seqs) if done[i] < len(s) and rng.random() < 0.8]
        if not live:
            continue
        chunks = {i: seqs[i][done[i]: done[i] + rng.choice([1, 1, 3, 7])] for i in live}
        batch = Batch.build([chunks[i] for i in live], [slots[i] for i in live], [done[i] for i in live], logits="all")
        out = model(batch, cache).split([len(chunks[i]) for i in live])
        for i, o in zip(live, out):
            rows[i].extend(o)
            done[i] += len(chunks[i])
    for i in range(len(seqs)):
        err = (torch.stack(rows[i]) - full[i]).abs().max().item()
        assert err <= FP32_ATOL, f"{variant} sequence {i}: max-abs {err:.2e}"


@pytest.mark.parametrize("variant", ["mixed", "compressed_yarn"])
def test_rolling_back_provisional_tokens_restores_state(variant, models):
    """Provisional tokens that close CSA and HCA windows, then a rollback, leave no trace."""
    model = models[variant]
    seq = sequences()[0]
    full = prefill_all(model, [seq])[0]
    cache = ContiguousCache(model.config, 1, 64, max_step_tokens=4, dtype=torch.float32)
    slot = cache.allocate()
    for start in range(0, 28, 4):
        model(Batch.build([seq[start: start + 4]], [slot], [start]), cache)
    wrong = [(t + 101) % 256 for t in seq[30:32]]
    out = model(Batch.build([seq[28:30] + wrong], [slot], [28], logits="all"), cache)  # position 31 closes windows
    assert (out[:2] - full[28:30]).abs().max().item() <= FP32_ATOL
    assert (out[2:] - full[30:32]).abs().max().item() > 1e-3  # the wrong tokens did change something
    cache.truncate(slot, 30)
    rows = []
    for start in range(30, len(seq), 4):
        rows.append(model(Batch.build([seq[start: start + 4]], [slot], [start], logits="all"), cache))
    err = (torch.cat(rows) - full[30:]).abs().max().item()
    assert err <= FP32_ATOL, f"after rollback: max-abs {err:.2e}"


class ChoiceRecorder(Kernels):
    """The reference kernels, remembering every discrete choice in call order: the
    experts of routed MoE layers and the entries the lightning indexer keeps."""

    def __init__(self) -> None:
        self.choices: list[torch.Tensor] = []

    def moe_route(self, *args, **kwargs):
        weights, ids = super().moe_route(*args, **kwargs)
        self.choices.append(ids.sort(dim=-1).values)
        return weights, ids

    def indexer_topk(self, *args, **kwargs):
        out = super().indexer_topk(*args, **kwargs)
        self.choices.append(out.sort(dim=-1).values)
        return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_bf16_stays_within_tolerance_of_fp32(variant, checkpoints):
    """bf16 logits are within BF16_ATOL of fp32 at positions where both runs make the same
    discrete choices; a near tie (between experts, or between compressed entries at the
    indexer's top-k cut) may flip under bf16 rounding and moves that position further."""
    seqs = sequences()
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        kernels = ChoiceRecorder()
        model = DeepseekV4Model.from_pretrained(checkpoints[variant], kernels, dtype=dtype)
        runs[dtype] = (torch.cat(prefill_all(model, seqs, dtype)), kernels.choices)
    (f32, f32_choices), (bf16, bf16_choices) = runs[torch.float32], runs[torch.bfloat16]
    assert bf16.dtype == torch.float32 and f32.shape == bf16.shape
    same = torch.ones(f32.shape[0], dtype=torch.bool)
    for a, b in zip(f32_choices, bf16_choices, strict=True):
        same &= (a == b).all(-1)
    err = (bf16 - f32).abs()
    assert same.float().mean() >= 0.8
    assert err[same].max().item() <= BF16_ATOL
    assert err.mean().item() <= BF16_MEAN_ATOL


def test_bf16_checkpoint_loads_into_bf16_model(tmp_path, models):
    ckpt = make_tiny_checkpoint(tmp_path, "mixed", dtype=torch.bfloat16)
    model = DeepseekV4Model.from_pretrained(ckpt, Kernels(), dtype=torch.bfloat16)
    params = model.named_parameters()
    assert params["model.layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert params["model.layers.0.attn.attn_sink"].dtype == torch.float32
    ours = torch.cat(prefill_all(model, sequences(), torch.bfloat16))
    ref = torch.cat(prefill_all(models["mixed"], sequences()))
    assert (ours - ref).abs().mean().item() <= BF16_MEAN_ATOL


def test_parameter_names_are_the_checkpoint_keys_and_mtp_is_kept_aside(checkpoints, models):
    from safetensors import safe_open

    with safe_open(str(checkpoints["mixed"] / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    model = models["mixed"]
    assert set(model.named_parameters()) == keys
    assert set(model.extra_tensors) == {"mtp.0.enorm.weight", "mtp.0.hnorm.weight", "mtp.0.e_proj.weight"}
    experts = model.layers[1].ffn
    w3 = model.named_parameters()["model.layers.1.ffn.experts.2.w3.weight"]
    assert w3.data_ptr() == experts.w13[2, experts.w13.shape[1] // 2:].data_ptr()  # loaded straight into the stack


class TopkRecorder(Kernels):
    """The reference kernels, counting valid candidates and picks of the lightning indexer."""

    def __init__(self) -> None:
        self.candidates: list[int] = []
        self.picked: list[int] = []

    def indexer_topk(self, q, weights, keys, table, token_seq, visible, scale, k):
        out = super().indexer_topk(q, weights, keys, table, token_seq, visible, scale, k)
        self.candidates.append(int(visible.max()) if visible.numel() else 0)
        self.picked.append(int((out >= 0).sum(-1).max()))
        return out


def test_csa_topk_variant_really_drops_entries(checkpoints):
    kernels = TopkRecorder()
    model = DeepseekV4Model.from_pretrained(checkpoints["csa_topk"], kernels, dtype=torch.float32)
    prefill_all(model, sequences())
    assert max(kernels.candidates) > 3 and max(kernels.picked) == 3


def test_empty_batch_and_no_logit_rows(models):
    model = models["mixed"]
    cache = ContiguousCache(model.config, 1, 64, dtype=torch.float32)
    assert model(Batch.build([], [], []), cache).shape == (0, model.config.vocab_size)
    slot = cache.allocate()
    assert model(Batch.build([[1, 2, 3]], [slot], [0], logits=[[]]), cache).shape == (0, model.config.vocab_size)
    assert cache.lengths[slot] == 3

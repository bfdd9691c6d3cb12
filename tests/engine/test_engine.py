"""The engine end to end on tiny transformers-built checkpoints (CPU backend, fp32)."""

import math

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.llm import LLM
from deepinfer.models.common.cache_spec import CacheGeometry, block_size_for
from deepinfer.sampling_params import InvalidRequestError, SamplingParams
from tests.helpers.checkpoints import BOS_ID, EOS_ID, VOCAB_SIZE, build_hf_model, make_tiny_checkpoint
from tests.helpers.reference import greedy_alone, load_model
from deepinfer.models.registry import load_config

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "mixed")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    lens = [1, 2, 3, 5, 7, 8, 9, 12, 15, 16, 17, 23, 31, 33, 40, 47, 64, 70]
    return [[BOS_ID] + torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def alone(ckpt, prompts):
    model = load_model(ckpt)
    return [greedy_alone(model, p, MAX_TOKENS) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_equals_alone_and_transformers(ckpt, prompts, alone):
    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=256)
    outs = llm.generate(prompts, GREEDY)
    assert _tokens(outs) == alone
    hf = build_hf_model("mixed")
    hf.generation_config.eos_token_id = None  # ignore_eos
    for p, toks in zip(prompts[::4], alone[::4]):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)
        assert ref[0, len(p):].tolist() == toks
    for o in outs:
        assert o.finished and o.error is None and o.outputs[0].finish_reason == "length"
        assert o.metrics.time_to_first_token is not None and o.metrics.time_per_output_token is not None


def test_small_chunks_and_mixed_steps(ckpt, prompts, alone):
    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=256, max_num_batched_tokens=7, max_prefill_chunk=7)
    assert _tokens(llm.generate(prompts, GREEDY)) == alone


def test_preemption_keeps_outputs_exact(ckpt, prompts, alone):
    config = load_config(ckpt)
    bs = block_size_for(config, 16)
    step = 16
    max_len = 96
    geometry = CacheGeometry.build(config, bs, step, max_len)
    per_slot = geometry.bytes_per_slot(torch.float32)
    per_block = geometry.bytes_per_block(torch.float32)
    blocks = math.ceil(max_len / bs) + 4  # room for about two long sequences at once
    budget = 8 * per_slot + blocks * per_block
    llm = LLM(
        model=str(ckpt), backend="cpu", kv_cache_memory=budget, max_model_len=max_len,
        max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=step, enable_prefix_caching=False,
    )
    outs = llm.generate(prompts, GREEDY)
    preemptions = llm.get_metrics()["preemptions"]
    assert preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == preemptions
    assert _tokens(outs) == alone


def test_kv_budget_too_small_refused_with_numbers(ckpt):
    with pytest.raises(ConfigError, match=r"kv_cache_memory of 1000 bytes cannot hold one sequence of max_model_len 256.*at least \d+ bytes"):
        LLM(model=str(ckpt), backend="cpu", kv_cache_memory=1000, max_model_len=256)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=128)


def test_seeded_sampling_reproducible_and_batch_independent(llm, prompts):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[5]], sp)[0].outputs[0].token_ids
    again = llm.generate([prompts[5]], sp)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=8)
    batch = llm.generate(prompts[:8], [others] * 5 + [sp] + [others] * 2)
    assert alone == again == batch[5].outputs[0].token_ids
    other_seed = llm.generate([prompts[5]], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8, seed=99, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_prompt_logprobs_match_transformers(llm, prompts):
    p = prompts[12]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, logprobs=2))[0]
    hf = build_hf_model("mixed")
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(p)):
        pos = out.prompt_logprobs[i]
        assert p[i] in pos
        assert abs(pos[p[i]].logprob - ref[i - 1, p[i]].item()) < 1e-4
        top = ref[i - 1].topk(3)
        assert set(top.indices.tolist()) <= set(pos)
        assert pos[int(top.indices[0])].rank == 1
    first = out.outputs[0].logprobs[0]
    chosen = out.outputs[0].token_ids[0]
    assert first[chosen].rank == 1 and len(first) == 2


def test_bad_requests_fail_alone(llm, prompts):
    outs = llm.generate(
        [prompts[3], [], [BOS_ID] * 200, [VOCAB_SIZE + 5], prompts[4], prompts[6], prompts[7]],
        [GREEDY, GREEDY, GREEDY, GREEDY, {"temperature": -1}, {"top_p": 1.5}, {"max_tokens": 0}],
    )
    errors = [o.error for o in outs]
    assert errors[0] is None and outs[0].outputs[0].token_ids
    assert "prompt is empty" in errors[1]
    assert "200 tokens but max_model_len is 128" in errors[2]
    assert f"token id {VOCAB_SIZE + 5} is outside the vocabulary" in errors[3]
    assert "temperature" in errors[4] and "-1" in errors[4]
    assert "top_p" in errors[5]
    assert "max_tokens" in errors[6]
    assert all(len(e.splitlines()) == 1 for e in errors[1:])


def test_sampling_params_validate_on_creation():
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(InvalidRequestError, match="top_p"):
        SamplingParams(top_p=0)


def test_stop_token_and_stop_string(llm, prompts):
    base = llm.generate([prompts[8]], GREEDY)[0].outputs[0]
    stop_tok = base.token_ids[3]
    out = llm.generate([prompts[8]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_tok], ignore_eos=True))[0].outputs[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    text = base.text
    if len(text) >= 4:
        stop = text[2:4]
        out = llm.generate([prompts[8]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop], ignore_eos=True))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: text.index(stop)]


def test_eos_stops_unless_ignored(ckpt, prompts):
    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=128)
    eng = llm.engine
    assert EOS_ID in eng.eos_token_ids
    # make EOS the argmax by steering the logits through a stop-token-like check on a real run:
    outs = llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for o in outs:
        toks = o.outputs[0].token_ids
        assert EOS_ID not in toks[:-1]
        assert (toks[-1] == EOS_ID) == (o.outputs[0].finish_reason == "stop")


def test_streaming_yields_tokens_as_produced(llm, prompts):
    seen = {}
    for out in llm.generate_stream(prompts[:3], GREEDY):
        prev = seen.get(out.request_id, [])
        toks = out.outputs[0].token_ids
        assert toks[: len(prev)] == prev and len(toks) >= len(prev)
        seen[out.request_id] = toks
    assert all(len(t) == MAX_TOKENS for t in seen.values())


def test_abort_mid_generation(llm, prompts):
    eng = llm.engine
    req = eng.add_request(prompts[2], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    keep = eng.add_request(prompts[3], GREEDY)
    for _ in range(3):
        eng.step()
    eng.abort(req.request_id)
    while not keep.finished:
        eng.step()
    out = eng.output(req)
    assert out.finished and out.outputs[0].finish_reason == "abort" and 0 < len(out.outputs[0].token_ids) < 50
    assert eng.output(keep).outputs[0].finish_reason == "length"


@pytest.mark.parametrize("variant", ["mixed", "compressed_yarn", "sliding_hca"])
def test_planned_kv_budget_is_what_the_pools_hold(tmp_path, variant):
    ckpt = make_tiny_checkpoint(tmp_path, variant)
    budget = 3 << 20
    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=budget, max_model_len=256, max_num_seqs=3, max_prefill_chunk=40)
    runner = llm.engine.runner
    plan, cache = runner.plan, runner.cache
    assert plan.budget == cache.pool_bytes() <= budget
    assert plan.budget == plan.num_slots * plan.bytes_per_slot + plan.num_blocks * plan.bytes_per_block
    assert f"{plan.budget / (1 << 20):.1f} MiB" in plan.describe()
    assert plan.draft_bytes_per_slot == 0 and runner.proposer is None  # these checkpoints have no draft
    # the rings hold one step of max_step_tokens beyond the window
    assert cache.window_rows == runner.config.sliding_window - 1 + 40


def test_metrics_count_each_step_once(ckpt, prompts):
    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=256, max_num_batched_tokens=32, max_prefill_chunk=32)
    outs = llm.generate(prompts[:6], GREEDY)
    m = llm.get_metrics()
    prompt_tokens = sum(len(p) for p in prompts[:6])
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert m["prompt_tokens"] == prompt_tokens and m["generated_tokens"] == generated == 6 * MAX_TOKENS
    assert m["computed_tokens"] == prompt_tokens + generated - 6 and m["prefill_tokens"] == prompt_tokens
    assert m["steps"] > 0 and m["forward_ms_per_step"] > 0 and 0 <= m["device_idle_fraction"] <= 1
    assert m["graph_replays"] == 0 and m["preemptions"] == 0
    assert str(m["steps"]) in llm.engine.stats_line()


def test_planned_kv_budget_counts_the_draft_context_rings():
    # the bundled model has a DSpark draft: its per-slot context rings come out of the same budget
    budget = 3 << 20
    runner = LLM(backend="cpu", kv_cache_memory=budget, max_model_len=256, max_num_seqs=3).engine.runner
    plan, ring = runner.plan, runner.proposer.ring
    rings = sum(t.numel() * t.element_size() for t in (ring.kv, ring.positions, ring.ctx))  # K=V rows, their positions, context vectors
    assert plan.draft_bytes_per_slot > 0 and rings == plan.num_slots * plan.draft_bytes_per_slot
    assert plan.budget == runner.cache.pool_bytes() + rings <= budget
    assert "the draft's context rings" in plan.describe()
    # a budget with room for two sequences' blocks besides the slots and rings: without the draft, the rings' bytes hold more blocks
    tight = plan.num_slots * (plan.bytes_per_slot + plan.draft_bytes_per_slot) + 2 * (256 // plan.block_size) * plan.bytes_per_block
    kw = dict(backend="cpu", kv_cache_memory=tight, max_model_len=256, max_num_seqs=3)
    with_draft = LLM(**kw).engine.runner.plan
    without = LLM(**kw, speculative_method=None).engine.runner.plan
    assert with_draft.num_blocks == 2 * (256 // plan.block_size) and without.draft_bytes_per_slot == 0
    ceiling = 3 * (256 // plan.block_size)  # blocks beyond every slot at max_model_len are not planned
    assert without.num_blocks == min(ceiling, with_draft.num_blocks + (3 * plan.draft_bytes_per_slot) // plan.bytes_per_block) > with_draft.num_blocks

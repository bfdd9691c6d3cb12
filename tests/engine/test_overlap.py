"""Overlap scheduling: the next step is planned while the device runs this one; outputs are unchanged."""

import threading

import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from tests.helpers.checkpoints import BOS_ID, make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "mixed")


def _prompts(n=12):
    g = torch.Generator().manual_seed(3)
    return [[BOS_ID] + torch.randint(0, 256, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _run(ckpt, overlap, params, abort_at=None):
    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=128, overlap_scheduling=overlap, max_num_batched_tokens=32)
    eng = llm.engine
    reqs = [eng.add_request(p, sp) for p, sp in zip(_prompts(len(params)), params)]
    while eng.has_unfinished:
        eng.step()
        if abort_at is not None and len(reqs[0].output_token_ids) >= abort_at:
            eng.abort(reqs[0].request_id)
    outs = [eng.output(r) for r in reqs]
    return outs, eng


def test_outputs_identical_with_and_without_overlap(ckpt):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base, _ = _run(ckpt, False, [greedy] * 6)
    stops = []
    for o in base[:3]:
        text = o.outputs[0].text
        stops.append(text[3:5] if len(text) > 5 else None)
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),  # aborted mid-way
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stops[1]] if stops[1] else []),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[base[2].outputs[0].token_ids[4]]),
        SamplingParams(temperature=0.8, max_tokens=12, seed=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
    ]
    off, eng_off = _run(ckpt, False, params, abort_at=5)
    on, eng_on = _run(ckpt, True, params, abort_at=5)
    for a, b in zip(off, on):
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.token_ids, ca.text, ca.finish_reason, ca.stop_reason) == (cb.token_ids, cb.text, cb.finish_reason, cb.stop_reason)
        if ca.logprobs is not None:
            assert [sorted(x) for x in ca.logprobs] == [sorted(x) for x in cb.logprobs]
    assert on[0].outputs[0].finish_reason == "abort" and len(on[0].outputs[0].token_ids) == 5
    assert on[1].outputs[0].finish_reason == "stop" and on[2].outputs[0].finish_reason == "stop"
    assert len(on[4].outputs[0].token_ids) == 1
    # a stop seen one step late costs at most one extra computed token per request, never an output token
    assert eng_on.stats.computed_tokens - eng_off.stats.computed_tokens <= len(params)


def test_forward_runs_on_the_device_thread(ckpt):
    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=128, overlap_scheduling=True)
    before = {t.ident for t in threading.enumerate()}
    llm.generate(_prompts(2), SamplingParams(temperature=0, max_tokens=4))
    new = [t for t in threading.enumerate() if t.ident not in before]
    assert any(t.name.startswith("deepinfer-device") for t in new)
    assert llm.engine.stats.steps > 0 and 0.0 <= llm.engine.stats.device_idle_fraction <= 1.0
    off = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=128, overlap_scheduling=False)
    assert not off.engine.executor.threaded and llm.engine.executor.threaded

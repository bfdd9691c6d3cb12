"""Prefix caching: shared compressed state by chained block hashes, sliding-window state rebuilt by replay."""

import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from tests.helpers.checkpoints import BOS_ID, byte_tokens, make_tiny_checkpoint
from deepinfer.models.registry import load_config

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "mixed")


def _workload(prefix_len=100, users=6):
    system = [BOS_ID] + byte_tokens(prefix_len, 0)
    return [system + byte_tokens(3 + 4 * i, 10 + i) for i in range(users)]


def _llm(ckpt, **kw):
    base = dict(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=4096, max_num_batched_tokens=256, max_prefill_chunk=256)
    base.update(kw)
    return LLM(**base)


def _serve(llm, prompts):
    first = llm.generate(prompts[:1], GREEDY)
    return [o.outputs[0].token_ids for o in first + llm.generate(prompts[1:], GREEDY)]


def test_exact_replay_matches_no_caching(ckpt):
    prompts = _workload()
    off = _serve(_llm(ckpt, enable_prefix_caching=False), prompts)
    llm = _llm(ckpt, swa_replay="exact")
    on = _serve(llm, prompts)
    assert on == off
    stats = llm.engine.stats
    assert stats.prefix_hit_rate > 0.5 and stats.cached_tokens > 0
    assert stats.replayed_tokens == (len(prompts) - 1) * llm.engine.replay_tokens


@pytest.mark.parametrize("prefix_len", [300, 3000])
def test_bounded_replay_recomputes_exactly_the_window(ckpt, prefix_len):
    llm = _llm(ckpt)
    w = llm.engine.runner.config.sliding_window
    prompts = _workload(prefix_len, users=3)
    _serve(llm, prompts)
    stats = llm.engine.stats
    hits = len(prompts) - 1
    assert stats.replayed_tokens == hits * w
    block = llm.engine.kv.block_size
    per_hit = (prefix_len + 1) // block * block  # the shared system prompt, in whole blocks
    assert stats.cached_tokens == hits * per_hit
    # a hit recomputes only the window before it and its own suffix, whatever the prefix length
    fresh = len(prompts[0]) + sum(len(p) - per_hit + w for p in prompts[1:])
    assert stats.computed_tokens == fresh + stats.generated_tokens - len(prompts)


def test_short_hits_are_not_adopted(ckpt):
    llm = _llm(ckpt, swa_replay="exact")
    short = [BOS_ID] + byte_tokens(20, 5)  # shorter than the exact replay length
    _serve(llm, [short + [1, 2], short + [3, 4]])
    assert llm.engine.stats.cached_tokens == 0 and llm.engine.stats.replayed_tokens == 0


def test_eviction_under_small_cache_keeps_outputs(ckpt):
    prompts = [[BOS_ID] + byte_tokens(80, s) + byte_tokens(5, 100 + i) for i, s in enumerate([1, 2, 1, 3, 2, 1])]
    off = _serve(_llm(ckpt, enable_prefix_caching=False), prompts)
    from deepinfer.models.common.cache_spec import CacheGeometry, block_size_for

    config = load_config(ckpt)
    geometry = CacheGeometry.build(config, block_size_for(config, 16), 64, 200)
    per_slot = geometry.bytes_per_slot(torch.float32)
    per_block = geometry.bytes_per_block(torch.float32)
    llm = _llm(ckpt, swa_replay="exact", kv_cache_memory=2 * per_slot + 14 * per_block, max_num_seqs=2, max_model_len=200,
               max_num_batched_tokens=64, max_prefill_chunk=64)
    on = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]
    assert on == off
    assert llm.engine.kv.pool.num_evictions > 0

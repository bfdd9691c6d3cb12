"""Seeded sampling keyed by position: a seeded request's tokens are a function of its seed, its prompt and
the model alone — the same whether anything was drafted (policy ``all``, adaptive, none), whatever else
runs beside it, whether it was preempted, and for each of ``n`` completions as for a request seeded
``seed + i`` alone — while its noise stays Exp(1) and unseeded requests keep rejection sampling."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.sampling_noise import noise_key, position_exponentials

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def read_file(path):", "class Cache:\n    def get(self, key):", "Return the number of"]
SEED = 20261207
TOKENS = 24


def _llm(**kw) -> LLM:
    return LLM(**{"backend": "cpu", "max_num_seqs": 8, "max_model_len": 320, **kw})


def _probe(temperature: float = 0.8) -> list[SamplingParams]:
    return [SamplingParams(n=3, temperature=temperature, seed=SEED + i, max_tokens=TOKENS, ignore_eos=True, logprobs=1)
            for i in range(len(PROMPTS))]


def _tokens(outs) -> list[list[list[int]]]:
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def plain() -> list[list[list[int]]]:
    """The probe without speculation: the reference every other way of running it must equal."""
    return _tokens(_llm(speculative_method=None).generate(PROMPTS, _probe()))


@pytest.mark.parametrize("kw", [{"speculative_policy": "all"}, {"speculative_policy": "adaptive"},
                                {"speculative_policy": "threshold", "speculative_threshold": 0.3}])
def test_speculation_never_changes_seeded_tokens(plain, kw):
    llm = _llm(**kw)
    assert _tokens(llm.generate(PROMPTS, _probe())) == plain
    if kw["speculative_policy"] == "all":  # drafts were verified, and some kept (adaptive may verify none)
        assert llm.get_metrics()["spec_accepted_tokens"] > 0


def test_neighbours_and_preemption_never_change_seeded_tokens(plain):
    """The probe among unseeded and other seeded requests arriving in one batch, in a cache so small that
    requests are preempted and recomputed."""
    others = [f"def f{i}(x):" for i in range(10)]
    params = _probe() + [SamplingParams(temperature=1.0, max_tokens=TOKENS + i, ignore_eos=True, seed=None if i % 2 else i)
                         for i in range(len(others))]
    llm = _llm(max_num_seqs=6, max_model_len=64, kv_cache_memory=_small_cache())
    outs = llm.generate(PROMPTS + others, params)
    assert _tokens(outs[: len(PROMPTS)]) == plain
    assert llm.get_metrics()["preemptions"] > 0


def _small_cache() -> int:
    """Six sequence slots and eight blocks of 16 tokens: one sequence of the 64-token context twice over,
    fewer than six sequences of about 40 tokens want at once."""
    plan = _llm(max_num_seqs=6, max_model_len=64).engine.runner.plan
    return (plan.bytes_per_slot + plan.draft_bytes_per_slot) * 6 + plan.bytes_per_block * 8


def test_each_completion_is_the_request_seeded_with_its_index(plain):
    """Completion ``i`` of a request seeded ``s`` is what a request seeded ``s + i`` gives alone."""
    llm = _llm(speculative_method=None)
    alone = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]] * 3, [
        SamplingParams(temperature=0.8, seed=SEED + i, max_tokens=TOKENS, ignore_eos=True, logprobs=1) for i in range(3)])]
    assert plain[0] == alone


def test_position_noise_is_exponential_and_a_pure_function():
    keys = torch.tensor([noise_key(SEED), noise_key(2**64 - 1), noise_key(-5)])
    positions = torch.tensor([7, 7, 123456])
    noise = position_exponentials(keys, positions, 50000)
    assert torch.equal(noise[1:], position_exponentials(keys[1:], positions[1:], 50000))  # batch-independent
    assert not torch.equal(noise[0], position_exponentials(keys[:1], positions[:1] + 1, 50000)[0])  # position-keyed
    for row in noise:  # Kolmogorov–Smirnov against Exp(1), far inside the 0.1 % critical value
        u = torch.exp(-row.double()).sort().values
        grid = (torch.arange(len(u), dtype=torch.float64) + 0.5) / len(u)
        assert (u - grid).abs().max() < 1.95 / math.sqrt(len(u))

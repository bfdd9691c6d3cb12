"""Deterministic mode: a probe request (greedy, and seeded at temperature 0.8 with ``n = 3``) gives bit-identical
token ids and logprobs whether it runs alone or among 63 random requests arriving at random steps, with
speculation off, ``all`` or adaptive, under expert parallelism of 1 and 2, after forced preemption and
recompute, after a prefix hit, and with its prompt cut into prefill chunks of 16, 64 or 512 tokens. The mode's
settings and errors come last (``tests/serving/test_serve_deterministic.py``: the same through a PD pair)."""

from __future__ import annotations

import argparse
import random

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config import load_config
from deepinfer.deterministic import enable_batch_invariance
from deepinfer.engine_flags import add_engine_arguments, engine_overrides
from deepinfer.errors import ConfigError
from deepinfer.registry import select_backend
from deepinfer_interfaces import Kernels, NotSupportedError

pytestmark = pytest.mark.usefixtures("one_thread")

#: 204 tokens: chunks of 16 cut it in thirteen, of 64 in four, of 512 not at all; longer than an exact
#: replay (128 tokens on the bundled model), so running it again is a prefix hit
PROBE = "def read_file(path):\n    with open(path) as f:\n        return f.read()\n\n" * 8 + "class Cache:\n    def get(self, key):"
SEED = 20261207
TOKENS = 12
CROWD = 63


def probe_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=3),
            SamplingParams(n=3, temperature=0.8, seed=SEED, max_tokens=TOKENS, ignore_eos=True, logprobs=3)]


def signature(out) -> list[tuple]:
    """Every completion's token ids and, per position, its logprobs exactly as floats."""
    assert out.error is None, out.error
    return [(tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob, lp.rank) for t, lp in row.items())) for row in c.logprobs))
            for c in out.outputs]


def deterministic_llm(**kw) -> LLM:
    return LLM(**{"backend": "cpu", "deterministic": True, "max_num_seqs": 64, "max_model_len": 256, **kw})


def run_alone(llm: LLM) -> list[list[tuple]]:
    return [signature(o) for o in llm.generate([PROBE, PROBE], probe_params())]


def run_in_crowd(llm: LLM, seed: int, size: int = CROWD) -> list[list[tuple]]:
    """The probe among ``size`` requests of random lengths and parameters (greedy, seeded, unseeded), each
    arriving at a random step; the probe arrives in the middle of them."""
    rng = random.Random(seed)
    words = "the of cache token def return class import self path key value".split()
    crowd = [(" ".join(rng.choice(words) for _ in range(rng.randint(1, 90))),
              SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), seed=rng.choice([None, rng.randrange(1 << 30)]),
                             max_tokens=rng.randint(1, 16), ignore_eos=True, logprobs=rng.choice([None, 2])))
             for _ in range(size)]
    arrivals = sorted(rng.randrange(24) for _ in crowd)
    probe_at = arrivals[len(arrivals) // 2]
    engine = llm.engine
    probes = []
    step = 0
    pending = list(zip(arrivals, crowd))
    while pending or engine.has_unfinished:
        while pending and pending[0][0] <= step:
            _, (prompt, params) = pending.pop(0)
            engine.add_request(prompt, params)
        if step == probe_at and not probes:
            probes = [engine.add_request(PROBE, p) for p in probe_params()]
        engine.step()
        step += 1
    return [signature(engine.output(r)) for r in probes]


@pytest.fixture(scope="module")
def reference() -> list[list[tuple]]:
    """The probe alone, without speculation, in one prefill chunk: what every other run must equal bit for bit."""
    llm = deterministic_llm(speculative_method=None)
    assert llm.engine.runner.kernels.batch_invariant
    return run_alone(llm)


def test_alone_with_every_draft_verified_and_chunks_of_16_and_a_prefix_hit(reference):
    """Speculation ``all`` (verify forwards instead of decode steps), thirteen prefill chunks, overlap scheduling;
    run again, the prompt is a prefix hit replayed exactly."""
    llm = deterministic_llm(speculative_policy="all", max_num_batched_tokens=16, overlap_scheduling=True)
    assert run_alone(llm) == reference
    assert llm.get_metrics()["spec_accepted_tokens"] > 0
    assert run_alone(llm) == reference
    assert llm.get_metrics()["cached_tokens"] > 0


def test_among_random_requests_arriving_at_random_steps(reference):
    llm = deterministic_llm(speculative_method=None, max_prefill_chunk=512)
    assert run_in_crowd(llm, seed=1) == reference


def test_under_expert_parallelism_among_random_requests_with_adaptive_speculation(reference):
    """EP 2, adaptive speculation under load, prefill chunks of 64: the requests are spread over two ranks, every
    expert's tokens come from both, and combine sums each token's expert outputs in rank order; the probe's
    completions land on either rank."""
    llm = deterministic_llm(expert_parallel_size=2, max_num_seqs=16, speculative_policy="adaptive", max_num_batched_tokens=64)
    try:
        assert run_in_crowd(llm, seed=2, size=15) == reference
    finally:
        llm.close()


def test_after_forced_preemption(reference):
    """Four probe sequences in a cache that cannot hold them all to the end: some are preempted and recomputed
    (their context prefilled again, where it was first computed step by step)."""
    kw = {"max_num_seqs": 4, "speculative_method": None}  # no drafts whose timing-driven verification moves the blocks
    plan = deterministic_llm(**kw).engine.runner.plan
    llm = deterministic_llm(**kw, kv_cache_memory=plan.bytes_per_slot * 4 + plan.bytes_per_block * 28)  # two sequences' worth
    assert run_alone(llm) == reference
    assert llm.get_metrics()["preemptions"] > 0


def test_default_mode_is_not_batch_invariant_and_flags_reach_the_config():
    """The mode is off by default (the kernels' fast paths); ``--deterministic`` sets it and an exact replay."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    cfg = load_config(engine_overrides(parser.parse_args(["--deterministic"])), env={})
    assert cfg.deterministic and cfg.swa_replay == "exact"
    assert not load_config({}, env={}).deterministic
    assert not LLM(backend="cpu", max_model_len=128, max_num_seqs=2).engine.runner.kernels.batch_invariant


@pytest.mark.parametrize("kw, message", [
    ({"swa_replay": "bounded"}, r"deterministic mode needs swa_replay='exact'.*drop swa_replay or set it to exact"),
    ({"eplb_interval": 8}, r"cannot re-place experts from measured load \(eplb_interval=8\).*set eplb_interval=0"),
])
def test_settings_that_break_the_promise_are_refused_in_one_line(kw, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config({"deterministic": True, **kw}, env={})
    assert "\n" not in str(err.value)


def test_kernels_without_batch_invariance_are_named_in_one_line():
    class NoInvariance(Kernels):
        def set_batch_invariant(self, enabled: bool) -> None:
            raise NotSupportedError("no deterministic reduction for sparse attention\non this device")

    selected = select_backend("cpu")
    selected.kernels = NoInvariance()
    with pytest.raises(ConfigError) as err:
        enable_batch_invariance(selected)
    msg = str(err.value)
    assert "backend 'cpu'" in msg and "--deterministic" in msg and "no deterministic reduction for sparse attention" in msg
    assert "\n" not in msg

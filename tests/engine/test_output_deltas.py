"""Deltas cut straight from the engine's requests: each carries only what its step added (so a streaming
server's per-step work does not grow with the reply), and the deltas add up to the engine's own output."""

from __future__ import annotations

import pickle

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.output_deltas import SentSoFar, apply_delta


@pytest.fixture(scope="module")
def engine():
    llm = LLM(backend="cpu", max_num_seqs=4, max_model_len=256, speculative_method="none")
    yield llm.engine
    llm.close()


def _drive(engine, prompts_params):
    """Step until every request ends; per request its deltas, and after each step the output rebuilt from its
    deltas next to the engine's snapshot."""
    reqs = [engine.add_request(p, sp) for p, sp in prompts_params]
    sent = {r.request_id: SentSoFar() for r in reqs}
    rebuilt = {r.request_id: None for r in reqs}
    deltas = {r.request_id: [] for r in reqs}
    pairs = []
    while engine.has_unfinished:
        for r in engine.step():
            d = engine.delta(r, sent[r.request_id])
            deltas[r.request_id].append(d)
            rebuilt[r.request_id] = out = apply_delta(rebuilt[r.request_id], d)
            ref = engine.output(r)
            pairs.append(([(c.text, list(c.token_ids), c.logprobs and list(c.logprobs), c.finish_reason) for c in out.outputs],
                          [(c.text, c.token_ids, c.logprobs, c.finish_reason) for c in ref.outputs]))
    engine.release([r.request_id for r in reqs])
    return reqs, deltas, pairs


def test_deltas_add_up_to_the_engines_output_at_every_step(engine):
    """Siblings (n=2) with log-probabilities, and a stop string cut off the text's end."""
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain, _, _ = _drive(engine, [("one two three four", greedy)])
    text = plain[0].output_text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # met half-way: the text already held back is cut
    reqs, deltas, pairs = _drive(engine, [
        ("the river and the stone", SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=12, logprobs=2, ignore_eos=True)),
        ("one two three four", SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True)),
    ])
    assert len(pairs) > 10
    for mine, ref in pairs:
        assert mine == ref
    for r in reqs:
        last = deltas[r.request_id][-1]
        assert last.finished and last.prompt_token_ids == r.prompt_token_ids.tolist() and last.engine_seconds > 0
        assert all(d.prompt_token_ids is None for d in deltas[r.request_id][:-1])  # the prompt goes once, at the end
    assert [c.finish_reason for c in reqs[1].siblings] == ["stop"] and reqs[1].stop_reason == stop


def test_a_delta_carries_only_what_its_step_added(engine):
    """One token a step (no speculation): every delta of a long reply holds one token and its text, and its
    message is no larger late in the reply than early on."""
    _, deltas, _ = _drive(engine, [("a b c", SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))])
    steps = [d for d in next(iter(deltas.values())) if d.completions[0].token_ids]
    assert len(steps) == 48 and all(len(d.completions[0].token_ids) == 1 for d in steps)
    starts = [d.completions[0].text_start for d in steps]
    assert starts == sorted(starts) and starts[-1] > 0  # each text piece begins where the last one ended
    sizes = [len(pickle.dumps(d)) for d in steps[:-1]]  # the finishing delta also carries the prompt's ids
    assert max(sizes[-10:]) < 2 * max(sizes[:10]), sizes

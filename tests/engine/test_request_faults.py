"""One request's excess or fault is its own: what a request multiplies is bounded (refused on arrival with
a one-line ``InvalidRequestError`` naming the field and the setting that raises it), and a fault while
serving one request fails it alone while the rest of the batch runs to the end unchanged."""

from __future__ import annotations

import pytest

from deepinfer.config import EngineConfig
from deepinfer.engine import Engine
from deepinfer.llm import LLM
from deepinfer.request import Request
from deepinfer.sampling_params import InvalidRequestError, SamplingParams
from tests.helpers.checkpoints import BOS_ID, make_tiny_checkpoint

PROMPT = [BOS_ID, 5, 17, 42, 9, 33]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "mixed")


def _config(ckpt, **kw) -> EngineConfig:
    return EngineConfig(model=str(ckpt), backend="cpu", kv_cache_memory=32 << 20, max_model_len=256, **kw)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(n=3), "n is 3 but at most 2 are allowed; lower n, or raise max_n (--max-n)"),
    (SamplingParams(logprobs=4), "logprobs is 4 but at most 3 are allowed; lower logprobs, or raise max_logprobs (--max-logprobs)"),
    (SamplingParams(prompt_logprobs=4), "prompt_logprobs is 4 but at most 3 are allowed"),
    (SamplingParams(stop=["x"] * 65), "stop has 65 stop strings but at most 64 are allowed; send fewer"),
    (SamplingParams(stop=["x" * 1025]), "stop has 1025 characters in a stop string but at most 1024 are allowed"),
    (SamplingParams(stop_token_ids=[7] * 1025), "stop_token_ids has 1025 stop token ids but at most 1024 are allowed"),
])
def test_bounds_refuse_offline_requests_alone(ckpt, params, message):
    llm = LLM(**_config(ckpt, max_n=2, max_logprobs=3).model_dump())
    bad, good = llm.generate([PROMPT, PROMPT], [params, SamplingParams(n=2, logprobs=3, temperature=0, max_tokens=4, ignore_eos=True)])
    assert bad.error.startswith(message) and bad.finished and not bad.outputs[0].token_ids
    assert good.error is None and [len(c.token_ids) for c in good.outputs] == [4, 4]


def test_max_n_defaults_to_max_num_seqs(ckpt):
    engine = Engine(_config(ckpt, max_num_seqs=4))
    assert engine.add_request(PROMPT, SamplingParams(n=5)).error == "n is 5 but at most 4 are allowed; lower n, or raise max_n (--max-n)"
    assert engine.add_request(PROMPT, SamplingParams(n=4)).error is None


@pytest.mark.parametrize("fields, field", [
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"), ({"top_k": 2**31}, "top_k"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0"), ({"temperature": float("inf")}, "temperature"), ({"top_p": float("nan")}, "top_p"),
])
def test_values_no_device_takes_are_refused_on_creation(fields, field):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**fields)
    assert caught.value.param == field and "\n" not in str(caught.value)


def test_the_largest_seed_serves_every_completion(ckpt):
    """Each completion's seed is the request's plus its index, wrapped to 64 bits: the top seed is served."""
    llm = LLM(**_config(ckpt).model_dump())
    sp = SamplingParams(n=3, seed=2**64 - 1, temperature=1.0, max_tokens=6, ignore_eos=True)
    a, b = llm.generate([PROMPT, PROMPT], [sp, sp])
    assert a.error is None and [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert all(len(c.token_ids) == 6 for c in a.outputs)


class _FaultyOutput(Engine):
    """An engine whose output handling fails for one request after its second token (a detokenizer fault)."""

    def _append(self, req: Request, token: int) -> None:
        if req.siblings[0].request_id == "bad" and len(req.output_token_ids) >= 2:
            raise RuntimeError("the detokenizer broke")
        super()._append(req, token)


def _run(engine: Engine) -> None:
    for _ in range(200):
        if not engine.has_unfinished:
            return
        engine.step()
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("overlap", [False, True])
def test_a_fault_in_one_requests_output_fails_it_alone(ckpt, overlap):
    alone = Engine(_config(ckpt))
    expected = alone.add_request(PROMPT, GREEDY, request_id="good")
    _run(alone)
    engine = _FaultyOutput(_config(ckpt, overlap_scheduling=overlap))
    good = engine.add_request(PROMPT, GREEDY, request_id="good")
    bad = engine.add_request(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True), request_id="bad")
    _run(engine)
    out = engine.output(bad)
    assert out.finished and out.internal_error
    assert out.error == "internal error while processing the request's output: RuntimeError: the detokenizer broke"
    assert engine.output(good).outputs[0].token_ids == alone.output(expected).outputs[0].token_ids
    engine.release(["good", "bad"])
    assert not engine.requests and engine.load().num_used_blocks == 0
    again = engine.add_request(PROMPT, GREEDY, request_id="after")
    _run(engine)
    assert engine.output(again).outputs[0].token_ids == alone.output(expected).outputs[0].token_ids


def test_chat_bounds_messages_and_tools(ckpt):
    llm = LLM(**_config(ckpt).model_dump())
    with pytest.raises(InvalidRequestError, match="^messages has 4097 messages but at most 4096 are allowed; send fewer$"):
        llm.chat([{"role": "user", "content": "hi"}] * 4097)
    with pytest.raises(InvalidRequestError, match="^tools has 257 tools but at most 256 are allowed; send fewer$"):
        llm.chat([{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "f"}}] * 257)


def test_a_request_waits_while_held_states_fill_the_slots(ckpt):
    """A prefill engine whose every slot holds a state for a decode server makes the next request wait for
    one to be released, never fails it with a cache-size error."""
    engine = Engine(_config(ckpt, max_num_seqs=2))
    held = [engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1), request_id=f"held{i}", hold_kv=True)
            for i in range(2)]
    _run(engine)
    assert all(engine.output(r).error is None for r in held) and len(engine.kv.held) == 2
    waiting = engine.add_request(PROMPT, GREEDY, request_id="waits")
    for _ in range(5):
        engine.step()
    assert engine.output(waiting).error is None and not engine.output(waiting).finished
    engine.release_prefilled("held0")
    _run(engine)
    out = engine.output(waiting)
    assert out.error is None and len(out.outputs[0].token_ids) == GREEDY.max_tokens

"""`deepinfer serve` against the offline engine: the same tokens through HTTP, streamed or not, and the
OpenAI fields (n, stop, logprobs, JSON schema, reasoning, tool calls) a real client reads."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from openai import OpenAI

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from tests.helpers.servers import running_server

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def read_file(path):", "The capital of France is", "import numpy as np\n"]
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a haiku about tea."}]


@pytest.fixture(scope="module")
def server():
    with running_server([]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(backend="cpu")


def test_greedy_completions_equal_llm_generate(client, llm):
    expected = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    got = client.completions.create(model="tiny-v4", prompt=PROMPTS, max_tokens=24, temperature=0.0, logprobs=0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for choice, out in zip(got.choices, expected):
        assert choice.text == out.outputs[0].text
        assert choice.finish_reason == out.outputs[0].finish_reason
        assert len(choice.logprobs.tokens) == len(out.outputs[0].token_ids)
    assert got.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in expected)
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)


def test_seeded_sampling_through_the_server_equals_llm_generate(client, llm):
    """A seeded request's tokens are a function of its seed, prompt and position alone: the server (its own
    batch, speculation and timing) gives what ``LLM.generate`` gives, every completion, streamed too."""
    sp = SamplingParams(n=3, temperature=0.8, seed=2**63 + 5, max_tokens=24, ignore_eos=True)
    expected = [[c.text for c in o.outputs] for o in llm.generate(PROMPTS, sp)]
    got = client.completions.create(model="tiny-v4", prompt=PROMPTS, n=3, temperature=0.8, seed=2**63 + 5, max_tokens=24,
                                    extra_body={"ignore_eos": True})
    assert [[c.text for c in got.choices[i * 3:(i + 1) * 3]] for i in range(len(PROMPTS))] == expected
    streamed = [""] * 3
    for chunk in client.completions.create(model="tiny-v4", prompt=PROMPTS[0], n=3, temperature=0.8, seed=2**63 + 5,
                                           max_tokens=24, extra_body={"ignore_eos": True}, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == expected[0]


def test_token_id_prompt_and_echo(client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[0]).ids
    expected = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12))[0]
    got = client.completions.create(model="tiny-v4", prompt=ids, max_tokens=12, temperature=0.0, echo=True)
    prompt_text = llm.get_tokenizer().decode(ids, skip_special_tokens=False)
    assert got.choices[0].text == prompt_text + expected.outputs[0].text


def test_greedy_chat_equals_llm_chat(client, llm):
    expected = llm.chat(CONVERSATION, SamplingParams(temperature=0.0, max_tokens=24))[0]
    got = client.chat.completions.create(model="tiny-v4", messages=CONVERSATION, max_completion_tokens=24, temperature=0.0)
    assert got.choices[0].message.content == expected.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_deltas_concatenate_to_the_whole(client):
    whole = client.completions.create(model="tiny-v4", prompt=PROMPTS[1], max_tokens=40, temperature=0.0)
    chunks = list(client.completions.create(model="tiny-v4", prompt=PROMPTS[1], max_tokens=40, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat_whole = client.chat.completions.create(model="tiny-v4", messages=CONVERSATION, max_tokens=40, temperature=0.0)
    chat_chunks = list(client.chat.completions.create(model="tiny-v4", messages=CONVERSATION, max_tokens=40, temperature=0.0, stream=True))
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == chat_whole.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == chat_whole.choices[0].finish_reason


def test_stop_strings_and_stop_token_ids(client, llm):
    free = client.completions.create(model="tiny-v4", prompt=PROMPTS[0], max_tokens=30, temperature=0.0)
    text = free.choices[0].text
    stop = text[8:11]
    cut = client.completions.create(model="tiny-v4", prompt=PROMPTS[0], max_tokens=30, temperature=0.0, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny-v4", prompt=PROMPTS[0], max_tokens=30, temperature=0.0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    ids = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0].token_ids
    by_id = client.completions.create(model="tiny-v4", prompt=PROMPTS[0], max_tokens=30, temperature=0.0, extra_body={"stop_token_ids": [ids[3]]})
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == ids.index(ids[3]) + 1


def test_n_completions(client, llm):
    """``n`` completions of one prompt: indices 0..n-1, greedy ones all equal to the engine's; sampled ones
    (seeded sampling under adaptive speculation depends on which drafts a step verifies, so only their
    shape is checked) each finish, in streams too."""
    greedy = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0].text
    got = client.completions.create(model="tiny-v4", prompt=[PROMPTS[2], PROMPTS[0]], n=2, temperature=0.0, max_tokens=16)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert got.choices[0].text == got.choices[1].text == greedy
    sampled = client.completions.create(model="tiny-v4", prompt=PROMPTS[2], n=3, temperature=1.0, seed=7, max_tokens=16, logprobs=0)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2]
    assert sampled.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in sampled.choices)
    streamed = client.chat.completions.create(model="tiny-v4", messages=CONVERSATION, n=2, temperature=1.0, seed=3, max_tokens=12,
                                              stream=True, stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    finished = set()
    usage = None
    for chunk in streamed:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and all(texts.values())
    assert usage.completion_tokens <= 24


def test_logprobs_match_the_engine(client, llm):
    expected = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3))[0].outputs[0]
    got = client.completions.create(model="tiny-v4", prompt=PROMPTS[0], max_tokens=8, temperature=0.0, logprobs=3).choices[0].logprobs
    for tok, lp, pos, top in zip(expected.token_ids, got.token_logprobs, expected.logprobs, got.top_logprobs):
        assert lp == pytest.approx(pos[tok].logprob, abs=1e-4)
        assert len(top) == 3
        assert max(top.values()) == pytest.approx(max(v.logprob for v in pos.values()), abs=1e-4)
    chat = client.chat.completions.create(model="tiny-v4", messages=CONVERSATION, max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4) for e in content)  # greedy picks the top token


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_json_schema_response_format(client, llm):
    got = client.chat.completions.create(
        model="tiny-v4", messages=CONVERSATION, max_tokens=60, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    value = json.loads(got.choices[0].message.content)
    jsonschema.validate(value, SCHEMA)
    expected = llm.chat(CONVERSATION, SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)))[0]
    assert got.choices[0].message.content == expected.outputs[0].text
    anything = client.completions.create(model="tiny-v4", prompt=PROMPTS[0], max_tokens=300, temperature=0.0,
                                         extra_body={"response_format": {"type": "json_object"}})
    text = anything.choices[0].text
    assert text.startswith("{") and (anything.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    choice = client.completions.create(model="tiny-v4", prompt=PROMPTS[0], max_tokens=10, temperature=0.0,
                                       extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert choice.choices[0].text in ("alpha", "beta")


THINKING = r"[a-z]{2,10}( [a-z]{2,10}){1,4}</think>[A-Z][a-z]{2,10}( [a-z]{2,10}){0,3}\."


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_separated_from_content(client, llm, stream):
    kwargs = dict(model="tiny-v4", messages=CONVERSATION, max_tokens=80, temperature=0.0,
                  extra_body={"chat_template_kwargs": {"thinking": True}, "structured_outputs": {"regex": THINKING}})
    text = llm.chat(CONVERSATION, SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(regex=THINKING)),
                    thinking=True)[0].outputs[0].text
    reasoning, content = text.split("</think>")
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        got_reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
        got_content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        got_reasoning, got_content = message.reasoning_content, message.content
    assert (got_reasoning, got_content) == (reasoning, content)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}"\}\}</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_parsed(client, stream):
    kwargs = dict(model="tiny-v4", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, max_tokens=200,
                  temperature=0.0, extra_body={"structured_outputs": {"regex": CALL}})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert deltas and deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
        arguments = "".join(t.function.arguments or "" for t in deltas)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.type == "function"
        arguments, finish, content = call.function.arguments, choice.finish_reason, choice.message.content or ""
    assert re.fullmatch(r"[A-Z][a-z]{2,8}", json.loads(arguments)["city"])
    assert finish == "tool_calls"
    assert "<tool_call>" not in content


def test_tool_messages_rendered_like_llm_chat(server, llm):
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                              "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    got = httpx.post(server.url + "/tokenize", json={"messages": history}, timeout=60).json()
    assert got["tokens"] == llm.format_chat(history)[0].token_ids
    assert "sunny, 21 C" in llm.format_chat(history)[0].text


def test_models_tokenize_detokenize_info_load(server, llm):
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "tiny-v4" and models["data"][0]["owned_by"] == "deepinfer"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPTS[0]}, timeout=30).json()["tokens"]
    assert ids == llm.get_tokenizer().encode(PROMPTS[0]).ids
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert text == llm.get_tokenizer().decode(ids, skip_special_tokens=False)
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert info["max_model_len"] == llm.engine.max_model_len and info["engine_config"]["max_num_seqs"] == 64
    load = httpx.get(server.url + "/get_load", timeout=30).json()
    assert set(load[0]) >= {"num_tokens", "num_reqs"}
    flushed = httpx.post(server.url + "/flush_cache", timeout=30)
    assert flushed.status_code == 200 and flushed.json()["success"] is True


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_concurrent_streaming_clients_form_batches(server):
    """32 streaming clients at once: every one finishes with its full output, and the engine ran them in batches."""
    peak = 0.0

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        body = {"model": "tiny-v4", "prompt": f"{PROMPTS[i % 3]} #{i}", "max_tokens": 48, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        usage, finish = 0, None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
                    for c in chunk["choices"]:
                        finish = c["finish_reason"] or finish
        return usage, finish

    async def watch(http: httpx.AsyncClient, done: asyncio.Event) -> None:
        nonlocal peak
        while not done.is_set():
            text = (await http.get("/metrics")).text
            peak = max(peak, _metric(text, 'deepinfer:num_requests_running'))
            await asyncio.sleep(0.05)

    async def main() -> list[tuple[int, str | None]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=httpx.Limits(max_connections=64)) as http:
            done = asyncio.Event()
            watcher = asyncio.create_task(watch(http, done))
            results = await asyncio.gather(*(one(http, i) for i in range(32)))
            done.set()
            await watcher
            return results

    results = asyncio.run(main())
    assert results == [(48, "length")] * 32
    assert peak > 1
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert _metric(text, "deepinfer:time_to_first_token_seconds_count") >= 32
    assert _metric(text, "deepinfer:generation_tokens_total") >= 32 * 48
    assert _metric(text, "deepinfer:inter_token_latency_seconds_count") > 0


def test_metrics_break_a_request_down(client, server):
    """``/metrics`` says where requests' time went: the server before the engine, the engine's queue, the engine,
    and the server after it, for streamed and whole responses alike."""
    before = httpx.get(server.url + "/metrics", timeout=30).text
    names = ["deepinfer:request_preprocess_time_seconds", "deepinfer:request_queue_time_seconds",
             "deepinfer:request_engine_time_seconds", "deepinfer:request_postprocess_time_seconds"]
    counts = {n: _metric(before, n + "_count") for n in names}
    client.completions.create(model="tiny-v4", prompt=PROMPTS[0], max_tokens=8, temperature=0.0)
    for _ in client.chat.completions.create(model="tiny-v4", messages=CONVERSATION, max_completion_tokens=8, stream=True):
        pass
    after = httpx.get(server.url + "/metrics", timeout=30).text
    for n in names:
        assert _metric(after, n + "_count") == counts[n] + 2, n
    e2e = _metric(after, "deepinfer:e2e_request_latency_seconds_sum") - _metric(before, "deepinfer:e2e_request_latency_seconds_sum")
    engine = _metric(after, "deepinfer:request_engine_time_seconds_sum") - _metric(before, "deepinfer:request_engine_time_seconds_sum")
    assert 0 < engine <= e2e + 0.05  # the engine's share of a request's time is part of it

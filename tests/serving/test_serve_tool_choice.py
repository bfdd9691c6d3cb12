"""Forced tool calls and the thinking budget through ``deepinfer serve`` on the bundled model (hermes format),
against ``LLM.chat`` on the same conversation: calls that parse and validate, streamed deltas that reassemble
to the same calls, ``tool_choice`` errors naming the field, reasoning closed after its budget."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from deepinfer import LLM, SamplingParams
from deepinfer.serve.chat_parsing import parse_chat_output
from tests.helpers.servers import running_server

pytestmark = pytest.mark.usefixtures("one_thread")

WEATHER = {"type": "object", "properties": {  # short names: the tiny model spells forced text a character a token
    "u": {"type": "string", "enum": ["c", "f"]},
    "t": {"type": "object", "properties": {"d": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["d"]},
}, "required": ["u", "t"]}
PING = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
TOOLS = [{"type": "function", "function": {"name": "wx", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": PING}}]
SCHEMAS = {"wx": WEATHER, "ping": PING}
CONVERSATION = [{"role": "user", "content": "Weather in Oslo?"}]
NAMED = {"type": "function", "function": {"name": "wx"}}


@pytest.fixture(scope="module")
def server():
    with running_server([]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(backend="cpu")


def _calls(tool_calls) -> list[tuple[str, dict]]:
    out = [(t.function.name, json.loads(t.function.arguments)) for t in tool_calls or []]
    for name, args in out:
        jsonschema.validate(args, SCHEMAS[name])
    return out


def _streamed_calls(chunks) -> list[tuple[str, dict]]:
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for t in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(t.index, ["", ""])
            entry[0] += t.function.name or ""
            entry[1] += t.function.arguments or ""
    return [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]


@pytest.mark.parametrize("choice,parallel,thinking,stream", [(NAMED, False, True, True), ("required", True, False, False)])
def test_forced_calls_validate_and_equal_llm_chat(client, llm, choice, parallel, thinking, stream):
    """A named call after a budgeted reasoning (one call, streamed), and required calls (one or more): every
    call parses and validates, and ``LLM.chat`` writes the same reply (streamed deltas reassembled)."""
    budget = 3 if thinking else None
    offline = llm.chat(CONVERSATION, SamplingParams(temperature=0.0, max_tokens=90, thinking_budget=budget), tools=TOOLS,
                       tool_choice=choice, parallel_tool_calls=parallel, thinking=thinking)[0].outputs[0]
    parsed = parse_chat_output("", offline.text, tool_parser="hermes")
    expected = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    kwargs = dict(model="tiny-v4", messages=CONVERSATION, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                  max_tokens=90, temperature=0.0,
                  extra_body={"chat_template_kwargs": {"thinking": thinking}, "thinking_token_budget": budget})
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        calls = _streamed_calls(chunks)
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    else:
        got = client.chat.completions.create(**kwargs).choices[0]
        calls, reasoning, content, finish = _calls(got.message.tool_calls), None, got.message.content, [got.finish_reason]
    assert calls and calls == expected
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])
        assert name == "wx" or isinstance(choice, str)
    if not parallel:
        assert len(calls) == 1 and finish == ["tool_calls"] and not content
    if thinking:
        end = llm.get_tokenizer().encode("</think>", add_special_tokens=False).ids
        closed = next(i for i in range(len(offline.token_ids)) if offline.token_ids[i:i + len(end)] == end)
        assert closed <= budget and reasoning == offline.text.split("</think>")[0]


def test_tool_choice_none_never_calls(client):
    """With ``none`` call markup the model writes stays content."""
    markup = r'<tool_call>\{"name": "ping", "arguments": \{"n": [0-9]\}\}</tool_call>'
    got = client.chat.completions.create(model="tiny-v4", messages=CONVERSATION, tools=TOOLS, tool_choice="none", max_tokens=64,
                                         temperature=0.0, extra_body={"structured_outputs": {"regex": markup}}).choices[0]
    assert not got.message.tool_calls and got.message.content.startswith("<tool_call>") and got.finish_reason == "stop"


BAD_TOOL = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "foo"}}}}}]


@pytest.mark.parametrize("body,problem,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "names the function 'nope'", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "names no function", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "is not one of", "tool_choice"),
    ({"tool_choice": "required"}, "declares no tools", "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined with response_format",
     "tool_choice"),
    ({"tools": BAD_TOOL, "tool_choice": "required"}, 'Unsupported type "foo"', "tools"),
    ({"thinking_token_budget": 4, "chat_template_kwargs": {"thinking_budget": 5}}, "disagree", "chat_template_kwargs.thinking_budget"),
])
def test_bad_tool_choice_is_a_400_naming_it(server, body, problem, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": CONVERSATION, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert problem in error["message"] and "\n" not in error["message"] and error["param"] == param


def test_thinking_budget_closes_reasoning_with_and_without_speculation(client, llm):
    """Reasoning stops after the budget and the answer follows; the server (speculating), ``LLM.chat`` and an
    engine that does not speculate write the same reply."""
    budget, sp = 4, SamplingParams(temperature=0.0, max_tokens=16, thinking_budget=4)
    plain = LLM(backend="cpu", speculative_method=None)
    expected = [o.outputs[0] for o in (llm.chat(CONVERSATION, sp, thinking=True)[0], plain.chat(CONVERSATION, sp, thinking=True)[0])]
    assert expected[0].text == expected[1].text
    reasoning, answer = expected[0].text.split("</think>", 1)
    end = llm.get_tokenizer().encode("</think>", add_special_tokens=False).ids
    assert expected[0].token_ids[budget:budget + len(end)] == end and answer
    for c in llm.chat(CONVERSATION, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=9, thinking_budget=2), thinking=True)[0].outputs:
        assert any(c.token_ids[i:i + len(end)] == end for i in range(3)), c.text  # each sample closes by its own budget
    kwargs = dict(model="tiny-v4", messages=CONVERSATION, max_tokens=16, temperature=0.0,
                  extra_body={"chat_template_kwargs": {"thinking": True, "thinking_budget": budget}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, answer)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices) == reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer

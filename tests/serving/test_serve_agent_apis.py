"""`POST /v1/responses` and `POST /v1/messages` driven by the real `openai`, `anthropic` and `openai-agents`
clients against one server: greedy replies equal `LLM.chat` on the same conversation, streamed events add up
to the whole reply, forced tool calls parse and validate, and every bad value gets that API's error shape."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI
from pydantic import BaseModel

from deepinfer import LLM, SamplingParams
from tests.helpers.servers import running_server

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "agent-apis-key"
SYSTEM = "Be brief."
QUESTION = "Write a haiku about tea."
#: the arguments' schema, as the Agents SDK writes it for ``get_weather`` below (one grammar, compiled once, serves both)
CITY = {"properties": {"city": {"enum": ["Paris", "Rome"], "title": "City", "type": "string"}}, "required": ["city"],
        "title": "get_weather_args", "type": "object", "additionalProperties": False}
#: a forced call's markup is spelled a character a token by the bundled model: room for one call
CALL_TOKENS = 120


@pytest.fixture(scope="module")
def server():
    with running_server(["--api-key", KEY]) as srv:
        yield srv


@pytest.fixture(scope="module")
def openai_client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(backend="cpu")


def _expected(llm: LLM, messages: list[dict], max_tokens: int, **kwargs) -> str:
    return llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs.pop("params", {})), **kwargs)[0].outputs[0].text


def test_responses_greedy_streamed_and_stored(openai_client, llm):
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    expected = _expected(llm, conversation, 12)
    whole = openai_client.responses.create(model="tiny-v4", instructions=SYSTEM, max_output_tokens=12, temperature=0.0,
                                           input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert whole.output_text == expected
    assert (whole.status, whole.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (whole.usage.output_tokens, whole.usage.input_tokens) == (12, len(llm.format_chat(conversation)[0].token_ids))

    events = list(openai_client.responses.create(model="tiny-v4", instructions=SYSTEM, input=QUESTION, max_output_tokens=12,
                                                 temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected
    stop = expected.strip()[2:5]  # the engine's own field, as vLLM takes it
    stopped = openai_client.responses.create(model="tiny-v4", instructions=SYSTEM, input=QUESTION, max_output_tokens=12, temperature=0.0,
                                             store=False, extra_body={"stop": [stop]})
    assert (stopped.output_text, stopped.status) == (expected[: expected.index(stop)], "completed")

    # stored: retrieved by id, and continued with previous_response_id as the whole conversation would be
    assert openai_client.responses.retrieve(whole.id).output_text == expected
    follow = openai_client.responses.create(model="tiny-v4", previous_response_id=whole.id, input="Another.", max_output_tokens=8,
                                            temperature=0.0)
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": expected}, {"role": "user", "content": "Another."}]
    assert follow.output_text == _expected(llm, history, 8)
    with pytest.raises(BadRequestError) as refused:
        openai_client.responses.create(model="tiny-v4", previous_response_id="resp_unknown", input="x", max_output_tokens=4)
    assert refused.value.body["param"] == "previous_response_id"


def test_responses_reasoning(openai_client, llm):
    expected = _expected(llm, [{"role": "user", "content": QUESTION}], 10, thinking=True)
    got = openai_client.responses.create(model="tiny-v4", input=QUESTION, reasoning={"effort": "high"}, max_output_tokens=10, temperature=0.0)
    (item,) = [o for o in got.output if o.type == "reasoning"]
    assert item.content[0].text == expected.split("</think>")[0]
    assert got.usage.output_tokens_details.reasoning_tokens > 0


def test_messages_greedy_streamed_and_counted(claude, llm):
    conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    expected = _expected(llm, conversation, 12)
    args = dict(model="tiny-v4", max_tokens=12, system=[{"type": "text", "text": SYSTEM}],
                messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0.0})
    whole = claude.messages.create(**args)
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == expected
    assert (whole.stop_reason, whole.usage.output_tokens) == ("max_tokens", 12)
    with claude.messages.stream(**args) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == expected and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    counted = claude.messages.count_tokens(model="tiny-v4", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens == whole.usage.input_tokens == len(llm.format_chat(conversation)[0].token_ids)

    stop = expected.strip()[2:5]
    stopped = claude.messages.create(**{**args, "stop_sequences": [stop]})
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == expected[: expected.index(stop)]


def test_messages_tool_use_thinking_and_tool_results(claude, llm):
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": CITY}]
    with claude.messages.stream(model="tiny-v4", max_tokens=CALL_TOKENS, tools=tools, messages=[{"role": "user", "content": "Weather?"}],
                                tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                                extra_body={"temperature": 0.0}) as stream:
        partial = "".join(e.delta.partial_json for e in stream if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        message = stream.get_final_message()
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert (use.name, message.stop_reason) == ("get_weather", "tool_use")
    jsonschema.validate(use.input, CITY)
    assert json.loads(partial) == use.input

    # the call answered, with thinking on and a budget the engine enforces
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": "get_weather", "input": use.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    got = claude.messages.create(model="tiny-v4", max_tokens=12, messages=history, thinking={"type": "enabled", "budget_tokens": 4},
                                 extra_body={"temperature": 0.0})
    chat_history = [history[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]
    expected = _expected(llm, chat_history, 12, thinking=True, params={"thinking_budget": 4})
    thought, _, answer = expected.partition("</think>")
    assert [b.type for b in got.content][:1] == ["thinking"] and got.content[0].thinking == thought
    assert "".join(b.text for b in got.content if b.type == "text") == answer


class Verdict(BaseModel):
    verdict: Literal["sunny", "rainy"]


def test_openai_agents_two_turn_loop(server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], output_type=Verdict,
                  model=OpenAIResponsesModel(model="tiny-v4", openai_client=client),
                  model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, temperature=0.0, max_tokens=CALL_TOKENS))

    async def run() -> tuple[object, list[str]]:
        streamed = Runner.run_streamed(agent, "Weather in Paris?", max_turns=3)
        kinds = [e.data.type async for e in streamed.stream_events() if e.type == "raw_response_event"]
        return streamed, kinds

    result, kinds = asyncio.run(run())
    # the first turn forced a call (its arguments streamed), the tool's result went back, the second turn answered
    assert len(asked) == 1 and asked[0] in ("Paris", "Rome")
    assert "response.function_call_arguments.delta" in kinds and kinds.count("response.completed") == 2
    assert isinstance(result.final_output, Verdict) and len(result.raw_responses) == 2
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    call = result.raw_responses[0].output[0]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": asked[0]}


RESPONSES_BAD = [
    ({"input": [{"type": "file_search_call"}]}, "input", "file_search_call"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "allowed_tools"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {}}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", "g"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format", "schema"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "extreme"),
    ({"input": "x", "max_output_tokens": 100000}, "max_output_tokens", "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature", "2"),
    ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"input": [{"role": "user", "content": "x"}] * 5000}, "input", "4096"),
    ({"input": "x", "stop": ["s"] * 100}, "stop", "64"),
]

MESSAGES_BAD = [
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "'system'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "source"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]}, 400, "client tool"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}}, 400, "name"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}}, 400, "tool_choice"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 8}}, 400, "budget_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled"}}, 400, "budget_tokens"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, 400, "temperature"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["s"] * 100}, 400, "stop_sequences"),
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ({"max_tokens": 100000, "messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens"),
    ({"max_tokens": 4, "model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "other"),
]


def test_bad_values_get_each_apis_error_shape(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, param, words in RESPONSES_BAD:
            r = http.post("/v1/responses", json=body, headers=auth)
            error = r.json()["error"]
            assert (r.status_code, error["type"], error["param"]) == (400, "invalid_request_error", param), (body, error)
            assert words in error["message"] and "\n" not in error["message"]
        for body, status, words in MESSAGES_BAD:
            r = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
            error = r.json()
            expected_type = "not_found_error" if status == 404 else "invalid_request_error"
            assert (r.status_code, error["type"], error["error"]["type"]) == (status, "error", expected_type), (body, error)
            assert words in error["error"]["message"] and "\n" not in error["error"]["message"]
        unauthorized = http.post("/v1/messages", json=MESSAGES_BAD[0][0], headers={"x-api-key": "wrong"})
        assert (unauthorized.status_code, unauthorized.json()["error"]["type"]) == (401, "authentication_error")
        assert http.get("/v1/responses/resp_unknown", headers=auth).status_code == 404
        paths = http.get("/openapi.json", headers=auth).json()["paths"]
        assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/messages", "/v1/messages/count_tokens"} <= set(paths)

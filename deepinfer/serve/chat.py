"""``POST /v1/chat/completions``: the conversation in the model's chat format, the reply split into
reasoning, content and tool calls (in streaming deltas too)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from ..chat import ChatPrompt, format_chat
from ..errors import ChatFormatError
from ..image_input import ImageInputError, load_images
from ..sampling_params import InvalidRequestError
from .async_engine import RequestStream
from .chat_parsing import ChatDelta, ChatOutputParser, ParsedChat, parse_chat_output
from .bootstrap import post_when_done, room_of
from .deltas import CompletionCursor, chat_logprobs, decoder, usage
from .errors import error_for, guarded
from .params import constraint_field, sampling_params, served_max_tokens
from .protocol import ChatCompletionRequest
from .state import ServerState
from .streaming import DONE, admit, check_output, final_outputs, merged, release, sse


def render(body: ChatCompletionRequest, state: ServerState) -> ChatPrompt:
    """The prompt text, token ids and images (not yet decoded) of the request's conversation."""
    if state.chat_format is None:
        raise ChatFormatError(state.chat_format_error or "this model has no chat format; start the server with --chat-template FILE")
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
    tools = body.tools if body.tools else None
    try:
        prompt = format_chat(
            state.chat_format, state.tokenizer, body.messages, tools=tools, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, kwargs=kwargs, image_placeholder=state.image_placeholder,
        )[0]
    except ChatFormatError as exc:
        raise InvalidRequestError(str(exc), _chat_field(str(exc), body)) from None
    return prompt


async def engine_prompt(prompt: ChatPrompt, state: ServerState) -> tuple[list[int] | dict[str, Any], int]:
    """What the engine takes for ``prompt``: its images decoded off the event loop (a bad one is a 400 naming
    ``messages``), and the prompt's length once each placeholder is its image's span; a model that reads no
    images gets them as they came, and refuses them."""
    length = len(prompt.token_ids)
    if prompt.images and state.image_reader is not None:
        try:
            images = await asyncio.to_thread(load_images, prompt.images, state.image_limits)
            length += sum(state.image_reader.span_length(image) - 1 for image in images)
        except ImageInputError as exc:
            raise InvalidRequestError(str(exc), "messages") from None
        prompt = dataclasses.replace(prompt, images=tuple(images))
    return prompt.engine_prompt(), length


def _chat_field(message: str, body: ChatCompletionRequest) -> str:
    """The request field a chat-format error is about."""
    if body.tools and "tool declarations" in message:
        return "tools"
    if "chat_template_kwargs" in message:
        return "chat_template_kwargs"
    if "reasoning_effort" in message:
        return "reasoning_effort"
    return "messages"


def _tool_parser(body: ChatCompletionRequest, state: ServerState) -> str | None:
    """The tool-call format parsed from the reply: only when tools are declared and may be called."""
    choice = body.tool_choice
    if not body.tools or choice == "none":
        return None
    if choice not in (None, "auto"):
        raise InvalidRequestError(
            f"tool_choice {choice!r} is not supported: the model decides when to call (use 'auto' or 'none')", "tool_choice"
        )
    return state.tool_call_parser


async def create_chat_completion(body: ChatCompletionRequest, state: ServerState, http: HTTPRequest):
    received = time.monotonic()
    model = state.model_name(body.model)
    tool_parser = _tool_parser(body, state)
    prompt = render(body, state)
    text, ids = prompt.text, prompt.token_ids
    engine_input, n_prompt = await engine_prompt(prompt, state)
    state.check_prompt(ids, "messages", n_prompt - len(ids))
    hold_kv, transfer = await state.transfer(body, 1)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    requested = 1 if hold_kv else requested  # a prefill server samples the first token; the decode server the rest
    top = (body.top_logprobs or 0) if body.logprobs else None
    named = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    params = sampling_params(body, state.limits, max_tokens=served_max_tokens(requested, n_prompt, state.max_model_len, named), logprobs=top)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stream = state.engine.submit(rid, engine_input, params, n_prompt, hold_kv=hold_kv, kv_transfer_params=transfer, received=received)
    room = room_of(body)
    if hold_kv and room is not None and state.rooms is not None:
        post_when_done(state.rooms, room, stream)
    await admit(state.engine, [stream], state.metrics, constraint_field(body) or ("messages" if prompt.images else None))
    created = int(time.time())
    if body.stream:
        return StreamingResponse(guarded(_stream(body, state, rid, model, created, text, n_prompt, stream, tool_parser)),
                                 media_type="text/event-stream")
    out = (await final_outputs(state.engine, [stream], http, state.metrics))[0]
    built = time.monotonic()
    choices = []
    for c in out.outputs:
        parsed = parse_chat_output(text, c.text, reasoning=state.reasoning_parser, tool_parser=tool_parser)
        message = _message(parsed, body.include_reasoning)
        choices.append({
            "index": c.index, "message": message,
            "logprobs": {"content": chat_logprobs(c.token_ids, c.logprobs, top, decoder(state.tokenizer))} if top is not None and c.logprobs is not None else None,
            "finish_reason": _finish_reason(c.finish_reason, parsed.tool_calls),
            "stop_reason": c.stop_reason,
        })
    counts = usage(n_prompt, sum(len(c.token_ids) for c in out.outputs))
    response = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices, "usage": counts}
    if hold_kv:
        response["kv_transfer_params"] = out.extra.get("kv_transfer_params")
    reply = JSONResponse(response)
    state.metrics.observe_postprocess(time.monotonic() - built)
    return reply


def _message(parsed: ParsedChat, include_reasoning: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content if parsed.content or not parsed.tool_calls else None}
    if parsed.content is None and not parsed.tool_calls:
        message["content"] = ""
    if include_reasoning and parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}} for t in parsed.tool_calls
        ]
    return message


def _finish_reason(reason: str | None, tool_calls: list) -> str | None:
    return "tool_calls" if tool_calls and reason == "stop" else reason




def _delta_fields(d: ChatDelta, include_reasoning: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if d.reasoning and include_reasoning:
        out["reasoning_content"] = d.reasoning
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        calls = []
        for t in d.tool_calls:
            call: dict[str, Any] = {"index": t.index}
            if t.id is not None:
                call.update(id=t.id, type="function")
            fn: dict[str, Any] = {"arguments": t.arguments}
            if t.name is not None:
                fn["name"] = t.name
            call["function"] = fn
            calls.append(call)
        out["tool_calls"] = calls
    return out


async def _stream(body: ChatCompletionRequest, state: ServerState, rid: str, model: str, created: int, prompt_text: str,
                  num_prompt_tokens: int, stream: RequestStream, tool_parser: str | None) -> AsyncIterator[bytes]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    top = (body.top_logprobs or 0) if body.logprobs else None
    cursors: list[CompletionCursor] = []
    parsers: list[ChatOutputParser] = []
    called: list[bool] = []
    completion_tokens = 0
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    try:
        for j in range(body.n):
            yield sse({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        async for _, out in merged([stream]):
            began = time.monotonic()
            try:
                out = check_output(stream, out)
            except Exception as exc:  # noqa: BLE001 - the status line is sent: the failure goes in the stream
                yield sse(error_for(exc)[1])
                continue
            if not cursors:
                cursors = [CompletionCursor(stop) for _ in out.outputs]
                parsers = [ChatOutputParser(prompt_text, reasoning=state.reasoning_parser, tool_parser=tool_parser) for _ in out.outputs]
                called = [False] * len(out.outputs)
            choices = []
            for c, cursor, parser in zip(out.outputs, cursors, parsers):
                delta = cursor.advance(c)
                if delta is None:
                    continue
                completion_tokens += len(delta.token_ids)
                parsed = parser.feed(delta.text)
                if delta.finish_reason is not None:
                    tail = parser.finish()
                    parsed = ChatDelta(parsed.reasoning + tail.reasoning, parsed.content + tail.content, parsed.tool_calls + tail.tool_calls)
                called[c.index] = called[c.index] or bool(parsed.tool_calls)
                fields = _delta_fields(parsed, body.include_reasoning)
                lp = None
                if top is not None and delta.logprobs is not None and delta.token_ids:
                    lp = {"content": chat_logprobs(delta.token_ids, delta.logprobs, top, decoder(state.tokenizer))}
                if not fields and lp is None and delta.finish_reason is None:
                    continue
                finish = _finish_reason(delta.finish_reason, [True] if called[c.index] else [])
                choices.append({"index": c.index, "delta": fields, "logprobs": lp, "finish_reason": finish})
            stream.timing.postprocess += time.monotonic() - began
            if choices:
                yield sse({**head, "choices": choices})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(num_prompt_tokens, completion_tokens)})
        yield DONE
    finally:
        release(state.engine, [stream], state.metrics)

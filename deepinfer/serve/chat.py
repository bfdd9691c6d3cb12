"""``POST /v1/chat/completions``: the conversation pipeline (``conversation``) in OpenAI's Chat Completions
shape: the reply's reasoning, content and tool calls as a message, or as streamed deltas."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from .chat_parsing import ChatDelta, ParsedChat
from .conversation import Turn, close, replies, streamed, submit
from .deltas import chat_logprobs, decoder, usage
from .errors import error_for, guarded
from .protocol import ChatCompletionRequest
from .state import ServerState
from .streaming import DONE, sse


async def create_chat_completion(body: ChatCompletionRequest, state: ServerState, http: HTTPRequest):
    turn = await submit(body, state, f"chatcmpl-{uuid.uuid4().hex}")
    if body.stream:
        return StreamingResponse(guarded(_stream(turn, state)), media_type="text/event-stream")
    done, extra = await replies(turn, state, http)
    built = time.monotonic()
    top = (body.top_logprobs or 0) if body.logprobs else None
    choices = []
    for r in done:
        c = r.output
        choices.append({
            "index": c.index, "message": _message(r.parsed, body.include_reasoning),
            "logprobs": {"content": chat_logprobs(c.token_ids, c.logprobs, top, decoder(state.tokenizer))} if top is not None and c.logprobs is not None else None,
            "finish_reason": r.finish_reason,
            "stop_reason": c.stop_reason,
        })
    counts = usage(turn.num_prompt_tokens, sum(len(r.output.token_ids) for r in done))
    response = {"id": turn.request_id, "object": "chat.completion", "created": turn.created, "model": turn.model, "choices": choices,
                "usage": counts}
    if turn.hold_kv:
        response["kv_transfer_params"] = extra.get("kv_transfer_params")
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


async def _stream(turn: Turn, state: ServerState) -> AsyncIterator[bytes]:
    body = turn.body
    head = {"id": turn.request_id, "object": "chat.completion.chunk", "created": turn.created, "model": turn.model}
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    top = (body.top_logprobs or 0) if body.logprobs else None
    completion_tokens = 0
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    try:
        for j in range(body.n):
            yield sse({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        try:
            async for update in streamed(turn, state, stop):
                choices = []
                for d in update:
                    completion_tokens += len(d.token_ids)
                    fields = _delta_fields(d.parsed, body.include_reasoning)
                    lp = None
                    if top is not None and d.logprobs is not None and d.token_ids:
                        lp = {"content": chat_logprobs(d.token_ids, d.logprobs, top, decoder(state.tokenizer))}
                    if not fields and lp is None and d.finish_reason is None:
                        continue
                    choices.append({"index": d.index, "delta": fields, "logprobs": lp, "finish_reason": d.finish_reason})
                if choices:
                    yield sse({**head, "choices": choices})
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the failure goes in the stream
            yield sse(error_for(exc)[1])
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(turn.num_prompt_tokens, completion_tokens)})
        yield DONE
    finally:
        close(turn, state)

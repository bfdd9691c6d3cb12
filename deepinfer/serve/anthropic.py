"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic Messages) on the shared conversation
pipeline.

The request maps onto the chat request model: ``system`` is the system message; ``tool_use`` blocks become the
assistant's tool calls, ``tool_result`` blocks tool messages (before the user's own text, as they answer the
calls before it), ``thinking`` blocks the assistant's reasoning, images (base64 or url) image parts; ``tools``
(``input_schema``), ``tool_choice`` (``auto``/``any``/``tool``/``none``, ``disable_parallel_tool_use``) and
``thinking`` (``budget_tokens``: the engine closes the reasoning after that many tokens) map onto their chat
equivalents. The reply comes back as content blocks (``thinking``, ``text``, ``tool_use``) with Anthropic's
``stop_reason``, whole or as Anthropic's event stream. Errors on these paths are Anthropic's error object.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from ..sampling_params import InvalidRequestError
from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .chat_parsing import ParsedChat, ToolCallDelta
from .conversation import Turn, close, engine_prompt, render, renamed, replies, streamed, submit
from .errors import error_for
from .protocol import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat
from .state import ServerState
from .streaming import named_sse

#: the paths whose errors are Anthropic's error object
PATHS = ("/v1/messages",)

#: chat fields -> the Messages fields they come from (a refusal names the client's field)
FIELDS = {"stop": "stop_sequences", "thinking_token_budget": "thinking.budget_tokens",
          "reasoning_effort": "output_config.effort",
          "response_format": "output_config.format"}

#: HTTP status -> Anthropic's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def owns(path: str) -> bool:
    """Whether ``path`` is one of this API's (its errors take Anthropic's shape)."""
    return path.startswith(PATHS)


def error_object(status: int, openai_body: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's error object for an error the server states in OpenAI's shape."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": openai_body["error"]["message"]}}


def _image(where: str, block: dict[str, Any]) -> dict[str, Any]:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        url = f"data:{source['media_type']};base64,{source['data']}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise InvalidRequestError(f"{where} has an image without a source; give {{'type': 'base64', 'media_type': ..., 'data': ...}} "
                                  "or {'type': 'url', 'url': ...}", "messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _parts(where: str, content: Any, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """Text and image blocks as chat content parts."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} has content of type {type(content).__name__}; give a string or a list of blocks", "messages")
    parts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "text" and "text" in kinds and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and "image" in kinds:
            parts.append(_image(where, block))
        else:
            raise InvalidRequestError(f"{where} has a block of type {kind!r}; it may hold {', '.join(kinds)} blocks", "messages")
    return parts


def _message(i: int, msg: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user turn's tool results are tool messages, first)."""
    role = msg.get("role")
    where = f"message {i} ({role})"
    if role not in ("user", "assistant"):
        raise InvalidRequestError(f"message {i} has role {role!r}; use user or assistant (the system prompt goes in 'system')", "messages")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} has content of type {type(content).__name__}; give a string or a list of blocks", "messages")
    if role == "assistant":
        text, reasoning, calls = [], [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "thinking" and isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
            elif kind == "redacted_thinking":
                continue  # its content is opaque: nothing to render
            elif kind == "tool_use" and isinstance(block.get("name"), str) and isinstance(block.get("input", {}), dict):
                calls.append({"id": str(block.get("id", "")), "type": "function",
                              "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
            else:
                raise InvalidRequestError(f"{where} has a block of type {kind!r} (or one missing its fields); an assistant message "
                                          "holds text, thinking and tool_use blocks", "messages")
        out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if reasoning:
            out["reasoning_content"] = "".join(reasoning)
        if calls:
            out["tool_calls"] = calls
        return [out]
    results, parts = [], []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequestError(f"{where} has a tool_result without tool_use_id", "messages")
            result = block.get("content", "")
            text = result if isinstance(result, str) else _parts(where, result, ("text", "image"))
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            parts += _parts(where, [block], ("text", "image"))
    return results + ([{"role": "user", "content": parts}] if parts else [])


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise InvalidRequestError(f"tools[{i}] is not a client tool; give {{'name': ..., 'description': ..., 'input_schema': {{...}}}} "
                                      "(server tools are not served)", "tools")
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request ``body`` asks for (``count_tokens``'s body renders the same prompt, without sampling)."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.system, str):
        messages.append({"role": "system", "content": body.system})
    elif body.system:
        messages.append({"role": "system", "content": _parts("system", body.system, ("text",))})
    for i, msg in enumerate(body.messages):
        messages += _message(i, msg)
    choice, parallel = body.tool_choice, None
    tool_choice: str | dict[str, Any] | None = None
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequestError("tool_choice of type 'tool' needs the tool's name", "tool_choice")
            tool_choice = {"type": "function", "function": {"name": choice.name}}
        else:
            tool_choice = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use is not None:
            parallel = not choice.disable_parallel_tool_use
    fields: dict[str, Any] = {"chat_template_kwargs": dict(body.chat_template_kwargs or {})}
    thinking = body.thinking
    if thinking is not None:
        fields["chat_template_kwargs"]["thinking"] = thinking.type != "disabled"
        if thinking.type == "enabled":
            if thinking.budget_tokens is None:
                raise InvalidRequestError("thinking of type 'enabled' needs budget_tokens (the most reasoning tokens)", "thinking")
            fields["thinking_token_budget"] = thinking.budget_tokens
    config = body.output_config
    if config is not None and config.effort is not None:
        fields["reasoning_effort"] = config.effort
    # the format shapes the reply's text; a forced call (tool_choice any / tool) has none
    if config is not None and config.format is not None and not (body.tools and choice is not None and choice.type in ("any", "tool")):
        fields["response_format"] = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=config.format.schema_))
    if isinstance(body, MessagesRequest):
        if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens >= body.max_tokens:
            raise InvalidRequestError(f"thinking.budget_tokens ({thinking.budget_tokens}) must be less than max_tokens "
                                      f"({body.max_tokens}): the answer comes after the reasoning", "thinking.budget_tokens")
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature, top_p=body.top_p,
                      top_k=body.top_k, stream=body.stream, user=body.metadata.user_id if body.metadata else None)
    return ChatCompletionRequest(model=body.model, messages=messages, tools=_tools(body.tools), tool_choice=tool_choice,
                                 parallel_tool_calls=parallel, **fields)


async def count_tokens(body: CountTokensRequest, state: ServerState) -> dict[str, int]:
    """``/v1/messages/count_tokens``: the prompt's length as ``/v1/messages`` renders it (images as their spans)."""
    with renamed(FIELDS):
        chat = chat_request(body)
        state.model_name(chat.model)
        _, length = await engine_prompt(render(chat, state), state)
    return {"input_tokens": length}


def _stop(output_reason: str | None, stop_reason: str | int | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for how a completion ended."""
    if called and output_reason == "stop":
        return "tool_use", None
    if output_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments) if arguments else {}}


def content_blocks(parsed: ParsedChat) -> list[dict[str, Any]]:
    """A finished reply as content blocks: its thinking, its text (an empty one when it said nothing at all), its
    tool uses."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not (parsed.tool_calls or parsed.reasoning is not None):
        blocks.append({"type": "text", "text": parsed.content or ""})
    blocks += [_tool_use(c.id, c.name, c.arguments) for c in parsed.tool_calls]
    return blocks


def _message_object(turn: Turn, content: list[dict[str, Any]], stop: tuple[str | None, str | None], output_tokens: int) -> dict[str, Any]:
    return {"id": turn.request_id, "type": "message", "role": "assistant", "model": turn.model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": {"input_tokens": turn.num_prompt_tokens, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


async def create_message(body: MessagesRequest, state: ServerState, http: HTTPRequest):
    with renamed(FIELDS):
        chat = chat_request(body)
        turn = await submit(chat, state, f"msg_{uuid.uuid4().hex}")
    if body.stream:
        return StreamingResponse(_stream(turn, state), media_type="text/event-stream")
    (reply,), _ = await replies(turn, state, http)
    out = reply.output
    stop = _stop(out.finish_reason, out.stop_reason, bool(reply.parsed.tool_calls))
    return JSONResponse(_message_object(turn, content_blocks(reply.parsed), stop, len(out.token_ids)))


class _BlockStream:
    """Anthropic's content-block events: a block opened when the reply's kind of text changes (thinking, text,
    each tool use), deltas into it, and a stop when the next begins."""

    def __init__(self) -> None:
        self.count = 0
        self.open: str | None = None  # the kind of the open block
        self.calls: set[int] = set()

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.stop()
        self.open = kind
        out.append(named_sse("content_block_start", {"type": "content_block_start", "index": self.count, "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return named_sse("content_block_delta", {"type": "content_block_delta", "index": self.count, "delta": delta})

    def stop(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        out.append(named_sse("content_block_stop", {"type": "content_block_stop", "index": self.count}))
        self.open = None
        self.count += 1
        return out

    def thinking(self, text: str) -> list[bytes]:
        out = [] if self.open == "thinking" else self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        return out + [self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[bytes]:
        out = [] if self.open == "text" else self._start("text", {"type": "text", "text": ""})
        return out + ([self._delta({"type": "text_delta", "text": text})] if text else [])

    def call(self, d: ToolCallDelta) -> list[bytes]:
        out = []
        if d.id is not None:
            self.calls.add(d.index)
            out += self._start("tool_use", {"type": "tool_use", "id": d.id, "name": d.name or "", "input": {}})
        if d.arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        return out


async def _stream(turn: Turn, state: ServerState) -> AsyncIterator[bytes]:
    blocks = _BlockStream()
    tokens = 0
    finish: str | None = None
    try:
        message = _message_object(turn, [], (None, None), 0)
        message["usage"]["output_tokens"] = 1
        yield named_sse("message_start", {"type": "message_start", "message": message})
        yield named_sse("ping", {"type": "ping"})
        stop_reason: str | int | None = None
        try:
            async for update in streamed(turn, state, list(turn.body.stop or [])):
                for d in update:
                    tokens += len(d.token_ids)
                    for e in (blocks.thinking(d.parsed.reasoning) if d.parsed.reasoning else []):
                        yield e
                    for e in (blocks.text(d.parsed.content) if d.parsed.content else []):
                        yield e
                    for call in d.parsed.tool_calls:
                        for e in blocks.call(call):
                            yield e
                    if d.finish_reason is not None:
                        finish = d.finish_reason
                        latest = turn.stream.latest
                        stop_reason = latest.outputs[d.index].stop_reason if latest is not None else None
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the failure goes in the stream
            status, err = error_for(exc)
            yield named_sse("error", error_object(status, err))
            return
        if blocks.count == 0 and blocks.open is None:  # nothing was said: an empty text block, as the whole reply has
            for e in blocks.text(""):
                yield e
        for e in blocks.stop():
            yield e
        called = bool(blocks.calls)
        reason = _stop("stop" if finish == "tool_calls" else finish, stop_reason, called)
        yield named_sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
                                          "usage": {"output_tokens": tokens}})
        yield named_sse("message_stop", {"type": "message_stop"})
    finally:
        close(turn, state)

"""``POST /v1/responses`` (OpenAI Responses) on the shared conversation pipeline.

The request maps onto the chat request model: ``instructions`` is the system message, ``input`` items become
chat messages (``function_call`` items the assistant's tool calls, ``function_call_output`` items tool
messages, ``reasoning`` items the next assistant message's reasoning), ``text.format`` the output constraint,
``reasoning.effort`` the chat format's thinking switch and effort. The reply comes back as output items
(``reasoning``, ``message``, ``function_call``), whole or as the typed event stream the ``openai`` SDK parses.

Responses are kept in memory when ``store`` (the default) is set, the newest ``STORED_RESPONSES`` of them, so
``GET /v1/responses/{id}`` and ``previous_response_id`` (the stored conversation continued) work within that bound.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest

from ..sampling_params import InvalidRequestError
from .chat_parsing import ParsedChat, ParsedToolCall, ToolCallDelta
from .conversation import Turn, close, reasoning_tokens, renamed, replies, streamed, submit
from .errors import error_for
from .protocol import ChatCompletionRequest, JsonSchemaFormat, ResponseFormat
from .responses_protocol import ResponsesRequest
from .state import ServerState
from .streaming import named_sse

#: responses kept for ``GET`` and ``previous_response_id`` (the oldest goes first)
STORED_RESPONSES = 512

#: chat fields -> the Responses fields they come from (a refusal names the client's field)
FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format", "reasoning_effort": "reasoning.effort"}


@dataclass
class Stored:
    """A kept response and the conversation it ended (its input after the instructions, and its output)."""

    response: dict[str, Any]
    history: list[dict[str, Any]]


@dataclass
class ResponseStore:
    """The newest ``capacity`` stored responses by id."""

    capacity: int = STORED_RESPONSES
    _items: OrderedDict[str, Stored] = field(default_factory=OrderedDict)

    def put(self, stored: Stored) -> None:
        self._items[stored.response["id"]] = stored
        self._items.move_to_end(stored.response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


def _text_part(where: str, part: Any) -> dict[str, Any]:
    """A chat content part for one Responses content part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{where} has an input_image without image_url (file_id is not supported): "
                                      "give a data: URI or an http(s) URL", "input")
        return {"type": "image_url", "image_url": {"url": url}}
    raise InvalidRequestError(f"{where} has a content part of type {kind!r}; give input_text, input_image or output_text parts",
                              "input")


def _content(where: str, content: Any) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return [_text_part(where, p) for p in content]
    raise InvalidRequestError(f"{where} has content of type {type(content).__name__}; give a string or a list of parts", "input")


def _string(where: str, item: dict[str, Any], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where} needs {key!r} as a string", "input")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages of a Responses ``input``."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input item {i} ({kind})"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(f"{where} has role {role!r}; use user, system, developer or assistant", "input")
            message: dict[str, Any] = {"role": role, "content": _content(where, item.get("content"))}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _string(where, item, "call_id"), "type": "function",
                    "function": {"name": _string(where, item, "name"), "arguments": _string(where, item, "arguments")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]) and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _content(where, output)
            messages.append({"role": "tool", "tool_call_id": _string(where, item, "call_id"), "content": content})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise InvalidRequestError(f"{where} needs 'content' as a list of reasoning_text parts", "input")
            reasoning = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
        else:
            raise InvalidRequestError(
                f"{where} is not supported; send message, function_call, function_call_output or reasoning items", "input"
            )
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools; other kinds (hosted tools) are refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise InvalidRequestError(f"tools[{i}] has type {tool.get('type')!r}; only function tools "
                                      "({'type': 'function', 'name': ..., 'parameters': {...}}) are served", "tools")
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}] has parameters of type {type(parameters).__name__}; give a JSON schema object", "tools")
        fn = {"name": tool["name"], "parameters": parameters}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError(f"tool_choice {choice!r} is not supported; give 'auto', 'none', 'required' or "
                              "{'type': 'function', 'name': ...}", "tool_choice")


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise InvalidRequestError("text.format json_schema needs 'schema' (a JSON schema object)", "text.format")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict))


def chat_request(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request ``body`` asks for, continuing ``history`` (a previous response's conversation)."""
    if body.background:
        raise InvalidRequestError("background responses are not supported; send background=false and wait for the reply",
                                  "background")
    if body.prompt is not None or body.conversation is not None:
        field = "prompt" if body.prompt is not None else "conversation"
        raise InvalidRequestError(f"{field} is not supported: this server keeps no prompt templates or conversations; "
                                  "send the messages in input (or continue with previous_response_id)", field)
    if body.truncation == "auto":
        raise InvalidRequestError("truncation 'auto' is not supported: the server drops no input; send 'disabled' and "
                                  "shorten the input to fit the context", "truncation")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    messages += history + input_messages(body.input)
    kwargs: dict[str, Any] = {"chat_template_kwargs": dict(body.chat_template_kwargs or {})}
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort is not None:
        kwargs["chat_template_kwargs"]["thinking"] = effort not in ("none", "minimal")
        kwargs["reasoning_effort"] = effort
    tool_choice = _tool_choice(body.tool_choice)
    # text.format shapes the reply's text and a forced call has none: OpenAI takes both at once (the Agents SDK sends them)
    forced = body.tools and tool_choice not in (None, "auto", "none")
    return ChatCompletionRequest(
        model=body.model, messages=messages, tools=_tools(body.tools), tool_choice=tool_choice, parallel_tool_calls=body.parallel_tool_calls,
        response_format=None if forced else _response_format(body), max_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos,
        structured_outputs=body.structured_outputs, stream=body.stream, **kwargs,
    )


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [_text(text)]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """The response's ``status`` and ``incomplete_details`` for how its completion ended."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def output_items(parsed: ParsedChat, status: str) -> list[dict[str, Any]]:
    """A finished reply as output items: its reasoning, its text (an empty message when it said nothing at all),
    its calls."""
    items = []
    if parsed.reasoning is not None:
        items.append(_reasoning_item(_id("rs"), parsed.reasoning, "completed"))
    if parsed.content or not (parsed.tool_calls or parsed.reasoning is not None):
        items.append(_message_item(_id("msg"), parsed.content or "", status))
    items += [_call_item(_id("fc"), c.id, c.name, c.arguments, "completed") for c in parsed.tool_calls]
    return items


def _assistant_message(parsed: ParsedChat) -> dict[str, Any]:
    """The reply as the chat message a continuation's history holds."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or ""}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in parsed.tool_calls]
    return message


def _usage(state: ServerState, turn: Turn, output_tokens: int, reasoning: str | None) -> dict[str, Any]:
    return {"input_tokens": turn.num_prompt_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(state, reasoning)},
            "total_tokens": turn.num_prompt_tokens + output_tokens}


def _response(body: ResponsesRequest, turn: Turn, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              incomplete: dict[str, str] | None = None) -> dict[str, Any]:
    """The Response object: the request's settings echoed beside the output."""
    return {
        "id": turn.request_id, "object": "response", "created_at": turn.created, "model": turn.model, "status": status,
        "error": None, "incomplete_details": incomplete, "instructions": body.instructions, "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False, "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [], "temperature": body.temperature, "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens, "previous_response_id": body.previous_response_id,
        "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)} if body.text and body.text.format else {"format": {"type": "text"}},
        "truncation": body.truncation or "disabled", "metadata": body.metadata or {}, "store": body.store,
        "background": False, "usage": usage, "user": body.user,
    }


async def create_response(body: ResponsesRequest, state: ServerState, store: ResponseStore, http: HTTPRequest):
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise InvalidRequestError(
                f"previous response {body.previous_response_id!r} is not stored here (only responses created with store=true, "
                f"the newest {store.capacity}, are kept); send the whole conversation in input instead", "previous_response_id",
            )
        history = previous.history
    with renamed(FIELDS):
        chat = chat_request(body, history)
        turn = await submit(chat, state, _id("resp"), max_tokens_field="max_output_tokens")
    asked = chat.messages[1:] if body.instructions is not None else chat.messages
    if body.stream:
        return StreamingResponse(_stream(body, turn, state, store, asked), media_type="text/event-stream")
    (reply,), _ = await replies(turn, state, http)
    status, incomplete = _status(reply.output.finish_reason)
    response = _response(body, turn, status, output_items(reply.parsed, status),
                         _usage(state, turn, len(reply.output.token_ids), reply.parsed.reasoning), incomplete)
    if body.store:
        store.put(Stored(response, asked + [_assistant_message(reply.parsed)]))
    return JSONResponse(response)


class _EventStream:
    """The typed events of one streamed response: output items opened and closed as the reply's kind of text
    changes (reasoning, message text, each tool call), every event numbered."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # every item, finished or open, in output order
        self.open: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        out = named_sse(kind, {"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return out

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[bytes]:
        self.items.append(item)
        self.open = item
        added = {**item, "status": "in_progress"}
        if part is not None:
            added["content"] = []
        out = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=added)]
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, part=part))
        return out

    def close(self, status: str = "completed") -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        out = []
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        else:
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return out

    def reasoning(self, text: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "reasoning":
            out += self.close()
            out += self._add(_reasoning_item(_id("rs"), "", "in_progress"), {"type": "reasoning_text", "text": ""})
        self.open["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                              content_index=0, delta=text))
        return out

    def content(self, text: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != "message":
            out += self.close()
            out += self._add(_message_item(_id("msg"), "", "in_progress"), _text(""))
        self.open["content"][0]["text"] += text
        out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.items) - 1,
                              content_index=0, delta=text, logprobs=[]))
        return out

    def call(self, d: ToolCallDelta) -> list[bytes]:
        out = []
        if d.id is not None:
            out += self.close()
            self.calls[d.index] = _call_item(_id("fc"), d.id, d.name or "", "", "in_progress")
            out += self._add(self.calls[d.index], None)
        item = self.calls[d.index]
        if d.arguments:
            item["arguments"] += d.arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.items.index(item), delta=d.arguments))
        return out


async def _stream(body: ResponsesRequest, turn: Turn, state: ServerState, store: ResponseStore,
                  asked: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    events = _EventStream()
    tokens = 0
    reasoning: list[str] = []
    finish: str | None = None
    try:
        created = _response(body, turn, "in_progress", [], None)
        yield events.event("response.created", response=created)
        yield events.event("response.in_progress", response=created)
        try:
            stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
            async for update in streamed(turn, state, stop):
                for d in update:
                    tokens += len(d.token_ids)
                    if d.parsed.reasoning:
                        reasoning.append(d.parsed.reasoning)
                        for e in events.reasoning(d.parsed.reasoning):
                            yield e
                    if d.parsed.content:
                        for e in events.content(d.parsed.content):
                            yield e
                    for call in d.parsed.tool_calls:
                        for e in events.call(call):
                            yield e
                    finish = d.finish_reason or finish
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the failure goes in the stream
            _, err = error_for(exc)
            yield events.event("error", code=str(err["error"]["code"]), message=err["error"]["message"], param=err["error"]["param"])
            failed = _response(body, turn, "failed", events.items, None)
            failed["error"] = {"code": "server_error", "message": err["error"]["message"]}
            yield events.event("response.failed", response=failed)
            return
        status, incomplete = _status(finish)
        for e in events.close(status if events.open is not None and events.open["type"] == "message" else "completed"):
            yield e
        if not events.items:  # nothing was said: an empty message, as the non-streamed reply has
            for e in events.content("") + events.close(status):
                yield e
        text = "".join(reasoning) or None
        response = _response(body, turn, status, events.items, _usage(state, turn, tokens, text), incomplete)
        if body.store:
            store.put(Stored(response, asked + [_assistant_message(_parsed(events.items, text))]))
        yield events.event("response.completed" if status == "completed" else "response.incomplete", response=response)
    finally:
        close(turn, state)


def _parsed(items: list[dict[str, Any]], reasoning: str | None) -> ParsedChat:
    """A streamed reply's output items as the parser's whole result (what a continuation's history holds)."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [ParsedToolCall(i["call_id"], i["name"], i["arguments"]) for i in items if i["type"] == "function_call"]
    return ParsedChat(reasoning, text or None, calls)


def stored_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """``GET /v1/responses/{id}``: a stored response (a 404 when it is not, or no longer, kept)."""
    stored = store.get(response_id)
    if stored is None:
        raise HTTPException(404, f"response {response_id!r} is not stored here (only responses created with store=true, "
                                 f"the newest {store.capacity}, are kept)")
    return stored.response

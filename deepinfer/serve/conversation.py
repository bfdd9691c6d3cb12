"""The conversation pipeline every chat-shaped API shares: render the messages and tools in the model's chat
format, build the sampling parameters, submit to the engine, and split what comes back (whole, or as streamed
deltas) into reasoning, content and tool calls.

The one request model is ``ChatCompletionRequest``: ``/v1/chat/completions`` takes it as sent,
``/v1/responses`` (``responses``) and ``/v1/messages`` (``anthropic``) map their bodies onto it, then each
maps the ``Turn``'s outputs back into its own wire shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HTTPRequest

from ..chat import ChatPrompt, format_chat
from ..errors import ChatFormatError
from ..image_input import ImageInputError, load_images
from ..outputs import CompletionOutput, PositionLogprobs
from ..sampling_params import InvalidRequestError
from . import reply_controls
from .async_engine import RequestStream
from .bootstrap import post_when_done, room_of
from .chat_parsing import ChatDelta, ChatOutputParser, ParsedChat, parse_chat_output
from .deltas import CompletionCursor
from .params import constraint_field, sampling_params, served_max_tokens
from .protocol import ChatCompletionRequest
from .state import ServerState
from .streaming import admit, check_output, final_outputs, merged, release


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


def tool_parser(body: ChatCompletionRequest, state: ServerState) -> str | None:
    """The tool-call format parsed from the reply: only when tools are declared and may be called
    (``tool_choice`` checked; ``reply_controls``)."""
    return reply_controls.tool_parser(body, state.tool_call_parser)


@contextmanager
def renamed(fields: Mapping[str, str]) -> Iterator[None]:
    """Errors raised inside name the caller's own fields: a refusal about the chat field ``k`` names ``fields[k]``
    (the wire API's spelling of it), in its ``param`` and at the start of its message."""
    try:
        yield
    except InvalidRequestError as exc:
        param = exc.param
        if param is None:
            raise
        head = param.split(".")[0]
        if head not in fields:
            raise
        new = fields[head] + param[len(head):]
        message = str(exc)
        if message.startswith(head):
            message = fields[head] + message[len(head):]
        raise type(exc)(message, new) from None


@dataclass
class Turn:
    """One conversation submitted to the engine: what its outputs are parsed against, and its stream."""

    body: ChatCompletionRequest
    request_id: str
    model: str
    created: int
    prompt_text: str
    num_prompt_tokens: int
    stream: RequestStream
    tool_parser: str | None
    #: a prefill server's request (disaggregated serving): it holds its KV state for a decode server
    hold_kv: bool


async def submit(body: ChatCompletionRequest, state: ServerState, request_id: str, max_tokens_field: str | None = None) -> Turn:
    """Render ``body``, check it, and hand it to the engine; returns once the engine took it (a refusal is a 400).
    ``max_tokens_field``: how the caller's API spells the output bound (a refusal names it)."""
    received = time.monotonic()
    model = state.model_name(body.model)
    parser = tool_parser(body, state)
    prompt = render(body, state)
    engine_input, n_prompt = await engine_prompt(prompt, state)
    state.check_prompt(prompt.token_ids, "messages", n_prompt - len(prompt.token_ids))
    hold_kv, transfer = await state.transfer(body, 1)
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    requested = 1 if hold_kv else requested  # a prefill server samples the first token; the decode server the rest
    top = (body.top_logprobs or 0) if body.logprobs else None
    named = max_tokens_field or ("max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
    params = sampling_params(body, state.limits, max_tokens=served_max_tokens(requested, n_prompt, state.max_model_len, named), logprobs=top,
                             tool_constraint=reply_controls.tool_constraint(body, parser), thinking_budget=reply_controls.thinking_budget(body))
    stream = state.engine.submit(request_id, engine_input, params, n_prompt, hold_kv=hold_kv, kv_transfer_params=transfer, received=received)
    room = room_of(body)
    if hold_kv and room is not None and state.rooms is not None:
        post_when_done(state.rooms, room, stream)
    await admit(state.engine, [stream], state.metrics, constraint_field(body) or ("messages" if prompt.images else None))
    return Turn(body, request_id, model, int(time.time()), prompt.text, n_prompt, stream, parser, hold_kv)


@dataclass
class Reply:
    """One finished completion of a turn, parsed."""

    output: CompletionOutput
    parsed: ParsedChat

    @property
    def finish_reason(self) -> str | None:
        """``tool_calls`` when the completion stopped after calling, else the engine's reason."""
        return finish_reason(self.output.finish_reason, bool(self.parsed.tool_calls))


def finish_reason(reason: str | None, called: bool) -> str | None:
    """``tool_calls`` for a completion that stopped on its own after calling a tool, else ``reason``."""
    return "tool_calls" if called and reason == "stop" else reason


async def replies(turn: Turn, state: ServerState, http: HTTPRequest) -> tuple[list[Reply], dict[str, Any]]:
    """Every completion of ``turn`` once it finished, parsed; and the engine's extra fields (KV transfer)."""
    out = (await final_outputs(state.engine, [turn.stream], http, state.metrics))[0]
    parsed = [Reply(c, parse_chat_output(turn.prompt_text, c.text, reasoning=state.reasoning_parser, tool_parser=turn.tool_parser))
              for c in out.outputs]
    return parsed, out.extra


@dataclass
class StreamedDelta:
    """What one update adds to one completion: its parsed text, the tokens behind it and how it ended."""

    index: int
    parsed: ChatDelta
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    #: the completion's finish reason when this delta ends it (``tool_calls`` once it called a tool)
    finish_reason: str | None


async def streamed(turn: Turn, state: ServerState, stop: list[str]) -> AsyncIterator[list[StreamedDelta]]:
    """The deltas of each engine update (only completions with something new); a failed request raises.
    ``stop``: the stop strings, whose possible beginnings are held back until they are known not to match."""
    cursors: list[CompletionCursor] = []
    parsers: list[ChatOutputParser] = []
    called: list[bool] = []
    async for _, out in merged([turn.stream]):
        began = time.monotonic()
        out = check_output(turn.stream, out)
        if not cursors:
            cursors = [CompletionCursor(stop) for _ in out.outputs]
            parsers = [ChatOutputParser(turn.prompt_text, reasoning=state.reasoning_parser, tool_parser=turn.tool_parser)
                       for _ in out.outputs]
            called = [False] * len(out.outputs)
        update = []
        for c, cursor, parser in zip(out.outputs, cursors, parsers):
            delta = cursor.advance(c)
            if delta is None:
                continue
            parsed = parser.feed(delta.text)
            if delta.finish_reason is not None:
                tail = parser.finish()
                parsed = ChatDelta(parsed.reasoning + tail.reasoning, parsed.content + tail.content, parsed.tool_calls + tail.tool_calls)
            called[c.index] = called[c.index] or bool(parsed.tool_calls)
            update.append(StreamedDelta(c.index, parsed, delta.token_ids, delta.logprobs, finish_reason(delta.finish_reason, called[c.index])))
        turn.stream.timing.postprocess += time.monotonic() - began
        if update:
            yield update


def close(turn: Turn, state: ServerState) -> None:
    """The handler is done with ``turn`` (a stream ended, or its client left): abort it if it still runs."""
    release(state.engine, [turn.stream], state.metrics)


def reasoning_tokens(state: ServerState, reasoning: str | None) -> int:
    """How many tokens the reasoning text is (the usage's ``reasoning_tokens``)."""
    return len(state.tokenizer.encode(reasoning, add_special_tokens=False).ids) if reasoning else 0

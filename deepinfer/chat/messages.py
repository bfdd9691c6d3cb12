"""Chat messages as users pass them (vLLM's / OpenAI's shape), checked once and normalised.

A conversation is a list of dicts: ``{"role": ..., "content": ...}`` plus, on
assistant turns, ``reasoning_content`` (vLLM also spells it ``reasoning``) and
``tool_calls``, and on tool turns ``tool_call_id``. Content is a string or a list
of ``{"type": "text", "text": ...}`` parts (joined with newlines, as vLLM's
"string" content format does). Image parts (``{"type": "image_url", "image_url":
{"url": ...}}``, the url also as a plain string, or ``{"type": "image_pil",
"image_pil": image}``) put the model's image placeholder text where the image
was, the parts then joined as they stand (interleaved, as V4.1's encoder writes
them); the images travel beside the text, in order. Every problem is one line
naming the message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import ChatFormatError

ROLES = ("system", "user", "assistant", "tool", "developer")

#: one conversation: a list of message dicts
Conversation = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class ToolCall:
    """One call the assistant made: the function's name and its arguments as a JSON object."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass(frozen=True)
class Message:
    """A checked message; ``source`` is a copy of the user's dict with ``content`` normalised to text
    and ``reasoning_content`` filled in, which is what a Jinja chat template sees."""

    role: str
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    source: dict[str, Any] = field(default_factory=dict, compare=False)
    #: the images of its content parts, in order (a URL, a path or a PIL image, not yet decoded)
    images: tuple[Any, ...] = field(default=(), compare=False)


def is_single_conversation(messages: Any) -> bool:
    """True for one conversation (a list of dicts), False for a list of conversations."""
    return isinstance(messages, Sequence) and not isinstance(messages, str) and bool(messages) and isinstance(messages[0], Mapping)


def parse_conversation(messages: Any, image_placeholder: str | None = None) -> list[Message]:
    """Check a conversation and return its messages; a ChatFormatError names the first problem.
    ``image_placeholder``: the text written where each image part was (None: the model reads no images,
    nothing is written and the engine refuses the images)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatFormatError("a conversation must be a non-empty list of messages, dicts with 'role' and 'content'")
    return [_parse_message(i, m, image_placeholder or "") for i, m in enumerate(messages)]


def _parse_message(i: int, msg: Any, image_placeholder: str) -> Message:
    if not isinstance(msg, Mapping):
        raise ChatFormatError(f"message {i} is a {type(msg).__name__}; each message must be a dict with 'role' and 'content'")
    role = msg.get("role")
    if role not in ROLES:
        raise ChatFormatError(f"message {i} has role {role!r}; use one of {', '.join(ROLES)}")
    where = f"message {i} ({role})"
    content, images = _content(where, msg.get("content"), role == "assistant", image_placeholder)
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise ChatFormatError(f"{where} has reasoning_content of type {type(reasoning).__name__}; give a string")
    raw_calls = msg.get("tool_calls")
    if raw_calls and role != "assistant":
        raise ChatFormatError(f"{where} has tool_calls; only assistant messages make tool calls")
    calls = tuple(_tool_call(f"{where} tool call {j}", c) for j, c in enumerate(raw_calls or ()))
    call_id = msg.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise ChatFormatError(f"{where} has tool_call_id of type {type(call_id).__name__}; give a string")
    source = dict(msg)
    source["content"] = content
    if role == "assistant" and reasoning is not None:
        source.setdefault("reasoning_content", reasoning)
    return Message(role, content, reasoning if role == "assistant" else None, calls, call_id, source, images)


def _content(where: str, content: Any, optional: bool, image_placeholder: str) -> tuple[str, tuple[Any, ...]]:
    """Message content as text and its images: a string, or a list of parts (text parts joined by newlines;
    with images, every part in place, each image as ``image_placeholder``)."""
    if content is None and optional:
        return "", ()
    if isinstance(content, str):
        return content, ()
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        texts: list[str] = []
        images: list[Any] = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind in IMAGE_PARTS:
                images.append(_image(where, part, kind))
                texts.append(image_placeholder)
            elif kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ChatFormatError(f"{where} has a content part of type {kind!r}; give text, image_url or image_pil parts")
        return ("".join(texts) if images else "\n".join(texts)), tuple(images)
    if content is None:
        raise ChatFormatError(f"{where} has no content; give a string")
    raise ChatFormatError(f"{where} has content of type {type(content).__name__}; give a string or a list of text parts")


#: the content part types that carry an image
IMAGE_PARTS = ("image_url", "image_pil")


def _image(where: str, part: Mapping[str, Any], kind: str) -> Any:
    """The image of an image part: ``image_url`` as ``{"url": ...}`` or a plain string, or ``image_pil``'s image."""
    value = part.get(kind)
    if kind == "image_url":
        value = value.get("url") if isinstance(value, Mapping) else value
        if not isinstance(value, str) or not value:
            raise ChatFormatError(
                f"{where} has an image_url part without a url; "
                "give {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}}"
            )
    elif value is None:
        raise ChatFormatError(f"{where} has an image_pil part without an image; give {{'type': 'image_pil', 'image_pil': image}}")
    return value


def _tool_call(where: str, call: Any) -> ToolCall:
    """An OpenAI-format tool call: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ChatFormatError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': ...}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ChatFormatError(f"{where} has arguments that are not JSON ({exc.msg}); give a JSON object") from None
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where} has arguments of type {type(args).__name__}; give a JSON object")
    call_id = call.get("id")
    return ToolCall(fn["name"], args, call_id if isinstance(call_id, str) else None)

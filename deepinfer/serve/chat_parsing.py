"""A chat completion's generated text as OpenAI chat fields: ``reasoning_content``, ``content``, ``tool_calls``.

``ChatOutputParser.feed`` takes the text as it is generated, in fragments that
may split a marker anywhere, and returns what can be said so far (a
``ChatDelta``); ``finish`` flushes what was held back; ``result`` is the whole
response. Streaming and non-streaming (``parse_chat_output``) share this path,
so streamed pieces always concatenate to the non-streaming fields.

Reasoning (DeepSeek-V4's ``<think>`` / ``</think>``, plain text): the output
starts in reasoning when the prompt ends with ``<think>``, or when the output
begins (after whitespace) with ``<think>``, dropped with that whitespace. It ends
at the first ``</think>`` (dropped); the rest is content, kept exactly.

Tool calls are parsed in content only (markup in reasoning is text), by one of
``TOOL_PARSERS``: ``deepseek_v4``, a ``<｜DSML｜tool_calls>`` block (the inverse
of ``deepinfer.chat.deepseek_v4._invoke``), or ``hermes``,
``<tool_call>{json}</tool_call>``. Whitespace right before and after a block is
dropped. The caller passes ``tool_parser=None`` when the request declared no
``tools`` or ``tool_choice`` is ``"none"``: markup then stays in content. A block
that is malformed, or unfinished at the end, goes back into content as raw text
and makes no call, except that a DeepSeek-V4 call whose ``invoke`` tag was whole
has been streamed already: it stays a call (its arguments closed after the
parameters complete so far) and the text from where parsing stopped is content.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
import json
import re
import secrets
from dataclasses import dataclass, field, replace

from ..chat.deepseek_v4 import DSML, END_THINK, THINK


@dataclass
class ToolCallDelta:
    """One streamed piece of a tool call: the first carries ``id`` and ``name``, later ones only argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedToolCall:
    """A whole tool call; ``arguments`` is JSON text (an object)."""

    id: str
    name: str
    arguments: str


@dataclass
class ChatDelta:
    """What one ``feed`` / ``finish`` adds to the response."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def empty(self) -> bool:
        """True when there is nothing to send."""
        return not (self.reasoning or self.content or self.tool_calls)


@dataclass
class ParsedChat:
    """The fields of a non-streaming response. ``reasoning`` is None when there was no reasoning text;
    ``content`` is None when it is empty and there are tool calls, else a string, possibly ``""`` (as when
    generation ended inside reasoning: the caller decides between ``""`` and null)."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ParsedToolCall]


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (held back: the next text may complete it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class _Block(ABC):
    """One tool-call block, parsed from just after its opening marker as text arrives.

    ``feed`` returns the call deltas it can; the block then is ``closed`` (``rest``
    is the text after it) or ``failed`` (``buf`` is the text it could not parse),
    or waits for more. ``fed`` is all text given to it, ``calls`` the calls it started.
    """

    start = ""

    def __init__(self, first_index: int) -> None:
        self.first_index, self.calls = first_index, 0
        self.fed = self.buf = self.rest = ""
        self.closed = self.failed = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.fed += text
        self.buf += text
        return self._parse()

    def fail(self) -> list[ToolCallDelta]:
        """Give up on the block (malformed, or generation ended inside it)."""
        self.failed = True
        return []

    @abstractmethod
    def _parse(self) -> list[ToolCallDelta]:
        """The call deltas the buffered text completes (each format parses its own markup)."""


_DSML_BLOCK_END = f"</{DSML}tool_calls>"
_DSML_INVOKE = re.compile(rf'<{DSML}invoke name="([^"]*)">')
_DSML_INVOKE_END = f"</{DSML}invoke>"
_DSML_PARAM_OPEN = re.compile(rf'<{DSML}parameter name="([^"]*)" string="(true|false)">')
_DSML_PARAM = re.compile(rf"{_DSML_PARAM_OPEN.pattern}(.*?)</{DSML}parameter>", re.S)


def _may_become(s: str, heads: tuple[str, ...], opener: re.Pattern[str] | None = None) -> bool:
    """Whether more text could still make ``s`` one of the tags expected (beginning with one of ``heads``)."""
    if opener is not None and opener.match(s):
        return True  # the opening tag is whole; its value and closing tag are coming
    return ">" not in s and any(h.startswith(s[: len(h)]) for h in heads)


def _dsml_value(raw: str, is_string: bool) -> str:
    """A parameter's value as JSON text: strings as they are, anything else parsed as JSON (else kept as a string)."""
    if not is_string:
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False)
        except ValueError:
            pass
    return json.dumps(raw, ensure_ascii=False)


class _DsmlBlock(_Block):
    """DeepSeek-V4's DSML block; a call's header goes out at its ``invoke`` tag, each parameter at its closing tag."""

    start = f"<{DSML}tool_calls>"

    def __init__(self, first_index: int) -> None:
        super().__init__(first_index)
        self.in_invoke = False
        self.params = 0  # parameters of the open invoke

    def _parse(self) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while not (self.closed or self.failed):
            s = self.buf.lstrip()
            n = self._tag(s, out)
            if n is None:
                out += self.fail()
            elif n == 0:
                break
            else:
                self.buf = s[n:]
        if self.closed:
            self.rest, self.buf = self.buf, ""
        return out

    def _tag(self, s: str, out: list[ToolCallDelta]) -> int | None:
        """Take the tag at the start of ``s``: its length; 0 while it is incomplete; None if it is no expected tag."""
        if self.in_invoke:
            if m := _DSML_PARAM.match(s):
                key = json.dumps(m[1], ensure_ascii=False)
                out.append(self._args(("{" if not self.params else ", ") + f"{key}: {_dsml_value(m[3], m[2] == 'true')}"))
                self.params += 1
                return m.end()
            if s.startswith(_DSML_INVOKE_END):
                out.append(self._close_invoke())
                return len(_DSML_INVOKE_END)
            return 0 if _may_become(s, (f'<{DSML}parameter name="', _DSML_INVOKE_END), _DSML_PARAM_OPEN) else None
        if m := _DSML_INVOKE.match(s):
            out.append(ToolCallDelta(self.first_index + self.calls, _new_call_id(), m[1]))
            self.calls += 1
            self.in_invoke, self.params = True, 0
            return m.end()
        if s.startswith(_DSML_BLOCK_END):
            self.closed = True
            return len(_DSML_BLOCK_END)
        return 0 if _may_become(s, (f'<{DSML}invoke name="', _DSML_BLOCK_END)) else None

    def _args(self, text: str) -> ToolCallDelta:
        return ToolCallDelta(self.first_index + self.calls - 1, arguments=text)

    def _close_invoke(self) -> ToolCallDelta:
        self.in_invoke = False
        return self._args("}" if self.params else "{}")

    def fail(self) -> list[ToolCallDelta]:
        self.failed = True
        return [self._close_invoke()] if self.in_invoke else []


class _HermesBlock(_Block):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the call goes out whole at the closing tag."""

    start = "<tool_call>"
    end = "</tool_call>"

    def _parse(self) -> list[ToolCallDelta]:
        i = self.buf.find(self.end)
        if i < 0:
            return []
        body, self.rest, self.buf = self.buf[:i], self.buf[i + len(self.end) :], ""
        try:
            obj = json.loads(body)
        except ValueError:
            return self.fail()
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return self.fail()
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            return self.fail()
        self.closed, self.calls = True, 1
        return [ToolCallDelta(self.first_index, _new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))]


_BLOCKS: dict[str, type[_Block]] = {"deepseek_v4": _DsmlBlock, "hermes": _HermesBlock}

#: the tool-call formats ``tool_parser`` (``--tool-call-parser``) names
TOOL_PARSERS: tuple[str, ...] = tuple(_BLOCKS)


class _Mode(enum.Enum):
    START = "start"  # content so far, but a leading <think> would open reasoning
    REASONING = "reasoning"
    CONTENT = "content"
    BLOCK = "block"  # inside a tool-call block


class ChatOutputParser:
    """Splits one completion's text into reasoning, content and tool calls, incrementally (see the module docstring).

    ``prompt_text`` is the rendered prompt (it decides whether the output starts
    in reasoning); ``reasoning=False`` makes all text content; ``tool_parser``
    names one of ``TOOL_PARSERS``, None for no tool parsing.
    """

    def __init__(self, prompt_text: str, *, reasoning: bool = True, tool_parser: str | None = "deepseek_v4") -> None:
        if tool_parser is not None and tool_parser not in _BLOCKS:
            raise ValueError(f"unknown tool call parser {tool_parser!r}; known: {', '.join(TOOL_PARSERS)}")
        self._block_type = _BLOCKS[tool_parser] if tool_parser is not None else None
        if not reasoning:
            self._mode = _Mode.CONTENT
        elif prompt_text.rstrip().endswith(THINK):
            self._mode = _Mode.REASONING
        else:
            self._mode = _Mode.START
        self._buf = ""  # text not handled yet (held back, or waiting for its mode)
        self._block: _Block | None = None
        self._block_prefix = ""  # the whitespace and opening marker before the open block, given back if it fails
        self._after_block = False  # drop whitespace right after a block
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ParsedToolCall] = []
        self._delta = ChatDelta()
        self._finished = False

    def feed(self, text: str) -> ChatDelta:
        """Take the text generated since the last call; return what can be said of it now."""
        if self._finished:
            raise RuntimeError("ChatOutputParser.feed after finish")
        self._buf += text
        while self._step(final=False):
            pass
        return self._take()

    def finish(self) -> ChatDelta:
        """Generation ended: say everything held back (an unfinished block goes to content)."""
        if not self._finished:
            self._finished = True
            while self._step(final=True):
                pass
        return self._take()

    def result(self) -> ParsedChat:
        """Everything parsed so far, as a non-streaming response carries it (whole after ``finish``)."""
        content = "".join(self._content)
        calls = [replace(c) for c in self._calls]
        return ParsedChat("".join(self._reasoning) or None, content if content or not calls else None, calls)

    def _step(self, final: bool) -> bool:
        """Handle ``_buf`` in the current mode; True when the mode changed and the rest needs another step."""
        buf = self._buf
        if self._mode is _Mode.START:
            s = buf.lstrip()
            if s.startswith(THINK):
                self._mode, self._buf = _Mode.REASONING, s[len(THINK) :]
            elif final or not THINK.startswith(s):
                self._mode = _Mode.CONTENT
            else:
                return False
            return True
        if self._mode is _Mode.REASONING:
            i = buf.find(END_THINK)
            if i >= 0:
                self._say_reasoning(buf[:i])
                self._mode, self._buf = _Mode.CONTENT, buf[i + len(END_THINK) :]
                return True
            keep = 0 if final else _partial_marker(buf, END_THINK)
            self._say_reasoning(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        if self._mode is _Mode.CONTENT:
            return self._content_step(buf, final)
        return self._block_step(final)

    def _content_step(self, buf: str, final: bool) -> bool:
        if self._after_block:
            buf = self._buf = buf.lstrip()
            if not buf:
                return False
            self._after_block = False
        if self._block_type is None:
            self._say_content(buf)
            self._buf = ""
            return False
        start = self._block_type.start
        i = buf.find(start)
        if i >= 0:
            before = buf[:i]
            kept = before.rstrip()
            self._say_content(kept)
            self._block = self._block_type(len(self._calls))
            self._block_prefix = before[len(kept) :] + start
            self._mode, self._buf = _Mode.BLOCK, buf[i + len(start) :]
            return True
        # hold back a possible beginning of the marker and the whitespace before it (dropped if a block follows)
        end = len(buf) if final else len(buf[: len(buf) - _partial_marker(buf, start)].rstrip())
        self._say_content(buf[:end])
        self._buf = buf[end:]
        return False

    def _block_step(self, final: bool) -> bool:
        block = self._block
        assert block is not None
        deltas = block.feed(self._buf)
        self._buf = ""
        if final and not (block.closed or block.failed):
            deltas += block.fail()
        self._say_calls(deltas)
        if not (block.closed or block.failed):
            return False
        if block.failed:  # give the raw text back: all of it if no call was streamed, else what was not parsed
            self._say_content(block.buf if block.calls else self._block_prefix + block.fed[: len(block.fed) - len(block.rest)])
        self._after_block = block.closed
        self._mode, self._buf, self._block = _Mode.CONTENT, block.rest, None
        return True

    def _say_reasoning(self, text: str) -> None:
        self._reasoning.append(text)
        self._delta.reasoning += text

    def _say_content(self, text: str) -> None:
        self._content.append(text)
        self._delta.content += text

    def _say_calls(self, deltas: list[ToolCallDelta]) -> None:
        for d in deltas:
            if d.id is not None:
                self._calls.append(ParsedToolCall(d.id, d.name or "", d.arguments))
            else:
                self._calls[d.index].arguments += d.arguments
            pending = self._delta.tool_calls
            if pending and pending[-1].index == d.index and d.id is None:
                pending[-1].arguments += d.arguments  # one delta per call per chunk
            else:
                pending.append(replace(d))

    def _take(self) -> ChatDelta:
        delta, self._delta = self._delta, ChatDelta()
        return delta


def parse_chat_output(prompt_text: str, text: str, *, reasoning: bool = True, tool_parser: str | None = "deepseek_v4") -> ParsedChat:
    """The fields of a finished completion's text (``feed`` + ``finish`` + ``result``)."""
    parser = ChatOutputParser(prompt_text, reasoning=reasoning, tool_parser=tool_parser)
    parser.feed(text)
    parser.finish()
    return parser.result()

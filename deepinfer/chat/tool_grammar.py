"""Forced tool calls: ``tool_choice`` checked, and the grammar that makes the reply be the calls.

Entry point: ``tool_call_constraint(tool_format, tools, tool_choice,
parallel_tool_calls)``; every wire API (Chat Completions, Responses, Anthropic
Messages) and ``LLM.chat`` go through it. With ``"required"`` or a named
function it returns a ``StructuredOutputsParams`` holding an xgrammar structural
tag: the reply is one call (``parallel_tool_calls`` false) or one or more calls
(true, OpenAI's default) in the chat format's exact syntax, each call's
arguments matching its tool's JSON schema, only the named function when one is
named, then the end of the sequence. It is marked ``after_reasoning``: when the
prompt opened reasoning (``<think>``) the reasoning stays free and the grammar
starts after ``</think>`` (a thinking budget closes it). ``"auto"``, ``"none"``
and no ``tool_choice`` constrain nothing (None).

The formats (``TOOL_CALL_FORMATS``, what ``--tool-call-parser`` names):

- ``hermes``, the bundled template's: ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``, calls
  separated by a newline;
- ``deepseek_v4``, DSML: a ``<｜DSML｜tool_calls>`` block of ``invoke`` elements, one ``parameter``
  element per argument (strings raw with ``string="true"``, other values as JSON), as
  ``deepinfer.chat.deepseek_v4`` writes them.

Every problem is an ``InvalidRequestError`` naming ``tool_choice`` or ``tools``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..sampling_params import InvalidRequestError, StructuredOutputsParams
from ..structured_output.json_schema import prepare_json_schema
from ..structured_output.sources import compiler_message
from ..structured_output.xgrammar_import import import_xgrammar
from .deepseek_v4 import DSML
from .formats import ChatFormat, JinjaFormat

HERMES = "hermes"
DEEPSEEK_V4 = "deepseek_v4"
#: the tool-call formats a reply can be parsed from and forced into
TOOL_CALL_FORMATS: tuple[str, ...] = (DEEPSEEK_V4, HERMES)

_CHOICE_SHAPE = "'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}"


def tool_call_format(fmt: ChatFormat | None) -> str:
    """The tool-call format a chat format writes: ``hermes`` for a Jinja template writing ``<tool_call>``
    JSON (and no DSML), else DeepSeek-V4's DSML."""
    if isinstance(fmt, JinjaFormat) and "<tool_call>" in str(fmt.template) and "DSML" not in str(fmt.template):
        return HERMES
    return DEEPSEEK_V4


@dataclass(frozen=True)
class ToolChoice:
    """A checked ``tool_choice``: ``mode`` is auto, none, required or named (then ``name`` is the function)."""

    mode: str
    name: str | None = None

    @property
    def forced(self) -> bool:
        """Whether the reply must be tool calls."""
        return self.mode in ("required", "named")


@dataclass(frozen=True)
class _Tool:
    name: str
    parameters: dict[str, Any]
    #: the arguments' grammar as the template's ``tojson`` spaces JSON: one space after each ``,`` and ``:``, no
    #: other whitespace (a model left free to pad can pad forever)
    arguments_ebnf: str


def parse_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> ToolChoice:
    """``tool_choice`` as sent (None, a string, or OpenAI's object in Chat's or Responses' shape), checked
    against the declared ``tools``."""
    if tool_choice is None or tool_choice == "auto":
        return ToolChoice("auto")
    if tool_choice == "none":
        return ToolChoice("none")
    if tool_choice == "required":
        choice = ToolChoice("required")
    elif isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tool_choice {tool_choice!r} names no function; give {_CHOICE_SHAPE}", "tool_choice")
        choice = ToolChoice("named", name)
    else:
        raise InvalidRequestError(f"tool_choice {tool_choice!r} is not one of {_CHOICE_SHAPE}", "tool_choice")
    if not tools:
        raise InvalidRequestError(
            f"tool_choice {tool_choice!r} forces a tool call but the request declares no tools; declare them in tools "
            "or use tool_choice 'auto' or 'none'", "tool_choice",
        )
    if choice.name is not None:
        names = [_tool(i, t).name for i, t in enumerate(tools)]
        if choice.name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {choice.name!r} but tools declares {', '.join(map(repr, names))}; "
                "name one of them", "tool_choice",
            )
    return choice


def tool_call_constraint(
    tool_format: str, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None = True,
) -> StructuredOutputsParams | None:
    """The constraint forcing the reply to be tool calls in ``tool_format`` (one of ``TOOL_CALL_FORMATS``),
    or None when ``tool_choice`` forces nothing; ``parallel_tool_calls`` None means True."""
    choice = parse_tool_choice(tool_choice, tools)
    if not choice.forced:
        return None
    if tool_format not in TOOL_CALL_FORMATS:
        raise InvalidRequestError(
            f"tool_choice {tool_choice!r} needs a tool-call format to force, and this server parses none; "
            f"start it with --tool-call-parser {' or '.join(TOOL_CALL_FORMATS)}", "tool_choice",
        )
    declared = [_tool(i, t) for i, t in enumerate(tools or ())]
    chosen = [t for t in declared if choice.name in (None, t.name)]
    tags = [_hermes_tag(t) if tool_format == HERMES else _dsml_tag(t) for t in chosen]
    calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
             "stop_after_first": parallel_tool_calls is False}
    if tool_format == DEEPSEEK_V4:
        calls = {"type": "tag", "begin": f"<{DSML}tool_calls>\n", "content": calls, "end": f"\n</{DSML}tool_calls>"}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": calls}, after_reasoning=True)


def _tool(i: int, tool: Any) -> _Tool:
    """Declared tool ``i`` (OpenAI's ``{"type": "function", "function": {...}}``, or the function itself)."""
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequestError(
            f"tools[{i}] is not a function declaration; give {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}",
            "tools",
        )
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise InvalidRequestError(f"tools[{i}] ({fn['name']}) has parameters that are not a JSON schema object", "tools")
    if params.get("type", "object") != "object":
        raise InvalidRequestError(f"tools[{i}] ({fn['name']}) parameters must describe a JSON object (type 'object'), "
                                  f"not type {params.get('type')!r}", "tools")
    try:
        prepared = prepare_json_schema(dict(params))
        ebnf = str(import_xgrammar().Grammar.from_json_schema(prepared, any_whitespace=False, separators=(", ", ": ")))
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"tools[{i}] ({fn['name']}) parameters: {exc}", "tools") from None
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidRequestError(f"tools[{i}] ({fn['name']}) parameters: invalid JSON schema: {compiler_message(exc)}", "tools") from None
    return _Tool(fn["name"], json.loads(prepared), ebnf)


def _hermes_tag(tool: _Tool) -> dict[str, Any]:
    """``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>``, spaced as the bundled template writes it."""
    head = '<tool_call>{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
    return {"type": "tag", "begin": head, "content": {"type": "grammar", "grammar": tool.arguments_ebnf}, "end": "}</tool_call>"}


def _dsml_tag(tool: _Tool) -> dict[str, Any]:
    """``<｜DSML｜invoke name="NAME">`` and one DSML ``parameter`` element per argument, as the V4 encoder writes."""
    return {"type": "tag", "begin": f'<{DSML}invoke name="{tool.name}">\n',
            "content": {"type": "json_schema", "json_schema": tool.parameters, "style": "deepseek_xml", "max_whitespace_cnt": 1},
            "end": f"\n</{DSML}invoke>"}

"""What a chat request asks of the reply's shape, as the engine enforces it: forced tool calls
(``tool_choice``) and the thinking budget.

``tool_constraint`` is the grammar of ``deepinfer.chat.tool_grammar`` for a body
whose ``tool_choice`` is ``"required"`` or names a function. ``thinking_budget``
reads the budget as clients spell it: ``thinking_token_budget`` (vLLM),
``thinking_budget`` (SGLang) or ``chat_template_kwargs.thinking_budget``; two
spellings that disagree are refused. The Responses and Anthropic APIs set
``thinking_token_budget`` on the chat body they map onto.
"""

from __future__ import annotations

from typing import Any

from ..chat.tool_grammar import parse_tool_choice, tool_call_constraint
from ..sampling_params import INT32_MAX, InvalidRequestError, StructuredOutputsParams
from .protocol import ChatCompletionRequest


def tool_parser(body: ChatCompletionRequest, server_parser: str | None) -> str | None:
    """The tool-call format parsed from the reply (``server_parser``), or None when no call may be made
    (no tools, or ``tool_choice`` ``"none"``: call markup stays content); a bad ``tool_choice`` is refused."""
    choice = parse_tool_choice(body.tool_choice, body.tools)
    if not body.tools or choice.mode == "none":
        return None
    return server_parser


def tool_constraint(body: ChatCompletionRequest, server_parser: str | None) -> StructuredOutputsParams | None:
    """The grammar forcing the reply to be tool calls in the server's format (None: nothing forced)."""
    return tool_call_constraint(server_parser or "", body.tools, body.tool_choice, body.parallel_tool_calls)


def thinking_budget(body: ChatCompletionRequest) -> int | None:
    """The reasoning tokens after which the engine closes the reasoning, however the body spells it."""
    kwargs = body.chat_template_kwargs or {}
    given = [(name, value) for name, value in (
        ("thinking_token_budget", body.thinking_token_budget),
        ("thinking_budget", body.thinking_budget),
        ("chat_template_kwargs.thinking_budget", kwargs.get("thinking_budget")),
    ) if value is not None]
    for name, value in given:
        _check(name, value)
    if len({v for _, v in given}) > 1:
        names = " and ".join(n for n, _ in given)
        raise InvalidRequestError(f"{names} disagree ({', '.join(str(v) for _, v in given)}); give the thinking budget once", given[1][0])
    return given[0][1] if given else None


def _check(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
        raise InvalidRequestError(f"{name} must be a non-negative integer (reasoning tokens), got {value!r}", name)

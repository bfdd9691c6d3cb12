"""The DeepSeek-V4 chat format, which the checkpoints ship as a Python encoder instead of a Jinja template.

Written from the format's description in DeepSeek's V4 release (``encoding/``), as
vLLM and SGLang carry it. A conversation becomes one string, with no whitespace
between the pieces::

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜><｜User｜>{user}<｜Assistant｜><think>

- BOS first; a system message is its plain content.
- A user turn is ``<｜User｜>`` + content. When an assistant turn follows it, or
  nothing does (the generation prompt), ``<｜Assistant｜>`` comes next and then
  ``<think>`` in thinking mode or ``</think>`` in non-thinking mode.
- An assistant turn is ``{reasoning}</think>`` (thinking mode, see below), its
  content, its tool calls, then ``<｜end▁of▁sentence｜>``.
- Thinking of earlier turns is dropped: in thinking mode only assistant turns
  after the last user turn keep their reasoning, and the user turns before the
  last one are followed by ``</think>``, as if answered without thinking
  (``drop_thinking=False`` keeps all reasoning and puts ``<think>`` after every
  user turn). Non-thinking mode never renders reasoning.
- Tool results (role ``tool``) become ``<tool_result>{content}</tool_result>``
  blocks in a user turn, ordered like the calls they answer; consecutive user
  turns merge, their parts joined by a blank line. Assistant tool calls are a
  ``<｜DSML｜tool_calls>`` block after the content.
- A ``developer`` turn renders like a user turn; in thinking mode the ones before
  the last user turn are dropped.

Not supported (a ChatFormatError says so): declaring ``tools`` and
``reasoning_effort="max"``. Both insert fixed instruction texts of the release
into the prompt, which deepinfer does not carry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import ChatFormatError
from .messages import Message, ToolCall

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"

#: the tokens a tokenizer must have (as single ids) for this format
CHAT_TOKENS = (BOS, EOS, USER, ASSISTANT, THINK, END_THINK)

#: reasoning_effort values that add nothing to the prompt (vLLM maps OpenAI's values this way); "none" turns thinking off
_PLAIN_EFFORTS = (None, "none", "minimal", "low", "medium", "high")
_MAX_EFFORTS = ("max", "xhigh")


@dataclass
class _Turn:
    """A rendered unit: a merged user turn (its text and tool-result blocks) or any other message."""

    role: str
    parts: list[tuple[str, str]]  # user turns: ("text" | "tool_result", text); others: one ("text", content)
    message: Message | None = None  # the assistant / system / developer message itself
    result_ids: list[str | None] | None = None  # per part of a user turn: the tool_call_id of a tool result


def encode(
    conversation: list[Message],
    *,
    thinking: bool = False,
    drop_thinking: bool = True,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt text of ``conversation`` in the DeepSeek-V4 format (BOS included)."""
    turns = _sort_tool_results(_merge_user_turns(conversation))
    last_user = _last_user_index(turns)
    if thinking and drop_thinking:
        turns = [t for i, t in enumerate(turns) if not (t.role == "developer" and i < last_user)]
        last_user = _last_user_index(turns)
    out = [BOS]
    for i, turn in enumerate(turns):
        final = i == len(turns) - 1
        if turn.role == "assistant":
            keep_reasoning = thinking and (not drop_thinking or i > last_user)
            out.append(_assistant(turn.message, keep_reasoning, eos=not (final and continue_final_message)))
        elif turn.role == "system":
            out.append(turn.message.content)
        else:  # user or developer
            out.append(USER + "\n\n".join(_part_text(kind, text) for kind, text in turn.parts))
            follows = turns[i + 1].role if not final else None
            if follows == "assistant" or (final and add_generation_prompt):
                open_thinking = thinking and (not drop_thinking or i >= last_user)
                out.append(ASSISTANT + (THINK if open_thinking else END_THINK))
    return "".join(out)


def check_options(thinking: bool, reasoning_effort: Any, tools: Any) -> bool:
    """Refuse what this encoder does not render; return the thinking mode after ``reasoning_effort``."""
    if tools:
        raise ChatFormatError(
            "tool declarations (tools=...) are not supported by deepinfer's DeepSeek-V4 chat format; "
            "describe the tools in the system message, or use a checkpoint whose chat_template renders them"
        )
    if reasoning_effort in _MAX_EFFORTS:
        if thinking:
            raise ChatFormatError(
                f"reasoning_effort={reasoning_effort!r} is not supported by deepinfer's DeepSeek-V4 chat format; "
                "use 'high' or leave it unset"
            )
        return thinking
    if reasoning_effort not in _PLAIN_EFFORTS:
        raise ChatFormatError(f"reasoning_effort={reasoning_effort!r} is not one of {', '.join(map(str, _PLAIN_EFFORTS[1:]))}")
    return thinking and reasoning_effort != "none"


def _merge_user_turns(conversation: list[Message]) -> list[_Turn]:
    """Tool results join the user turn they are in (or open one); consecutive user messages merge."""
    turns: list[_Turn] = []
    for msg in conversation:
        if msg.role in ("user", "tool"):
            part = ("text" if msg.role == "user" else "tool_result", msg.content)
            call_id = msg.tool_call_id if msg.role == "tool" else None
            if turns and turns[-1].role == "user":
                turns[-1].parts.append(part)
                turns[-1].result_ids.append(call_id)
            else:
                turns.append(_Turn("user", [part], None, [call_id]))
        else:
            turns.append(_Turn(msg.role, [("text", msg.content)], msg))
    return turns


def _sort_tool_results(turns: list[_Turn]) -> list[_Turn]:
    """Within a user turn, put tool results in the order of the calls of the last assistant turn that made calls."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.message.tool_calls:
            order = {c.id: j for j, c in enumerate(turn.message.tool_calls) if c.id}
        elif turn.role == "user" and order:
            slots = [j for j, (kind, _) in enumerate(turn.parts) if kind == "tool_result"]
            if len(slots) > 1:
                ranked = sorted(slots, key=lambda j: order.get(turn.result_ids[j] or "", 0))
                parts = list(turn.parts)
                for slot, j in zip(slots, ranked):
                    parts[slot] = turn.parts[j]
                turn.parts = parts
    return turns


def _last_user_index(turns: list[_Turn]) -> int:
    return max((i for i, t in enumerate(turns) if t.role in ("user", "developer")), default=-1)


def _part_text(kind: str, text: str) -> str:
    return f"<tool_result>{text}</tool_result>" if kind == "tool_result" else text


def _assistant(msg: Message, keep_reasoning: bool, eos: bool) -> str:
    reasoning = (msg.reasoning or "") + END_THINK if keep_reasoning else ""
    calls = ""
    if msg.tool_calls:
        invokes = "\n".join(_invoke(c) for c in msg.tool_calls)
        calls = f"\n\n<{DSML}tool_calls>\n{invokes}\n</{DSML}tool_calls>"
    return reasoning + msg.content + calls + (EOS if eos else "")


def _invoke(call: ToolCall) -> str:
    """One call in DSML: each argument a parameter, strings as is, anything else as JSON."""
    params = "\n".join(
        f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
        f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}</{DSML}parameter>"
        for key, value in call.arguments.items()
    )
    return f'<{DSML}invoke name="{call.name}">\n{params}\n</{DSML}invoke>'

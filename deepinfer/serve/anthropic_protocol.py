"""The bodies of ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Anthropic Messages), validated
once by pydantic. Content blocks stay dicts: ``anthropic`` checks each as it maps it onto a chat message, so a
bad block's refusal names its message."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..sampling_params import INT32_MAX
from .protocol import _Body


class ThinkingConfig(_Body):
    """``thinking``: ``enabled`` with a ``budget_tokens`` (the engine closes the reasoning after it), ``adaptive``
    (thinking with no budget), or ``disabled``."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=INT32_MAX)


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(..., alias="schema")


class OutputConfig(_Body):
    """``output_config``: the reasoning effort (the chat format's ``reasoning_effort``) and a JSON schema the text follows."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(_Body):
    user_id: str | None = None


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    #: the engine's own (as vLLM's): passed to the chat template; ``thinking`` sets ``thinking`` over it
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1, le=INT32_MAX)
    metadata: Metadata | None = None
    stream: bool = False

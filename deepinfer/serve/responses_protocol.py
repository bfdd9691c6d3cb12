"""The body of ``POST /v1/responses`` (OpenAI Responses), validated once by pydantic.

Input items stay dicts here: ``responses`` checks each one as it maps it onto a chat message, so a bad item's
refusal names its position. Fields the server does not act on (``include``, ``user``, ``service_tier``,
``prompt_cache_key``, ...) are ignored, as unknown fields are everywhere.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..sampling_params import INT32_MAX, SEED_MAX, SEED_MIN
from .protocol import StructuredOutputs, _Body

#: the reasoning efforts OpenAI defines; ``none`` and ``minimal`` turn thinking off
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class TextFormat(_Body):
    """``text.format``: plain text, any JSON object, or JSON matching ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    """``reasoning``: ``effort`` turns thinking on (or off with ``none``/``minimal``); summaries are not written."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    #: the engine's own, as vLLM accepts them beside OpenAI's
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    structured_outputs: StructuredOutputs | None = None
    stream: bool = False
    #: keep the response (in memory, the newest ``STORED_RESPONSES``) for ``GET`` and ``previous_response_id``
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    #: stored prompt templates and conversations live on OpenAI's side: refused when given
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    user: str | None = None
    #: the engine's own (as vLLM's): passed to the chat template; ``reasoning.effort`` sets ``thinking`` over it
    chat_template_kwargs: dict[str, Any] | None = None

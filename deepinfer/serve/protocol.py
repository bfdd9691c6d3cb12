"""The request bodies the server accepts, in OpenAI's wire format, validated once by pydantic.

Fields OpenAI defines keep their names; the engine's own (``top_k``,
``min_p``, ``ignore_eos``, ``stop_token_ids``, ``structured_outputs`` and its
``guided_*`` spellings, ``cache_class``, ...) are accepted beside them, as vLLM
and SGLang do. Unknown fields are ignored, never rejected: routers add their own.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import INT32_MAX, SEED_MAX, SEED_MIN


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """The engine's own constraints (vLLM's ``structured_outputs``): exactly one of them."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class SamplingFields(_Body):
    """What completions and chat share: how to sample and when to stop."""

    model: str | None = None
    n: int = Field(1, ge=1)
    #: vLLM's: generate ``best_of`` and return the ``n`` best; honoured when it equals ``n`` (every one is returned)
    best_of: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    #: token id -> bias; only an empty mapping is served (the sampler adds no per-token bias)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    cache_class: str | None = None
    user: str | None = None
    #: disaggregated serving (vLLM's router protocol): to a prefill server ``{"do_remote_decode": true, ...}``; to a
    #: decode server, the prefill server's answer, unchanged
    kv_transfer_params: dict[str, Any] | None = None
    #: disaggregated serving (SGLang's router protocol): where the prefill server's rendezvous is, and the pair's room
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    #: vLLM's: the top log-probabilities of each prompt token, in each choice's ``prompt_logprobs``
    prompt_logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    #: reasoning tokens after which the engine closes the reasoning (vLLM's spelling; SGLang's below)
    thinking_token_budget: int | None = Field(None, ge=0, le=INT32_MAX)
    thinking_budget: int | None = Field(None, ge=0, le=INT32_MAX)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    include_reasoning: bool = True


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    #: with ``messages``: rendered as ``/v1/chat/completions`` renders them
    tools: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

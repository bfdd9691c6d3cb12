"""The server's request models bounded by the engine's ``RequestLimits``.

Each app builds its bodies here from the limits it serves under, so pydantic
refuses a value past a bound with a 400 naming the field and the limit, and
``/openapi.json`` states the same numbers (``maximum``, ``maxItems``,
``maxLength``) for clients and API fuzzers to read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, StringConstraints, create_model

from ..request_limits import RequestLimits
from ..sampling_params import INT32_MAX
from .anthropic_protocol import CountTokensRequest, MessagesRequest
from .protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from .responses_protocol import ResponsesRequest

#: the field a bound is on -> the server flag that raises it (a refusal's message names it)
RAISED_BY = {"n": "--max-n", "best_of": "--max-n", "logprobs": "--max-logprobs", "top_logprobs": "--max-logprobs",
             "prompt_logprobs": "--max-logprobs"}


@dataclass(frozen=True)
class RequestModels:
    """The bodies of one app's endpoints."""

    completion: type[CompletionRequest]
    chat: type[ChatCompletionRequest]
    tokenize: type[TokenizeRequest]
    responses: type[ResponsesRequest]
    messages: type[MessagesRequest]
    count_tokens: type[CountTokensRequest]


def request_models(limits: RequestLimits) -> RequestModels:
    """Every endpoint's body (completions, chat, tokenize, Responses, Anthropic Messages) with ``limits`` as constraints."""
    stop_text = Annotated[str, StringConstraints(max_length=limits.max_stop_chars)]
    stop_list = Annotated[list[stop_text], Field(max_length=limits.max_stop_strings)]
    prompts_text = Annotated[list[str], Field(max_length=limits.max_prompts)]
    prompts_ids = Annotated[list[list[int]], Field(max_length=limits.max_prompts)]

    def sampling() -> dict[str, Any]:
        return dict(
            n=(int, Field(1, ge=1, le=limits.max_n)),
            best_of=(int | None, Field(None, ge=1, le=limits.max_n)),
            stop=(stop_text | stop_list | None, None),
            stop_token_ids=(list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None, Field(None, max_length=limits.max_stop_token_ids)),
            logit_bias=(dict[str, float] | None, Field(None, max_length=limits.max_logit_bias)),
        )

    def logprobs() -> Any:
        return Field(None, ge=0, le=limits.max_logprobs)

    def conversation() -> dict[str, Any]:
        return dict(
            messages=(list[dict[str, Any]], Field(..., max_length=limits.max_messages)),
            tools=(list[dict[str, Any]] | None, Field(None, max_length=limits.max_tools)),
        )

    completion = create_model(
        "CompletionRequest", __base__=CompletionRequest, __module__=__name__, **sampling(),
        prompt=(str | prompts_text | list[int] | prompts_ids, ...),
        logprobs=(int | None, logprobs()), prompt_logprobs=(int | None, logprobs()),
    )
    chat = create_model(
        "ChatCompletionRequest", __base__=ChatCompletionRequest, __module__=__name__, **sampling(), **conversation(),
        top_logprobs=(int | None, logprobs()),
    )
    tokenize_conversation = conversation()
    tokenize_conversation["messages"] = (list[dict[str, Any]] | None, Field(None, max_length=limits.max_messages))
    tokenize = create_model("TokenizeRequest", __base__=TokenizeRequest, __module__=__name__, **tokenize_conversation)
    responses = create_model(
        "ResponsesRequest", __base__=ResponsesRequest, __module__=__name__,
        input=(str | Annotated[list[dict[str, Any]], Field(max_length=limits.max_messages)], ...),
        tools=(list[dict[str, Any]] | None, Field(None, max_length=limits.max_tools)),
        stop=(stop_text | stop_list | None, None),
    )
    count_tokens = create_model("CountTokensRequest", __base__=CountTokensRequest, __module__=__name__, **conversation())
    messages = create_model(
        "MessagesRequest", __base__=MessagesRequest, __module__=__name__, **conversation(),
        stop_sequences=(stop_list | None, None),
    )
    return RequestModels(completion, chat, tokenize, responses, messages, count_tokens)

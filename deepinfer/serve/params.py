"""From an OpenAI request body to the engine's ``SamplingParams``, every problem naming its field."""

from __future__ import annotations

import json
from typing import Any

from ..request_limits import RequestLimits
from ..sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from .protocol import SamplingFields

#: OpenAI's default temperature (the engine's too)
DEFAULT_TEMPERATURE = 1.0


def structured_outputs(body: SamplingFields) -> StructuredOutputsParams | None:
    """The one output constraint a request asks for: ``response_format``, ``structured_outputs`` or a ``guided_*`` field."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        schema = rf.json_schema.schema_ if rf.json_schema is not None else None
        if schema is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema (a JSON schema object)", "response_format")
        found.append(("response_format", StructuredOutputsParams(json=schema)))
    so = body.structured_outputs
    if so is not None:
        given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar), ("choice", so.choice)) if v is not None}
        try:
            found.append(("structured_outputs", StructuredOutputsParams(**given, json_object=bool(so.json_object))))
        except InvalidRequestError as exc:
            raise InvalidRequestError(str(exc), "structured_outputs") from None
    guided = {"json": body.guided_json, "regex": body.guided_regex, "grammar": body.guided_grammar, "choice": body.guided_choice}
    for key, value in guided.items():
        if value is not None:
            found.append((f"guided_{key}", StructuredOutputsParams(**{key: value})))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(f"give one output constraint, not several ({names})", found[1][0])
    if not found:
        return None
    name, params = found[0]
    if params.json is not None and isinstance(params.json, str):
        try:
            json.loads(params.json)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{name}: the JSON schema is not valid JSON ({exc.msg})", name) from None
    return params


def constraint_field(body: SamplingFields) -> str | None:
    """The field carrying the request's output constraint, if any (what a refused constraint's error names)."""
    if body.response_format is not None and body.response_format.type != "text":
        return "response_format"
    if body.structured_outputs is not None:
        return "structured_outputs"
    return next((f"guided_{k}" for k in ("json", "regex", "grammar", "choice") if getattr(body, f"guided_{k}") is not None), None)


def sampling_params(
    body: SamplingFields, limits: RequestLimits, *, max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None,
    tool_constraint: StructuredOutputsParams | None = None, thinking_budget: int | None = None,
) -> SamplingParams:
    """The engine's parameters for ``body``, generating at most ``max_tokens``, within ``limits``;
    ``tool_constraint``: the grammar of forced tool calls (never together with an output constraint);
    ``thinking_budget``: reasoning tokens before the engine closes the reasoning."""
    constraint = structured_outputs(body)
    if tool_constraint is not None:
        if constraint is not None:
            raise InvalidRequestError(
                f"tool_choice forces a tool call, which cannot be combined with {constraint_field(body)}; "
                "drop one of them (tool_choice 'auto' lets the model answer in the requested format)", "tool_choice",
            )
        constraint = tool_constraint
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError(
            f"best_of {body.best_of} with n {body.n} is not supported: every completion generated is returned; "
            "leave best_of out (or equal to n) and rank the n completions by their logprobs", "best_of",
        )
    if body.logit_bias:
        raise InvalidRequestError("logit_bias is not supported (the sampler adds no per-token bias); leave it out or send {}", "logit_bias")
    fields: dict[str, Any] = dict(
        n=body.n,
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        max_tokens=max_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        seed=body.seed,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        structured_outputs=constraint,
        thinking_budget=thinking_budget,
        cache_class=body.cache_class,
    )
    for name in ("top_p", "top_k", "min_p"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    params = SamplingParams(**fields)
    limits.check_params(params)
    return params


def served_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int, param: str = "max_tokens") -> int:
    """Tokens a request may generate: what it asked in ``param`` (refused when past the context), else the rest of the context."""
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return max(room, 1)
    if requested < 1:
        raise InvalidRequestError(f"{param} must be at least 1, got {requested}", param)
    if requested > room:
        raise InvalidRequestError(
            f"{param} is {requested} but the prompt has {num_prompt_tokens} tokens and the model's context is "
            f"{max_model_len}; at most {room} tokens can be generated: lower {param} or shorten the prompt",
            param,
        )
    return requested

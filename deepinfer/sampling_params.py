"""Per-request generation parameters, shaped like vLLM's so users' scripts carry over."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import DeepInferError

#: the widest token id or top-k any device's int32 index tensors hold
INT32_MAX = 2**31 - 1
#: seeds are 64-bit: signed or unsigned, as clients send them
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class InvalidRequestError(DeepInferError, ValueError):
    """A request whose prompt or parameters cannot be served; reported on that request only.

    ``param``: the request field at fault, when one is (a server names it in its error object)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _first_problem(exc: ValidationError, what: str) -> tuple[str, str]:
    """The first problem's field and its one-line description."""
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or what
    if err["type"] == "extra_forbidden":
        return field, f"unknown {what} '{field}'"
    msg = err["msg"].removeprefix("Value error, ")
    return field, f"invalid {what} '{field}' = {err.get('input')!r}: {msg}"


class _Validated(BaseModel):
    """Raises ``InvalidRequestError`` naming the field instead of pydantic's multi-line report."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    what: ClassVar[str] = "parameter"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            field, message = _first_problem(exc, self.what)
            raise InvalidRequestError(message, param=field) from None


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint: a JSON schema, any JSON object, a regex, an EBNF grammar, a choice or an
    xgrammar structural tag (``{"type": "structural_tag", "format": ...}``).

    ``after_reasoning``: the constraint starts where the reply's reasoning ends (``</think>``), leaving the
    reasoning free, as the forced tool calls of ``deepinfer.chat.tool_grammar`` want; by default it
    constrains the whole output."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    structural_tag: dict | str | None = None
    after_reasoning: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "grammar", "choice", "structural_tag") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError(
                "structured output: give exactly one of json, json_object, regex, grammar, choice, structural_tag "
                f"(got {', '.join(given) or 'none'})"
            )
        if self.choice is not None and not self.choice:
            raise InvalidRequestError("structured output: choice needs at least one option")


class SamplingParams(_Validated):
    """How to sample one request; invalid values raise ``InvalidRequestError`` on creation."""

    what: ClassVar[str] = "sampling parameter"

    n: int = Field(1, ge=1, description="completions of the prompt, sharing its prefill (at most the engine's max_n)")
    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, le=INT32_MAX, description="0 or -1 keeps every token")
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int = Field(16, ge=1)
    stop: list[str] = Field(default_factory=list, description="strings that end the output (not included in it)")
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="the request's own random stream (a 64-bit integer)")
    logprobs: int | None = Field(None, ge=0, description="top log-probabilities per output token (at most the engine's max_logprobs)")
    prompt_logprobs: int | None = Field(None, ge=0, description="top log-probabilities per prompt token (at most the engine's max_logprobs)")
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    thinking_budget: int | None = Field(
        None, ge=0, le=INT32_MAX,
        description="reasoning tokens after which the engine closes the reasoning (writes </think>) and the answer follows",
    )
    cache_class: str | None = Field(None, description="retention class of the KV store this request's prefix is kept under (None: the default class)")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("cache_class")
    @classmethod
    def _class_name(cls, v: str | None) -> str | None:
        from .kv_store.policy import check_class_name

        return v if v is None else check_class_name(v)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

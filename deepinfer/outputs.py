"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token at one position, from the full-precision logits."""

    logprob: float
    rank: int
    decoded_token: str | None = None


#: per position: token id -> Logprob (the chosen token always included)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    #: ``stop`` (EOS, stop string or stop token), ``length`` (max_tokens or max_model_len), ``abort``, or None while running
    finish_reason: str | None = None
    #: the stop string or token id that ended the output, if any
    stop_reason: str | int | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    #: None, or the one-line reason this request failed (its outputs are then empty)
    error: str | None = None
    #: tokens of the prompt served from the prefix cache
    num_cached_tokens: int = 0
    #: the error is the server's (a fault while serving it, a failed KV transfer), not the request's
    internal_error: bool = False
    extra: dict = field(default_factory=dict)

"""The bounds on every quantity a request multiplies, in one place for ``LLM``, the engine and the server.

A request's cost must not grow with its parameters past what the engine is
sized for: completions per prompt, log-probabilities per position, stop
strings, prompts per call, tools and messages. Each bound refuses with an
``InvalidRequestError`` naming the field, the value, the limit and the setting
that raises it; the server's request models carry the same numbers, so its
OpenAPI schema states them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import EngineConfig
from .sampling_params import InvalidRequestError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for. ``max_n`` and ``max_logprobs`` come from the engine's configuration
    (``--max-n``, ``--max-logprobs``); the rest are fixed here, far above any real client's use."""

    max_n: int = 64
    max_logprobs: int = 20
    #: stop strings per request, and characters in each
    max_stop_strings: int = 64
    max_stop_chars: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    #: prompts in one ``/v1/completions`` call (each becomes ``n`` sequences)
    max_prompts: int = 256
    max_tools: int = 256
    max_messages: int = 4096

    @classmethod
    def from_config(cls, config: EngineConfig) -> "RequestLimits":
        return cls(max_n=config.max_n if config.max_n is not None else config.max_num_seqs, max_logprobs=config.max_logprobs)

    def check_params(self, params: SamplingParams) -> None:
        """Refuse parameters past a bound (the first one found, naming its field)."""
        check_at_most("n", params.n, self.max_n, "max_n")
        if params.logprobs is not None:
            check_at_most("logprobs", params.logprobs, self.max_logprobs, "max_logprobs")
        if params.prompt_logprobs is not None:
            check_at_most("prompt_logprobs", params.prompt_logprobs, self.max_logprobs, "max_logprobs")
        check_at_most("stop", len(params.stop), self.max_stop_strings, what="stop strings")
        longest = max((len(s) for s in params.stop), default=0)
        check_at_most("stop", longest, self.max_stop_chars, what="characters in a stop string")
        check_at_most("stop_token_ids", len(params.stop_token_ids), self.max_stop_token_ids, what="stop token ids")


def check_at_most(field: str, value: int, limit: int, setting: str | None = None, what: str | None = None) -> None:
    """Refuse ``value`` above ``limit``: the message names the field, both numbers and, where a setting
    raises the limit, that setting (``max_n`` is the ``--max-n`` flag and the ``LLM(max_n=...)`` keyword)."""
    if value <= limit:
        return
    subject = f"{field} is {value}" if what is None else f"{field} has {value} {what}"
    fix = f"; lower {field}" if what is None else "; send fewer"
    if setting is not None:
        fix += f", or raise {setting} (--{setting.replace('_', '-')})"
    raise InvalidRequestError(f"{subject} but at most {limit} are allowed{fix}", field)

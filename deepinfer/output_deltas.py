"""What a request gained since its last delta: new token ids, new text, new log-probabilities, the finish.

A streaming caller (the server's engine process) takes these instead of whole outputs: a delta is cut
straight from the engine's requests, so the work per step is proportional to what the step added, not
to what each reply holds so far. ``apply_delta`` grows a cumulative ``RequestOutput`` from them in place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput


@dataclass
class CompletionDelta:
    """What one completion gained: its text from ``text_start`` on is ``text`` (a stop string cut at the
    end can shorten it), plus the new tokens and their log-probabilities."""

    index: int
    text_start: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None


@dataclass
class OutputDelta:
    """What one request (all its completions) gained in a step."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0
    #: sent once, with the delta that finishes the request
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    #: prefill role: where a decode server fetches its state from
    kv_transfer_params: dict[str, Any] | None = None
    #: the error is the server's (a failed KV transfer, a fault while serving it), not the request's
    server_error: bool = False
    #: sent with the finishing delta: seconds the request waited in the engine before its first step, and
    #: seconds from its arrival there to its end
    queue_seconds: float | None = None
    engine_seconds: float | None = None

    def add_finish(self, prompt_token_ids: list[int], prompt_logprobs: list[PositionLogprobs | None] | None,
                   metrics: RequestMetrics | None) -> None:
        """The fields only the finishing delta carries: the prompt's ids and log-probabilities, the timings."""
        self.prompt_token_ids, self.prompt_logprobs = prompt_token_ids, prompt_logprobs
        if metrics is not None:
            m = metrics
            self.queue_seconds = m.first_scheduled_time - m.arrival_time if m.first_scheduled_time is not None else None
            self.engine_seconds = (m.finished_time if m.finished_time is not None else time.monotonic()) - m.arrival_time


@dataclass
class SentSoFar:
    """How much of each completion of one request has gone out in deltas: characters and tokens."""

    chars: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def cut(self, k: int, index: int, text: str, token_ids: Sequence[int], logprobs: list[PositionLogprobs] | None,
            finish_reason: str | None, stop_reason: str | int | None) -> CompletionDelta:
        """Completion ``k``'s part not sent yet (``token_ids`` and ``logprobs`` sliced, never copied whole)."""
        while len(self.chars) <= k:
            self.chars.append(0)
            self.tokens.append(0)
        start = min(self.chars[k], len(text))
        n = self.tokens[k]
        delta = CompletionDelta(index, start, text[start:], list(token_ids[n:]),
                                logprobs[n:] if logprobs is not None else None, finish_reason, stop_reason)
        self.chars[k], self.tokens[k] = len(text), len(token_ids)
        return delta


def delta_of_output(out: RequestOutput, sent: SentSoFar) -> OutputDelta:
    """A delta cut from a snapshot (an engine that only has snapshots, such as the expert-parallel front)."""
    completions = [sent.cut(k, c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
                   for k, c in enumerate(out.outputs)]
    delta = OutputDelta(out.request_id, completions, out.finished, out.error, out.num_cached_tokens, server_error=out.internal_error)
    if out.finished:
        delta.add_finish(out.prompt_token_ids, out.prompt_logprobs, out.metrics)
    return delta


def apply_delta(out: RequestOutput | None, delta: OutputDelta) -> RequestOutput:
    """The request's output after ``delta`` (a new one on its first delta); grown in place (appends, no copies
    of what it already holds)."""
    if out is None:
        out = RequestOutput(delta.request_id, None, [], None, [], False)
    while len(out.outputs) < len(delta.completions):
        out.outputs.append(CompletionOutput(index=len(out.outputs), text="", token_ids=[]))
    for c, d in zip(out.outputs, delta.completions):
        c.index = d.index
        if d.text_start == len(c.text):
            c.text += d.text
        else:  # a stop string cut the end off
            c.text = c.text[: d.text_start] + d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(d.logprobs)
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    out.finished, out.error, out.num_cached_tokens = delta.finished, delta.error, delta.num_cached_tokens
    if delta.prompt_token_ids is not None:
        out.prompt_token_ids, out.prompt_logprobs = delta.prompt_token_ids, delta.prompt_logprobs
    if delta.kv_transfer_params is not None:
        out.extra["kv_transfer_params"] = delta.kv_transfer_params
    out.internal_error = out.internal_error or delta.server_error
    return out

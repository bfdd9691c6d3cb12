"""The engine in a process of its own: the server's event loop and the engine's stepping loop never share a GIL.

As in vLLM's engine core, the HTTP process sends requests, aborts and queries
over one pipe; the engine process applies them between steps, steps, and
sends back what each step changed as deltas (new tokens, new text, the finish)
rather than whole outputs, so a message stays small however long a reply grows.
Under expert parallelism this process is the front of the rank group.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ..errors import DeepInferError
from ..outputs import CompletionOutput, PositionLogprobs, RequestOutput
from ..sampling_params import SamplingParams
from ..stats import EngineLoad

#: seconds the idle engine waits for a message before checking its health again
IDLE_POLL_S = 0.5


# ----- server -> engine -----

@dataclass(frozen=True)
class Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Query:
    """``metrics`` (the engine's counters) or ``flush`` (forget unused cached prefixes)."""

    call_id: int
    what: str


@dataclass(frozen=True)
class Stop:
    pass


# ----- engine -> server -----

@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of the engine it drives."""

    max_model_len: int
    vocab_size: int
    model_type: str
    backend: str


@dataclass(frozen=True)
class Failed:
    """The engine could not start (or died): one line."""

    message: str


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
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0
    #: sent once, with the delta that finishes the request
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass(frozen=True)
class Admitted:
    """The engine took a request (``refusal`` None) or refused it on arrival."""

    request_id: str
    refusal: str | None


@dataclass
class StepOutputs:
    deltas: list[OutputDelta]
    load: EngineLoad


@dataclass(frozen=True)
class Answer:
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass
class _Sent:
    """How much of each completion of a request has been sent."""

    text: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def _delta(out: RequestOutput, sent: _Sent) -> OutputDelta:
    if not sent.text:
        sent.text = [0] * len(out.outputs)
        sent.tokens = [0] * len(out.outputs)
    completions = []
    for k, c in enumerate(out.outputs):
        start = min(sent.text[k], len(c.text))
        n = sent.tokens[k]
        completions.append(CompletionDelta(
            c.index, start, c.text[start:], c.token_ids[n:], c.logprobs[n:] if c.logprobs is not None else None,
            c.finish_reason, c.stop_reason,
        ))
        sent.text[k], sent.tokens[k] = len(c.text), len(c.token_ids)
    delta = OutputDelta(out.request_id, completions, out.finished, out.error, out.num_cached_tokens)
    if out.finished:
        delta.prompt_token_ids, delta.prompt_logprobs = out.prompt_token_ids, out.prompt_logprobs
    return delta


def apply_delta(out: RequestOutput | None, delta: OutputDelta) -> RequestOutput:
    """The request's output after ``delta`` (a new one on its first delta); updated in place."""
    if out is None:
        out = RequestOutput(delta.request_id, None, [], None, [], False)
    while len(out.outputs) < len(delta.completions):
        out.outputs.append(CompletionOutput(index=len(out.outputs), text="", token_ids=[]))
    for c, d in zip(out.outputs, delta.completions):
        c.index = d.index
        c.text = c.text[: d.text_start] + d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            c.logprobs = (c.logprobs or []) + d.logprobs
        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
    out.finished, out.error, out.num_cached_tokens = delta.finished, delta.error, delta.num_cached_tokens
    if delta.prompt_token_ids is not None:
        out.prompt_token_ids, out.prompt_logprobs = delta.prompt_token_ids, delta.prompt_logprobs
    return out


class _EngineLoop:
    """The engine process's loop: messages in between steps, deltas out after each."""

    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.sent: dict[str, _Sent] = {}
        self.stopping = False
        self.last_load = EngineLoad()

    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            busy = engine.has_unfinished
            try:
                if self.conn.poll(0 if busy else IDLE_POLL_S):
                    while not self.stopping and self.conn.poll():
                        self._apply(self.conn.recv())
            except EOFError:  # the server process is gone: nobody is left to serve
                return
            if self.stopping:
                break
            if engine.has_unfinished:
                changed = engine.step()
                deltas = [self._take(engine.output(r)) for r in changed]
                engine.release([d.request_id for d in deltas if d.finished])
                self.last_load = engine.load()
                self.conn.send(StepOutputs(deltas, self.last_load))
            else:
                load = engine.load()
                if load != self.last_load:  # an abort emptied the engine: the server's gauges follow
                    self.last_load = load
                    self.conn.send(StepOutputs([], load))
                problem = engine.health()
                if problem is not None:
                    raise DeepInferError(problem)

    def _take(self, out: RequestOutput) -> OutputDelta:
        sent = self.sent.setdefault(out.request_id, _Sent())
        delta = _delta(out, sent)
        if out.finished:
            self.sent.pop(out.request_id, None)
        return delta

    def _apply(self, msg: Add | Abort | Query | Stop) -> None:
        engine = self.engine
        if isinstance(msg, Add):
            req = engine.add_request(msg.prompt, msg.params, request_id=msg.request_id)
            out = engine.output(req) if req.all_finished else None  # refused on arrival: its output carries the reason
            self.conn.send(Admitted(msg.request_id, out.error if out is not None else None))
            if out is not None:
                self.conn.send(StepOutputs([self._take(out)], engine.load()))
                engine.release([msg.request_id])
        elif isinstance(msg, Abort):
            engine.abort(msg.request_id)
            engine.release([msg.request_id])
            self.sent.pop(msg.request_id, None)
        elif isinstance(msg, Query):
            try:
                value = engine.get_metrics() if msg.what == "metrics" else engine.reset_prefix_cache()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self.conn.send(Answer(msg.call_id, error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            else:
                self.conn.send(Answer(msg.call_id, value))
        else:
            self.stopping = True

    def close(self) -> None:
        """Abort what is in flight and close the engine (its ranks, its store writes)."""
        for rid in list(self.sent):
            self.engine.abort(rid)
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()


def run_engine_process(config_json: str, conn: Connection, verbose: bool) -> None:
    """The engine process's entry point (spawned): build the engine, say ready, step until told to stop.
    A failure is one line to the server, then exit status 1."""
    from ..config import EngineConfig

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains and stops us
    log = logging.getLogger("deepinfer")
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("deepinfer: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    loop: _EngineLoop | None = None
    try:
        from ..parallel.engines import make_engine

        engine = make_engine(EngineConfig.model_validate_json(config_json))
        backend = getattr(engine, "backend", None)
        conn.send(EngineInfo(engine.max_model_len, engine.model_config.vocab_size, engine.model_config.model_type,
                             backend.name if backend is not None else engine.config.backend))
        loop = _EngineLoop(engine, conn)
        loop.run()
    except BaseException as exc:  # noqa: BLE001 - every failure becomes one line for the server
        if not isinstance(exc, (DeepInferError, KeyboardInterrupt)):
            log.exception("the engine failed")
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        try:
            conn.send(Failed(message))
        except OSError:
            pass
        sys.exit(1)
    finally:
        if loop is not None:
            try:
                loop.close()
            except Exception:  # noqa: BLE001 - a failed group is already stopped
                pass

"""The engine in a process of its own: the server's event loop and the engine's stepping loop never share a GIL.

As in vLLM's engine core, the HTTP process sends requests, aborts and queries
over one pipe; the engine process applies them between steps, steps, and
sends back what each step changed as deltas (new tokens, new text, the finish)
rather than whole outputs, so a message stays small however long a reply grows.
Under expert parallelism this process is the front of the rank group.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from deepinfer_interfaces.errors import first_line
from deepinfer_interfaces.kv_connector import KVConnectorError

from ..engine_client import EngineClient
from ..errors import DeepInferError, RankFailure
from ..kv_transfer.handoffs import Handoffs
from ..lifetime import die_with_parent
from ..kv_transfer.sequence_state import PrefilledRequest
from ..outputs import CompletionOutput, PositionLogprobs, RequestOutput
from ..sampling_params import SamplingParams
from ..stats import EngineLoad

log = logging.getLogger("deepinfer")

#: seconds the idle engine waits for a message before checking its health again
IDLE_POLL_S = 0.5
#: seconds the engine waits for a message when requests wait but nothing can run (a prefill engine's held states)
WAITING_POLL_S = 0.01


# ----- server -> engine -----

@dataclass(frozen=True)
class Add:
    request_id: str
    #: text, token ids, or a mapping with ``multi_modal_data`` (``deepinfer.prompts``)
    prompt: str | list[int] | dict[str, Any]
    params: SamplingParams
    #: prefill role: keep its cache when it finishes and publish it for a decode server
    hold_kv: bool = False
    #: decode role: where its prompt's state is (a prefill server's ``kv_transfer_params``)
    kv_transfer_params: dict[str, Any] | None = None


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
    #: prefill role: where a decode server fetches its state from
    kv_transfer_params: dict[str, Any] | None = None
    #: the error is the server's (a failed KV transfer), not the request's
    server_error: bool = False
    #: sent with the finishing delta: seconds the request waited in the engine before its first step, and
    #: seconds from its arrival there to its end
    queue_seconds: float | None = None
    engine_seconds: float | None = None


@dataclass(frozen=True)
class Admitted:
    """The engine took a request (``refusal`` None) or refused it on arrival."""

    request_id: str
    refusal: str | None
    #: the refusal is the engine's fault (500), not the request's (400)
    internal: bool = False


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
    delta = OutputDelta(out.request_id, completions, out.finished, out.error, out.num_cached_tokens, server_error=out.internal_error)
    if out.finished:
        delta.prompt_token_ids, delta.prompt_logprobs = out.prompt_token_ids, out.prompt_logprobs
        m = out.metrics
        if m is not None:
            delta.queue_seconds = m.first_scheduled_time - m.arrival_time if m.first_scheduled_time is not None else None
            delta.engine_seconds = (m.finished_time if m.finished_time is not None else time.monotonic()) - m.arrival_time
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
    if delta.kv_transfer_params is not None:
        out.extra["kv_transfer_params"] = delta.kv_transfer_params
    out.internal_error = out.internal_error or delta.server_error
    return out


class _EngineLoop:
    """The engine process's loop: messages in between steps, deltas out after each."""

    def __init__(self, engine: EngineClient, conn: Connection, handoffs: Handoffs | None = None, recompute: bool = False) -> None:
        self.engine = engine
        self.conn = conn
        self.handoffs = handoffs
        self.recompute = recompute
        self.sent: dict[str, _Sent] = {}
        self.stopping = False
        self.last_load = EngineLoad()
        #: decode role: requests whose state is being fetched
        self.fetching: dict[str, Add] = {}

    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            busy = engine.has_unfinished or bool(self.fetching)
            try:
                if self.conn.poll(0 if busy else IDLE_POLL_S):
                    while not self.stopping and self.conn.poll():
                        self._apply(self.conn.recv())
            except EOFError:  # the server process is gone: nobody is left to serve
                return
            if self.stopping:
                break
            if self.handoffs is not None:
                self._transfers()
            if engine.has_unfinished:
                changed = engine.step()
                if not changed and not engine.load().num_running:
                    self.conn.poll(WAITING_POLL_S)  # requests wait for held states to be released: do not spin
                deltas = [self._output_delta(r) for r in changed]
                for r, d in zip(changed, deltas):
                    if d.finished and r.hold_kv:
                        self._publish(d)
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

    def _transfers(self) -> None:
        """Fetched states become requests; what no decode server took in time is released."""
        handoffs = self.handoffs
        handoffs.expire()
        for request_id, prefilled, failure in handoffs.done():
            msg = self.fetching.pop(request_id, None)
            if msg is None:  # aborted while its state was on the way
                continue
            if failure is not None and self.recompute:
                log.warning("%s; computing the prompt here (--kv-load-failure-policy recompute)", failure)
                self.handoffs.stats.kv_transfers_recomputed += 1
                self._add(msg)
            elif failure is not None:
                self.conn.send(Admitted(request_id, None))
                self.conn.send(StepOutputs([OutputDelta(request_id, [], True, failure, server_error=True)], self.engine.load()))
            else:
                self._add(msg, prefilled)
        if self.fetching and not self.engine.has_unfinished:
            time.sleep(0.001)  # only transfers in flight: do not spin

    def _publish(self, delta: OutputDelta) -> None:
        """A prefill request finished: its state goes to the connector, its parameters into its last delta."""
        if delta.error is not None:
            self.engine.release_prefilled(delta.request_id)
            return
        try:
            delta.kv_transfer_params = self.handoffs.publish(self.engine, delta.request_id)
        except Exception as exc:  # noqa: BLE001 - the request fails, the server goes on
            delta.error, delta.server_error = f"publishing the KV state failed: {str(exc).splitlines()[0]}", True

    def _output_delta(self, req) -> OutputDelta:
        """What ``req`` gained this step (its prompt's ids sent once, at the end). A fault while building it
        (detokenizing, copying logprobs) fails that request alone, with a 500 for its client."""
        try:
            return self._take(self.engine.output(req, prompt_ids=req.all_finished))
        except Exception as exc:  # noqa: BLE001 - the request fails, the engine goes on
            log.exception("the output of request %s could not be built", req.request_id)
            self.engine.abort(req.request_id)
            self.sent.pop(req.request_id, None)
            return OutputDelta(req.request_id, [], True, f"internal error while building the request's output: {first_line(exc)}",
                               server_error=True)

    def _add(self, msg: Add, prefilled: PrefilledRequest | None = None) -> None:
        engine = self.engine
        roles = {"hold_kv": True} if msg.hold_kv else {"prefilled": prefilled} if prefilled is not None else {}
        try:
            req = engine.add_request(msg.prompt, msg.params, request_id=msg.request_id, **roles)  # the colocated call any engine takes
            out = engine.output(req) if req.all_finished else None  # refused on arrival (or done by its first token)
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - a fault while admitting one request refuses it alone
            log.exception("admitting request %s failed", msg.request_id)
            engine.abort(msg.request_id)
            engine.release([msg.request_id])
            self.conn.send(Admitted(msg.request_id, f"internal error while admitting the request: {first_line(exc)}", internal=True))
            return
        self.conn.send(Admitted(msg.request_id, out.error if out is not None else None, out is not None and out.internal_error))
        if out is not None:
            delta = self._take(out)
            if req.hold_kv and out.error is None:
                self._publish(delta)
            self.conn.send(StepOutputs([delta], engine.load()))
            engine.release([msg.request_id])

    def _take(self, out: RequestOutput) -> OutputDelta:
        sent = self.sent.setdefault(out.request_id, _Sent())
        delta = _delta(out, sent)
        if out.finished:
            self.sent.pop(out.request_id, None)
        return delta

    def _apply(self, msg: Add | Abort | Query | Stop) -> None:
        engine = self.engine
        if isinstance(msg, Add):
            if msg.kv_transfer_params is not None and self.handoffs is not None:
                self.fetching[msg.request_id] = msg
                self.handoffs.start_fetch(msg.request_id, msg.kv_transfer_params)
            else:
                self._add(msg)
        elif isinstance(msg, Abort):
            self.fetching.pop(msg.request_id, None)
            engine.abort(msg.request_id)
            engine.release([msg.request_id])
            self.sent.pop(msg.request_id, None)
        elif isinstance(msg, Query):
            try:
                if msg.what == "metrics":
                    value = engine.get_metrics()
                    value.update(self.handoffs.stats.as_dict() if self.handoffs is not None else {})
                else:
                    value = engine.reset_prefix_cache()
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
        if self.handoffs is not None:
            self.handoffs.close()
        self.engine.close()


@dataclass(frozen=True)
class TransferSettings:
    """A disaggregated server's connector: its plugin name, options and how long a published state waits."""

    connector: str
    options: dict[str, Any]
    timeout_s: float
    #: decode role: a failed fetch computes the prompt here instead of failing the request
    recompute: bool = False


def _handoffs(transfer: TransferSettings | None) -> Handoffs | None:
    if transfer is None:
        return None
    from ..registry import load_part

    cls = load_part("kv_connectors", transfer.connector)
    ok, why = cls.is_available()
    if not ok:
        raise DeepInferError(f"kv connector {transfer.connector!r} is unavailable: {why}")
    try:
        return Handoffs(cls({"timeout_s": transfer.timeout_s, **transfer.options}), transfer.timeout_s)
    except KVConnectorError as exc:
        raise DeepInferError(str(exc)) from None


def run_engine_process(config_json: str, conn: Connection, verbose: bool, transfer: TransferSettings | None = None) -> None:
    """The engine process's entry point (spawned): build the engine, say ready, step until told to stop.
    A failure is one line to the server, then exit status 1."""
    parent = multiprocessing.parent_process()  # the server, as it knew its own pid when it started us
    die_with_parent(parent.pid if parent is not None else None)  # a server SIGKILLed leaves no engine (nor ranks) behind
    from ..config import EngineConfig

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server drains and stops us
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
        from ..ranks.engines import make_engine

        engine = make_engine(EngineConfig.model_validate_json(config_json))
        handoffs = _handoffs(transfer)
        conn.send(EngineInfo(engine.max_model_len, engine.model_config.vocab_size, engine.model_config.model_type, engine.backend_name))
        loop = _EngineLoop(engine, conn, handoffs, transfer is not None and transfer.recompute)
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

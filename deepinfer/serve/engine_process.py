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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from deepinfer_interfaces.errors import first_line
from deepinfer_interfaces.kv_connector import KVConnectorError

from ..engine_client import EngineClient
from ..errors import DeepInferError, RankFailure
from ..kv_transfer.handoffs import Handoffs
from ..lifetime import die_with_parent
from ..kv_transfer.sequence_state import PrefilledRequest
from ..output_deltas import OutputDelta, SentSoFar
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


class _EngineLoop:
    """The engine process's loop: messages in between steps, deltas out after each."""

    def __init__(self, engine: EngineClient, conn: Connection, handoffs: Handoffs | None = None, recompute: bool = False) -> None:
        self.engine = engine
        self.conn = conn
        self.handoffs = handoffs
        self.recompute = recompute
        self.sent: dict[str, SentSoFar] = {}
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
        fails that request alone, with a 500 for its client."""
        try:
            return self._take(req)
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
            delta = self._take(req) if req.all_finished else None  # refused on arrival (or done by its first token)
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - a fault while admitting one request refuses it alone
            log.exception("admitting request %s failed", msg.request_id)
            engine.abort(msg.request_id)
            engine.release([msg.request_id])
            self.conn.send(Admitted(msg.request_id, f"internal error while admitting the request: {first_line(exc)}", internal=True))
            return
        self.conn.send(Admitted(msg.request_id, delta.error if delta is not None else None, delta is not None and delta.server_error))
        if delta is not None:
            if req.hold_kv and delta.error is None:
                self._publish(delta)
            self.conn.send(StepOutputs([delta], engine.load()))
            engine.release([msg.request_id])

    def _take(self, req) -> OutputDelta:
        """``req``'s delta since the last one sent (the engine cuts it from its requests)."""
        sent = self.sent.setdefault(req.request_id, SentSoFar())
        delta = self.engine.delta(req, sent)
        if delta.finished:
            self.sent.pop(req.request_id, None)
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

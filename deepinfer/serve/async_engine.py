"""The engine as the server's coroutines see it: submit a request, read its outputs as they grow.

The engine steps in a process of its own (``engine_process``). Requests, aborts
and queries go to it over a pipe and are applied between steps, so a new request
joins the running batch on the next step. What each step changed comes back as
deltas, read on the event loop when the pipe is readable, and each request's
stream is woken once per batch; a reader that falls behind sees only the latest
output (outputs are cumulative), so a slow client never slows the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ..errors import DeepInferError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..config import EngineConfig
from ..stats import EngineLoad
from ..output_deltas import OutputDelta, apply_delta
from .engine_launch import EngineLaunch, launch_engine
from .engine_process import Abort, Add, Admitted, Answer, EngineInfo, Failed, Query, StepOutputs, Stop, TransferSettings

log = logging.getLogger("deepinfer")

#: seconds the engine process gets to stop (abort, close its ranks) before it is killed
STOP_TIMEOUT_S = 30.0


class EngineDeadError(DeepInferError):
    """The engine failed (a rank died); no request can be served until the server restarts."""


class QueueFullError(DeepInferError):
    """More requests are waiting than the server queues (``--max-queued-requests``)."""


@dataclass
class StreamTiming:
    """Server-side times of one request: arrival, each delivery carrying new tokens, the end; and where its
    time went (``/metrics``' breakdown)."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    #: gaps between consecutive tokens as delivered (a delivery of k tokens after t seconds: k gaps of t / k)
    token_gaps: list[float] = field(default_factory=list)
    #: when its handler began (arrival minus this: the server's pre-processing: validation, rendering, tokenizing)
    received: float | None = None
    #: seconds it waited in the engine before its first step, and spent there in all (the engine's figures)
    queue: float | None = None
    in_engine: float | None = None
    #: seconds the server spent turning its outputs into response chunks
    postprocess: float = 0.0


class RequestStream:
    """One request's outputs as the event loop sees them: the latest snapshot, and a wake-up when it changes."""

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.latest: RequestOutput | None = None
        self.error: str | None = None
        self.timing = StreamTiming(arrival=time.monotonic())
        self._changed = asyncio.Event()
        self._tokens = 0
        #: called once when the request ends: its last output (None when it failed) and the failure
        self.on_finish: Callable[[RequestOutput | None, str | None], None] | None = None
        #: settled once the engine has taken the request: None (accepted) or the reason it was refused
        self._admission: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        #: the refusal was the engine's fault while admitting it (500), not the request's (400)
        self.refused_internally = False

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.latest is not None and self.latest.finished)

    def _apply(self, delta: OutputDelta, now: float) -> None:
        if delta.engine_seconds is not None:
            self.timing.queue, self.timing.in_engine = delta.queue_seconds, delta.engine_seconds
        self._deliver(apply_delta(self.latest, delta), now)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        tokens = sum(len(c.token_ids) for c in out.outputs)
        t = self.timing
        if tokens > self._tokens:
            if t.first_token is None:
                t.first_token = now
            elif t.last_token is not None:
                gap = (now - t.last_token) / (tokens - self._tokens)
                t.token_gaps.extend([gap] * (tokens - self._tokens))
            t.last_token = now
            self._tokens = tokens
        if out.finished:
            t.finished = now
        self.latest = out
        self._changed.set()
        if out.finished:
            self._ended(out, out.error)

    async def admitted(self) -> str | None:
        """Wait until the engine has taken the request (at its next step boundary); the reason it refused
        it on arrival (an output constraint that does not compile, ...), or None."""
        return await self._admission

    def _admit(self, refusal: str | None, internal: bool = False) -> None:
        self.refused_internally = internal
        if not self._admission.done():
            self._admission.set_result(refusal)

    def _ended(self, out: RequestOutput | None, error: str | None) -> None:
        callback, self.on_finish = self.on_finish, None
        if callback is not None:
            callback(out, error)

    def _fail(self, message: str) -> None:
        self._admit(None)  # a failure after acceptance: ``updates`` reports it
        self._ended(None, message)
        self.error = message
        self.timing.finished = time.monotonic()
        self._changed.set()

    async def updates(self) -> AsyncIterator[RequestOutput | None]:
        """Each new snapshot until the request finishes (None when it failed: ``error`` says why)."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self.error is not None:
                yield None
                return
            if self.latest is not None:
                yield self.latest
                if self.latest.finished:
                    return


class AsyncEngine:
    """The server's handle on the engine process; every method is called from the event loop.

    ``on_dead`` is called once when the engine fails (a rank died, the process exited): the server then
    answers 503 on ``/health`` and exits non-zero.
    """

    def __init__(self, config: EngineConfig, max_queued_requests: int, verbose: bool = True,
                 transfer: TransferSettings | None = None) -> None:
        self.config = config
        self.transfer = transfer
        self.max_queued_requests = max_queued_requests
        self.verbose = verbose
        self.on_dead: Any = None
        self.dead: str | None = None
        self.info: EngineInfo | None = None
        self.streams: dict[str, RequestStream] = {}
        self._load = EngineLoad()
        #: requests sent but not yet taken by the engine, with their completions (they count as waiting)
        self._unadmitted: dict[str, int] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ----- lifecycle -----

    def start_process(self, ready_timeout_s: float = 3600.0, launched: EngineLaunch | None = None) -> EngineInfo:
        """Spawn the engine process (or take ``launched``, spawned earlier for this engine's configuration) and
        wait (blocking) until its engine is built; a start-up failure raises with the engine's one-line reason."""
        if launched is None:
            launched = launch_engine(self.config.model_dump_json(), self.verbose, self.transfer)
        self._process, self._conn = launched.process, launched.conn
        mine = self._conn
        deadline = time.monotonic() + ready_timeout_s
        while not mine.poll(0.2):
            if not self._process.is_alive():
                raise DeepInferError(f"the engine process exited with status {self._process.exitcode} while starting")
            if time.monotonic() > deadline:
                self._process.kill()
                raise DeepInferError(f"the engine did not start within {ready_timeout_s:.0f} s")
        try:
            msg = mine.recv()
        except EOFError:
            self._process.join(5)
            raise DeepInferError(f"the engine process exited with status {self._process.exitcode} while starting") from None
        if isinstance(msg, Failed):
            self._process.join(10)
            raise DeepInferError(msg.message)
        self.info = msg
        return msg

    def start(self) -> None:
        """Begin reading the engine's messages on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._readable)
        # uvloop makes a watched socket non-blocking; a message larger than the socket's buffer (a step with
        # many completions' log-probabilities) then arrives in parts, and reading it must wait for the rest
        os.set_blocking(self._conn.fileno(), True)

    async def stop(self) -> None:
        """Abort what is left and stop the engine process (its ranks too)."""
        if self._loop is not None and self._conn is not None:
            self._loop.remove_reader(self._conn.fileno())
        if self._process is None:
            return
        if self._process.is_alive():
            try:
                self._conn.send(Stop())
            except OSError:
                pass
            await asyncio.get_running_loop().run_in_executor(None, self._process.join, STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)

    # ----- requests -----

    @property
    def load(self) -> EngineLoad:
        return self._load

    def submit(
        self, request_id: str, prompt: str | list[int] | dict[str, Any], params: SamplingParams, num_prompt_tokens: int, *,
        hold_kv: bool = False, kv_transfer_params: dict[str, Any] | None = None, received: float | None = None,
    ) -> RequestStream:
        """Send a request for the next step; raises when the engine is dead or too many completions wait.
        ``hold_kv`` (prefill role): publish its state when it finishes; ``kv_transfer_params`` (decode role):
        fetch its prompt's state from a prefill server first.

        The queue counts completions, not requests (a request with ``n`` completions is ``n`` sequences the
        engine keeps), so what waits is bounded whatever the requests' ``n``."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has failed ({self.dead}); the server is restarting")
        waiting = self._load.num_waiting + sum(self._unadmitted.values())
        if waiting and waiting + params.n > self.max_queued_requests:
            raise QueueFullError(
                f"the server has {waiting} completions waiting and this request adds {params.n}, past its limit "
                f"(--max-queued-requests {self.max_queued_requests}); retry later"
            )
        stream = RequestStream(request_id, num_prompt_tokens)
        stream.timing.received = received
        self.streams[request_id] = stream
        self._unadmitted[request_id] = params.n
        self._send(Add(request_id, prompt, params, hold_kv, kv_transfer_params))
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); its cache blocks are freed at the next step."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            stream._ended(None, "the request was aborted")
            self._send(Abort(request_id))

    def done(self, request_id: str) -> None:
        """The server has sent a finished request's last output."""
        self.streams.pop(request_id, None)

    async def query(self, what: str, timeout_s: float = 30.0) -> Any:
        """``metrics`` (the engine's counters) or ``flush`` (forget unused cached prefixes), between steps."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has failed ({self.dead})")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(Query(call_id, what))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def _send(self, msg: Any) -> None:
        try:
            self._conn.send(msg)
        except OSError as exc:
            self._die(f"the engine process is gone ({exc.strerror or exc})")
            raise EngineDeadError(f"the engine has failed ({self.dead})") from None

    # ----- the engine's messages -----

    def _readable(self) -> None:
        now = time.monotonic()
        try:
            while self._conn.poll():
                msg = self._conn.recv()
                try:
                    self._handle(msg, now)
                except Exception:  # noqa: BLE001 - one message's fault must not stop the reader
                    log.exception("handling the engine's message %s failed", type(msg).__name__)
        except (EOFError, OSError) as exc:
            self._loop.remove_reader(self._conn.fileno())
            self._process.join(5)
            if self._process.exitcode is None:  # alive, but its messages can no longer be read
                log.error("the connection to the engine process broke: %r", exc)
                self._process.kill()
                self._die(f"the connection to the engine process broke ({type(exc).__name__}: {exc})")
            else:
                self._die(f"the engine process exited with status {self._process.exitcode}")

    def _handle(self, msg: Any, now: float) -> None:
        if isinstance(msg, StepOutputs):
            self._load = msg.load
            streams = self.streams
            for delta in msg.deltas:
                stream = streams.get(delta.request_id)
                if stream is None:
                    continue
                try:
                    stream._apply(delta, now)
                except Exception as exc:  # noqa: BLE001 - this request fails alone; the engine is told to drop it
                    log.exception("applying an output of request %s failed", delta.request_id)
                    self.abort(delta.request_id)
                    stream._fail(f"internal error while receiving the request's output: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
        elif isinstance(msg, Admitted):
            self._unadmitted.pop(msg.request_id, None)
            stream = self.streams.get(msg.request_id)
            if stream is not None:
                stream._admit(msg.refusal, msg.internal)
        elif isinstance(msg, Answer):
            future = self._calls.get(msg.call_id)
            if future is not None and not future.done():
                if msg.error is not None:
                    future.set_exception(DeepInferError(msg.error))
                else:
                    future.set_result(msg.value)
        elif isinstance(msg, Failed):
            self._die(msg.message)

    def _die(self, message: str) -> None:
        if self.dead is not None:
            return
        self.dead = message
        log.error("engine failed: %s", message)
        for stream in list(self.streams.values()):
            if not stream.finished:
                stream._fail(f"the engine failed while serving this request: {message}")
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine has failed ({message})"))
        if self.on_dead is not None:
            self.on_dead(message)

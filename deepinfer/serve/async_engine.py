"""The engine behind a server: one thread steps it, coroutines submit requests and read their outputs.

The engine (one process, or the front of an expert-parallel group) is not
thread-safe, so every call into it happens on the stepping thread. Requests,
aborts and queries reach that thread through one queue and are applied between
steps, so a new request joins the running batch on the next step. After each
step the thread hands the snapshots of the requests that changed to the event
loop in one batch; a reader that falls behind sees only the latest snapshot
(snapshots are cumulative), so a slow client never slows the engine.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import DeepInferError
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..stats import EngineLoad

log = logging.getLogger("deepinfer")

#: seconds the idle stepping thread waits for work before checking the engine's health again
IDLE_POLL_S = 0.5


class EngineDeadError(DeepInferError):
    """The engine failed (a rank died); no request can be served until the server restarts."""


class QueueFullError(DeepInferError):
    """More requests are waiting than the server queues (``--max-queued-requests``)."""


@dataclass
class StreamTiming:
    """Server-side times of one request: arrival, each delivery carrying new tokens, the end."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    #: gaps between consecutive tokens as delivered (a delivery of k tokens after t seconds: k gaps of t / k)
    token_gaps: list[float] = field(default_factory=list)


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
        #: settled once the stepping thread has taken the request: None (accepted) or the reason it was refused
        self._admission: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.latest is not None and self.latest.finished)

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

    async def admitted(self) -> str | None:
        """Wait until the engine has taken the request (at its next step boundary); the reason it refused
        it on arrival (an output constraint that does not compile, ...), or None."""
        return await self._admission

    def _admit(self, refusal: str | None) -> None:
        if not self._admission.done():
            self._admission.set_result(refusal)

    def _fail(self, message: str) -> None:
        self._admit(None)  # a failure after acceptance: ``updates`` reports it
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


@dataclass
class _Add:
    stream: RequestStream
    prompt: str | list[int]
    params: SamplingParams


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(engine)`` on the stepping thread; its result or exception goes to ``future``."""

    fn: Callable[[Any], Any]
    future: asyncio.Future


class AsyncEngine:
    """Drives ``engine`` from a thread of its own; every public method is called from the event loop.

    ``on_dead`` is called (on the event loop) once, when the engine fails: the server then answers
    503 on ``/health`` and exits non-zero.
    """

    def __init__(self, engine: Any, max_queued_requests: int, on_dead: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_queued_requests = max_queued_requests
        self.on_dead = on_dead
        self.dead: str | None = None
        self.streams: dict[str, RequestStream] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ids = 0
        #: requests handed over but not yet taken by the stepping thread, and the engine's latest load
        self._unread = 0
        self._load = EngineLoad()
        self._outbox: list[tuple[RequestStream, RequestOutput, float]] = []
        self._outbox_lock = threading.Lock()
        self._delivery_scheduled = False

    # ----- lifecycle -----

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort what is left, stop the stepping thread and close the engine."""
        self._stopping.set()
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ----- requests -----

    @property
    def load(self) -> EngineLoad:
        return self._load

    def next_request_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}-{int(time.time() * 1000) % 100000:05d}"

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams, num_prompt_tokens: int) -> RequestStream:
        """Queue a request for the next step; raises when the engine is dead or the queue is full."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has failed ({self.dead}); the server is restarting")
        waiting = self._load.num_waiting + self._unread
        if waiting >= self.max_queued_requests:
            raise QueueFullError(
                f"the server has {waiting} requests waiting, its limit (--max-queued-requests {self.max_queued_requests}); retry later"
            )
        stream = RequestStream(request_id, num_prompt_tokens)
        self.streams[request_id] = stream
        self._unread += 1
        self._inbox.put(_Add(stream, prompt, params))
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away); its cache blocks are freed at the next step."""
        stream = self.streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            self._inbox.put(_Abort(request_id))

    def done(self, request_id: str) -> None:
        """The server has sent a finished request's last output."""
        self.streams.pop(request_id, None)

    async def call(self, fn: Callable[[Any], Any], timeout_s: float = 30.0) -> Any:
        """``fn(engine)`` run on the stepping thread between steps (metrics, cache flush)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine has failed ({self.dead})")
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(_Call(fn, future))
        return await asyncio.wait_for(future, timeout_s)

    # ----- the stepping thread -----

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping.is_set():
                self._take_inbox(wait=not engine.has_unfinished)
                if self._stopping.is_set():
                    break
                if engine.has_unfinished:
                    changed = engine.step()
                    outs = [(r.request_id, engine.output(r)) for r in changed]
                    self._publish(outs, time.monotonic())
                    engine.release([rid for rid, out in outs if out.finished])
                else:
                    problem = engine.health()
                    if problem is not None:
                        raise EngineDeadError(problem)
                self._load = engine.load()
        except Exception as exc:  # noqa: BLE001 - any failure of the engine ends the service, in one line
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if not isinstance(exc, DeepInferError):
                log.exception("the engine failed")
            self._loop.call_soon_threadsafe(self._die, message)
        finally:
            self._finish()

    def _take_inbox(self, wait: bool) -> None:
        """Apply every queued submission; with ``wait``, first wait a while for one (the engine is idle)."""
        try:
            item = self._inbox.get(timeout=IDLE_POLL_S) if wait else self._inbox.get_nowait()
            while item is not None:
                self._apply(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _apply(self, item: _Add | _Abort | _Call) -> None:
        engine = self.engine
        if isinstance(item, _Add):
            self._unread -= 1
            stream = item.stream
            req = engine.add_request(item.prompt, item.params, request_id=stream.request_id)
            out = engine.output(req) if req.all_finished else None  # refused on arrival: its output carries the reason
            self._loop.call_soon_threadsafe(stream._admit, out.error if out is not None else None)
            if out is not None:
                self._publish([(req.request_id, out)], time.monotonic())
                engine.release([req.request_id])
        elif isinstance(item, _Abort):
            engine.abort(item.request_id)
            engine.release([item.request_id])
        else:
            try:
                result = item.fn(engine)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self._loop.call_soon_threadsafe(_settle, item.future, None, exc)
            else:
                self._loop.call_soon_threadsafe(_settle, item.future, result, None)

    def _publish(self, outs: list[tuple[str, RequestOutput]], now: float) -> None:
        streams = self.streams
        with self._outbox_lock:
            for rid, out in outs:
                stream = streams.get(rid)
                if stream is not None:
                    self._outbox.append((stream, out, now))
            if self._outbox and not self._delivery_scheduled:
                self._delivery_scheduled = True
                self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._outbox_lock:
            batch, self._outbox = self._outbox, []
            self._delivery_scheduled = False
        for stream, out, now in batch:
            stream._deliver(out, now)

    def _finish(self) -> None:
        """The thread is ending: abort what is in flight and close the engine."""
        engine = self.engine
        try:
            for rid in list(self.streams):
                engine.abort(rid)
            close = getattr(engine, "close", None)
            if close is not None:
                close()
        except Exception:  # noqa: BLE001 - a dead group cannot be closed cleanly; its processes are already stopped
            log.debug("closing the engine failed", exc_info=True)

    def _die(self, message: str) -> None:
        self.dead = message
        log.error("engine failed: %s", message)
        for stream in list(self.streams.values()):
            if not stream.finished:
                stream._fail(f"the engine failed while serving this request: {message}")
        if self.on_dead is not None:
            self.on_dead(message)


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)

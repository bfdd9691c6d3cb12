"""Waiting on requests from a handler: every update of several streams, SSE framing, failures, aborts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request as HTTPRequest

from ..errors import DeepInferError
from ..outputs import RequestOutput
from ..sampling_params import InvalidRequestError
from .async_engine import AsyncEngine, RequestStream
from .metrics import ServerMetrics

DONE = b"data: [DONE]\n\n"
#: seconds between checks that a non-streaming client is still connected
DISCONNECT_POLL_S = 0.5


class RequestFailed(DeepInferError):
    """The engine could not finish a request (500): a rank died, or a kernel misbehaved."""


class ClientDisconnected(DeepInferError):
    """The client of a non-streaming request went away; its requests are aborted and nobody reads the reply."""


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def named_sse(event: str, obj: Any) -> bytes:
    """One server-sent event of type ``event`` carrying ``obj`` as JSON (the Responses and Anthropic streams)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def check_output(stream: RequestStream, out: RequestOutput | None) -> RequestOutput:
    """The snapshot, or the request's failure as an exception: refused on arrival (nothing generated) is
    the client's problem (400), a failure after that is the server's (500)."""
    if out is None:
        raise RequestFailed(stream.error or "the request failed")
    if out.error:
        if not out.internal_error and not any(c.token_ids for c in out.outputs):
            raise InvalidRequestError(out.error)
        raise RequestFailed(out.error)
    return out


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput | None]]:
    """``(which stream, snapshot)`` for every update of any of ``streams`` until all finish (None: it failed)."""
    if len(streams) == 1:
        async for out in streams[0].updates():
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        async for out in stream.updates():
            await queue.put((i, out))
        await queue.put((i, StopAsyncIteration))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out = await queue.get()
            if out is StopAsyncIteration:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def final_outputs(
    engine: AsyncEngine, streams: list[RequestStream], http: HTTPRequest, metrics: ServerMetrics
) -> list[RequestOutput]:
    """Each stream's last snapshot once all have finished; a client that disconnects meanwhile aborts them."""
    latest: list[RequestOutput | None] = [None] * len(streams)
    waiter = asyncio.ensure_future(_collect(streams, latest))
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
            if done:
                waiter.result()
                break
            if await http.is_disconnected():
                raise ClientDisconnected("the client disconnected before the reply")
    finally:
        waiter.cancel()
        release(engine, streams, metrics)
    return [check_output(s, out) for s, out in zip(streams, latest)]


async def _collect(streams: list[RequestStream], latest: list[RequestOutput | None]) -> None:
    async for i, out in merged(streams):
        latest[i] = out


def release(engine: AsyncEngine, streams: list[RequestStream], metrics: ServerMetrics) -> None:
    """The handler is done with its requests: abort those still running (the client left), forget the
    rest; either way their latencies and outcomes are counted."""
    for s in streams:
        out = s.latest
        reasons = [c.finish_reason for c in out.outputs] if out is not None and out.outputs and s.error is None else [None]
        if s.finished:
            engine.done(s.request_id)
        else:
            engine.abort(s.request_id)
            reasons = [None]
        metrics.observe(s.timing, reasons)


async def admit(engine: AsyncEngine, streams: list[RequestStream], metrics: ServerMetrics, constraint: str | None) -> None:
    """Wait until the engine has taken every request; one it refused on arrival is the client's error
    (400, before any response starts), naming ``constraint`` (the field of the output constraint) unless
    the reason names another field."""
    for s in streams:
        refusal = await s.admitted()
        if refusal is not None:
            release(engine, streams, metrics)
            if s.refused_internally:
                raise RequestFailed(refusal)
            raise InvalidRequestError(refusal, "cache_class" if refusal.startswith("cache_class") else constraint)

"""SGLang's prefill/decode rendezvous: the router sends one request to both servers with a ``bootstrap_room``;
the prefill server posts where the room's state is, the decode server asks the prefill server's bootstrap
port for it.

The prefill server answers ``GET /bootstrap/rooms/{room}`` on its bootstrap port (the same application,
one more listening socket), waiting up to ``wait`` seconds for the room's prefill to finish; the answer is
the ``kv_transfer_params`` the decode server fetches the state with. Rooms nobody asked for are forgotten
after the transfer timeout. The decode server asks in short waits (``ROOM_POLL_S``), each bounded, so a
prefill host that went away (its link down: no answer, no refusal) fails the request within seconds, not
after the whole wait.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..outputs import RequestOutput
from ..sampling_params import InvalidRequestError
from .async_engine import RequestStream
from .protocol import SamplingFields
from .streaming import RequestFailed

#: longest a decode server waits for its room's prefill to finish
ROOM_WAIT_S = 120.0
#: seconds a decode server gives the prefill server's bootstrap port to accept a connection, and to answer past a wait
ROOM_CONNECT_S = 5.0
#: a decode server asks for its room in waits this long (a lost prefill host is noticed within it plus ROOM_CONNECT_S)
ROOM_POLL_S = 2.0
#: how a room's answer starts when its prefill has not finished within the wait asked for
_NOT_YET = "the prefill of room"


@dataclass
class _Room:
    params: dict[str, Any] | None = None
    error: str | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    at: float = field(default_factory=time.monotonic)


class Rooms:
    """The prefill server's side: each room's ``kv_transfer_params`` (or why it has none), awaited by the decode side."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._rooms: dict[str, _Room] = {}

    def _room(self, room: str) -> _Room:
        self._expire()
        return self._rooms.setdefault(room, _Room())

    def post(self, room: str, params: dict[str, Any] | None, error: str | None = None) -> None:
        r = self._room(room)
        r.params, r.error, r.at = params, error, time.monotonic()
        r.ready.set()

    async def wait(self, room: str, timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
        """The room's parameters, or the reason there are none (its prefill failed, or did not finish in time)."""
        r = self._room(room)
        try:
            await asyncio.wait_for(r.ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            return None, f"{_NOT_YET} {room} did not finish within {timeout_s:g} s"
        self._rooms.pop(room, None)
        return r.params, r.error

    def _expire(self) -> None:
        now = time.monotonic()
        for room, r in list(self._rooms.items()):
            if r.ready.is_set() and now - r.at > self.ttl_s:
                del self._rooms[room]


def post_when_done(rooms: Rooms, room: str, stream: RequestStream) -> None:
    """When the prefill of ``room`` ends, post its ``kv_transfer_params`` (or why there are none) for the decode side."""

    def done(out: RequestOutput | None, error: str | None) -> None:
        params = out.extra.get("kv_transfer_params") if out is not None and not error else None
        rooms.post(room, params, error or (None if params is not None else "the prefill published no KV state"))

    stream.on_finish = done


def room_of(body: SamplingFields) -> str | None:
    """The request's bootstrap room (SGLang's router puts it in the body), if any."""
    return None if body.bootstrap_room is None else str(body.bootstrap_room)


async def fetch_room_params(body: SamplingFields) -> dict[str, Any]:
    """A decode server's side: the room's ``kv_transfer_params`` from the prefill server's bootstrap port."""
    host, port, room = body.bootstrap_host, body.bootstrap_port, room_of(body)
    if host is None or port is None or room is None:
        raise InvalidRequestError("a decode server needs kv_transfer_params, or bootstrap_host, bootstrap_port and bootstrap_room "
                                  "(send requests through a prefill/decode router)", "kv_transfer_params")
    url = f"http://{host}:{port}/bootstrap/rooms/{room}"
    deadline = time.monotonic() + ROOM_WAIT_S
    async with httpx.AsyncClient(timeout=httpx.Timeout(ROOM_POLL_S + ROOM_CONNECT_S, connect=ROOM_CONNECT_S)) as client:
        while True:
            wait = max(0.0, min(ROOM_POLL_S, deadline - time.monotonic()))
            try:
                r = await client.get(url, params={"wait": wait})
            except httpx.HTTPError as exc:
                raise RoomUnavailable(f"the prefill server's bootstrap port {host}:{port} did not answer ({type(exc).__name__}); "
                                      "is the prefill server reachable?") from None
            if r.status_code == 200:
                return r.json()["kv_transfer_params"]
            try:
                message = r.json().get("error", {}).get("message", r.text)
            except ValueError:
                message = r.text
            if r.status_code == 404 and str(message).startswith(_NOT_YET) and time.monotonic() < deadline:
                continue  # not finished yet: ask again (a short wait each time, so a lost host is noticed)
            raise RoomUnavailable(f"the prefill server has no KV state for room {room}: {message}")


class RoomUnavailable(RequestFailed):
    """The prefill side of a room is gone or failed (the request fails with 500, the server goes on)."""

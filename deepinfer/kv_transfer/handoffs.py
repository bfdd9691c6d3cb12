"""A server's side of disaggregated serving: publishing prefilled requests, fetching them for decode.

Lives in the engine process beside the engine. A prefill server exports each
finished request's state, publishes it through the connector (the engine's
cache is freed at once: the bytes are off the device) and hands back the
``kv_transfer_params`` the decode side needs; what nobody fetches is released
after ``timeout_s``. A decode server fetches on a thread of its own, so the
engine keeps stepping while bytes arrive, and checks size and checksum before
the state is installed.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

from deepinfer_interfaces.kv_connector import KVConnector, KVConnectorError

from ..errors import DeepInferError
from ..sampling_params import InvalidRequestError
from . import handoff
from .sequence_state import PrefilledRequest

#: threads fetching at once on a decode server
FETCH_THREADS = 4


@dataclass
class TransferStats:
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    kv_transfers_expired: int = 0
    kv_transfers_recomputed: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def parse_params(params: Mapping[str, Any]) -> tuple[str, dict[str, Any], handoff.Handoff]:
    """(connector, location, size and checksum) from a decode request's ``kv_transfer_params``."""
    try:
        return str(params["connector"]), dict(params["location"]), handoff.Handoff(int(params["nbytes"]), str(params["checksum"]))
    except (KeyError, TypeError, ValueError):
        raise InvalidRequestError(
            "kv_transfer_params lacks what a prefill server of this engine returns (connector, location, nbytes, checksum); "
            "send the prefill response's kv_transfer_params unchanged", "kv_transfer_params",
        ) from None


class Handoffs:
    """Publishes (prefill role) and fetches (decode role) through one connector."""

    def __init__(self, connector: KVConnector, timeout_s: float) -> None:
        self.connector = connector
        self.timeout_s = timeout_s
        self.stats = TransferStats()
        #: transfer id -> when it was published
        self.published: dict[str, float] = {}
        self.fetches: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    # ----- prefill -----

    def publish(self, engine: Any, request_id: str) -> dict[str, Any]:
        """Export a finished ``hold_kv`` request, publish it, free its cache; the decode side's ``kv_transfer_params``."""
        try:
            payload, meta = handoff.encode(engine.export_prefilled(request_id))
        finally:
            engine.release_prefilled(request_id)
        location = self.connector.publish(request_id, payload)
        self.published[request_id] = time.monotonic()
        return {"connector": self.connector.name, "location": location, "nbytes": meta.nbytes, "checksum": meta.checksum,
                "remote_request_id": request_id}

    def expire(self) -> None:
        """Release what no decode side fetched within the timeout."""
        now = time.monotonic()
        for transfer_id, at in list(self.published.items()):
            if now - at > self.timeout_s:
                self.connector.release(transfer_id)
                del self.published[transfer_id]
                self.stats.kv_transfers_expired += 1

    # ----- decode -----

    def start_fetch(self, request_id: str, params: Mapping[str, Any]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kv-fetch")
        self.fetches[request_id] = self._pool.submit(self._fetch, params)

    def _fetch(self, params: Mapping[str, Any]) -> tuple[PrefilledRequest, int, float]:
        name, location, meta = parse_params(params)
        if name != self.connector.name:
            raise InvalidRequestError(f"the prefill server used the {name!r} connector but this server uses {self.connector.name!r}; "
                                      "start both with the same --kv-connector", "kv_transfer_params")
        started = time.perf_counter()
        payload = self.connector.fetch(location, meta.nbytes)
        return handoff.decode(payload, meta), meta.nbytes, time.perf_counter() - started

    def done(self) -> list[tuple[str, PrefilledRequest | None, str | None]]:
        """Fetches that ended since the last call: ``(request id, state, None)`` or ``(request id, None, reason)``."""
        out = []
        for request_id, future in list(self.fetches.items()):
            if not future.done():
                continue
            del self.fetches[request_id]
            try:
                prefilled, nbytes, seconds = future.result()
            except (KVConnectorError, DeepInferError) as exc:
                self.stats.kv_transfer_failures += 1
                out.append((request_id, None, f"the KV transfer from the prefill server failed: {exc}"))
                continue
            self.stats.kv_transfers += 1
            self.stats.kv_transfer_bytes += nbytes
            self.stats.kv_transfer_seconds += seconds
            out.append((request_id, prefilled, None))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.connector.close()

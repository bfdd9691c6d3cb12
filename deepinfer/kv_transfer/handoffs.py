"""A server's side of disaggregated serving: publishing prefilled requests, fetching them for decode.

Lives in the engine process beside the engine. A prefill server publishes each
finished request's state through the connector and hands back the
``kv_transfer_params`` the decode side needs. With a connector that reads
memory in place and an engine in this process, the state stays in the cache
pools (registered once) and only a manifest of it is published; the request's
blocks are freed once the decode side says it has read them. Otherwise the
state is exported and published by value, and the cache is freed at once.
What nobody fetches is released after ``timeout_s``. A decode server fetches
on a thread of its own, so the engine keeps stepping while bytes arrive, and
checks sizes and checksum before the state is installed; a fetch that has not
ended within its own ``timeout_s`` (a prefill host whose link went down answers
nothing) fails its request then, whatever the connector still waits for.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from deepinfer_interfaces.kv_connector import KVConnector, KVConnectorError

from ..errors import DeepInferError
from ..sampling_params import InvalidRequestError
from . import handoff
from .sequence_state import PrefilledRequest, SequenceState, map_data, reads

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
        parsed = str(params["connector"]), dict(params["location"]), handoff.Handoff(int(params["nbytes"]), str(params["checksum"]))
    except (KeyError, TypeError, ValueError):
        raise InvalidRequestError(
            "kv_transfer_params lacks what a prefill server of this engine returns (connector, location, nbytes, checksum); "
            "send the prefill response's kv_transfer_params unchanged", "kv_transfer_params",
        ) from None
    if parsed[2].nbytes <= 0:
        raise InvalidRequestError(f"kv_transfer_params has nbytes {parsed[2].nbytes}; a prefill server publishes a positive size",
                                  "kv_transfer_params")
    return parsed


@dataclass
class _Published:
    at: float
    #: the engine whose pools still hold the state (published in place), else None
    engine: Any = None


def _skeleton(plan: SequenceState) -> SequenceState:
    """The plan's shapes and dtypes, no data (meta tensors): the manifest's body."""
    return map_data(plan, lambda r: torch.empty((len(r.rows), r.pool.shape[1]), dtype=r.pool.dtype, device="meta"))


def _filled(skeleton: SequenceState, data: bytearray) -> SequenceState:
    """The manifest's tensors as views of the bytes read, in ``map_data`` order; refused when sizes disagree."""
    flat = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    offset = 0

    def view(t: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        n = t.numel() * t.element_size()
        if offset + n > len(flat):
            raise InvalidRequestError(f"the transferred KV state has {len(flat)} bytes, fewer than its manifest describes; refused")
        raw = flat[offset : offset + n]
        offset += n
        return (raw if raw.storage_offset() % t.element_size() == 0 else raw.clone()).view(t.dtype).view(t.shape)

    state = map_data(skeleton, view)
    if offset != len(flat):
        raise InvalidRequestError(f"the transferred KV state has {len(flat)} bytes, not the {offset} its manifest describes; refused")
    return state


class Handoffs:
    """Publishes (prefill role) and fetches (decode role) through one connector."""

    def __init__(self, connector: KVConnector, timeout_s: float) -> None:
        self.connector = connector
        self.timeout_s = timeout_s
        self.stats = TransferStats()
        self.published: dict[str, _Published] = {}
        self.fetches: dict[str, Future] = {}
        #: when each fetch started (``time.monotonic``): one still running ``timeout_s`` later fails its request
        self._fetch_started: dict[str, float] = {}
        self._pool: ThreadPoolExecutor | None = None
        #: the cache pools are registered with the connector (in place)
        self._registered = False

    # ----- prefill -----

    def publish(self, engine: Any, request_id: str) -> dict[str, Any]:
        """Publish a finished ``hold_kv`` request; the decode side's ``kv_transfer_params``. In place when the
        connector reads memory and the engine's pools are in this process, else by value (its cache freed now)."""
        if self.connector.reads_in_place and hasattr(engine, "plan_prefilled"):
            return self._publish_in_place(engine, request_id)
        try:
            payload, meta = handoff.encode(engine.export_prefilled(request_id))
        finally:
            engine.release_prefilled(request_id)
        location = self.connector.publish(request_id, payload)
        self.published[request_id] = _Published(time.monotonic())
        return self._params(request_id, location, meta)

    def _publish_in_place(self, engine: Any, request_id: str) -> dict[str, Any]:
        """The state stays in the pools (held until the decode side has read it); its manifest is published."""
        try:
            if not self._registered:
                self.connector.register_regions([(t.data_ptr(), t.numel() * t.element_size()) for t in engine.transfer_pools()])
                self._registered = True
            plan = engine.plan_prefilled(request_id)
            manifest, meta = handoff.encode(PrefilledRequest(_skeleton(plan.state), plan.output_token_ids, plan.output_logprobs))
            segments = [seg for r in reads(plan.state) for seg in r.segments()]
            location = self.connector.publish_regions(request_id, manifest, segments)
        except BaseException:
            engine.release_prefilled(request_id)
            raise
        self.published[request_id] = _Published(time.monotonic(), engine)
        return self._params(request_id, location, meta)

    def _params(self, request_id: str, location: dict[str, Any], meta: handoff.Handoff) -> dict[str, Any]:
        return {"connector": self.connector.name, "location": location, "nbytes": meta.nbytes, "checksum": meta.checksum,
                "remote_request_id": request_id}

    def expire(self) -> None:
        """Release what the decode side has read, and what no decode side read within the timeout (the
        connector's record first, then the blocks it pointed into)."""
        now = time.monotonic()
        for transfer_id, p in list(self.published.items()):
            read = self.connector.fetched(transfer_id)
            if read or now - p.at > self.timeout_s:
                self.connector.release(transfer_id)
                if p.engine is not None:
                    p.engine.release_prefilled(transfer_id)
                del self.published[transfer_id]
                self.stats.kv_transfers_expired += 0 if read else 1

    # ----- decode -----

    def start_fetch(self, request_id: str, params: Mapping[str, Any]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kv-fetch")
        self.fetches[request_id] = self._pool.submit(self._fetch, params)
        self._fetch_started[request_id] = time.monotonic()

    def _fetch(self, params: Mapping[str, Any]) -> tuple[PrefilledRequest, int, float]:
        name, location, meta = parse_params(params)
        if name != self.connector.name:
            raise InvalidRequestError(f"the prefill server used the {name!r} connector but this server uses {self.connector.name!r}; "
                                      "start both with the same --kv-connector", "kv_transfer_params")
        started = time.perf_counter()
        if "segments" in location and self.connector.reads_in_place:
            decoded: list[PrefilledRequest] = []

            def check(manifest: bytes) -> int:  # before any row is read: a bad manifest leaves the state unread
                decoded.append(handoff.decode(manifest, meta))
                return decoded[0].state.nbytes

            manifest, data = self.connector.fetch_regions(location, meta.nbytes, check)
            skeleton = decoded[0]
            prefilled = PrefilledRequest(_filled(skeleton.state, data), skeleton.output_token_ids, skeleton.output_logprobs)
            return prefilled, meta.nbytes + len(data), time.perf_counter() - started
        payload = self.connector.fetch(location, meta.nbytes)
        return handoff.decode(payload, meta), meta.nbytes, time.perf_counter() - started

    def done(self) -> list[tuple[str, PrefilledRequest | None, str | None]]:
        """Fetches that ended since the last call: ``(request id, state, None)`` or ``(request id, None, reason)``."""
        out = []
        now = time.monotonic()
        for request_id, future in list(self.fetches.items()):
            if not future.done():
                if now - self._fetch_started.get(request_id, now) > self.timeout_s:
                    # the thread ends when the connector gives up (the mooncake connector's reads are bounded alike);
                    # whatever it gets by then is dropped, and the prefill side releases the state on its own timeout
                    future.cancel()
                    del self.fetches[request_id]
                    self._fetch_started.pop(request_id, None)
                    self.stats.kv_transfer_failures += 1
                    out.append((request_id, None, f"the KV transfer from the prefill server failed: it did not end within "
                                                  f"{self.timeout_s:g} s (--kv-transfer-timeout); is the prefill server reachable?"))
                continue
            del self.fetches[request_id]
            self._fetch_started.pop(request_id, None)
            try:
                prefilled, nbytes, seconds = future.result()
            except Exception as exc:  # noqa: BLE001 - a fetch that fails, however, fails its request alone
                self.stats.kv_transfer_failures += 1
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if not isinstance(exc, (KVConnectorError, DeepInferError)):
                    why = f"{type(exc).__name__}: {why}"
                out.append((request_id, None, f"the KV transfer from the prefill server failed: {why}"))
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

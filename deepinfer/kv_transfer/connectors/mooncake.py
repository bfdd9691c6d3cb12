"""The ``mooncake`` connector: Mooncake's transfer engine reads the prefill side's memory from the decode side.

Every published record starts with a flag word: the decode side checks it is
still "published" when it reads and sets it to "read" after, upon which the
prefill side releases the record; a release first sets it to "released", so a
reader racing the release refuses what it read.

In place (what a prefill server with an in-process engine uses): the prefill
side registers its cache pools with the transfer engine once; per request it
publishes a small record, the ``(address, length)`` segments of the pools
holding the request's state and a manifest of their shapes, and leaves the
state in the pools. The decode side reads the record, checks the manifest and
that the segments add up to it, reads every segment in one
``batch_transfer_sync_read`` into a buffer of the request's size (never a whole
pool), and checks the flag again before it marks the record read. By value
(``publish``/``fetch``, an expert-parallel prefill server whose pools live in
its ranks): the payload follows the flag and is read whole. RDMA where the
machines have it, TCP elsewhere (``protocol`` option; the CPU reference and
the tests use TCP through ``mooncake-transfer-engine-non-cuda``). A frozen peer,
or one whose link went down, fails a read after Mooncake's ``MC_TRANSFER_TIMEOUT``
(seconds): the ``timeout_s`` option (the server's ``--kv-transfer-timeout``)
where the environment does not set it.
"""

from __future__ import annotations

import ctypes
import ipaddress
import math
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

from deepinfer_interfaces.kv_connector import KVConnector, KVConnectorError

#: every published record starts with a flag word: published, read by the decode side, released by the prefill side
_FLAG = struct.Struct("<q")
_PUBLISHED, _READ, _RELEASED = 0, 1, -1
#: the in-place record's body: the segment count, ``(address, length)`` per segment, then the manifest
_COUNT = struct.Struct("<q")
_SEGMENT = struct.Struct("<qq")

#: Mooncake's own bound on a transfer that makes no progress (seconds)
_DEFAULT_TRANSFER_TIMEOUT_S = 30

_PACKAGES = "mooncake-transfer-engine (CUDA), mooncake-transfer-engine-npu (Ascend) or mooncake-transfer-engine-non-cuda (CPU, TCP)"


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        missing = str(exc)
        if "libibverbs" in missing or "librdmacm" in missing:
            raise KVConnectorError(
                f"Mooncake's transfer engine needs the RDMA libraries ({missing.split(':')[0]}); install them: apt-get install libibverbs1 librdmacm1"
            ) from None
        raise KVConnectorError(f"the mooncake connector needs Mooncake's transfer engine; pip install {_PACKAGES}") from None
    return TransferEngine


class MooncakeConnector(KVConnector):
    """``options``: ``host`` (the address peers reach this side at; default ``net.advertised_host``'s choice, the
    interface that routes to the default route, never loopback where another interface exists), ``protocol`` (``tcp`` or ``rdma``), ``device``
    (the RDMA device names, empty for TCP), ``timeout_s`` (how long a read may make no progress; else
    ``MC_TRANSFER_TIMEOUT``, else Mooncake's 30 s; at most 30 s)."""

    name = "mooncake"
    reads_in_place = True

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        try:
            _import_engine()
        except KVConnectorError as exc:
            return False, str(exc)
        return True, None

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        engine_cls = _import_engine()
        timeout_s = self.options.get("timeout_s")
        if timeout_s and float(timeout_s) > 0 and "MC_TRANSFER_TIMEOUT" not in os.environ:
            # read by the engine below; never longer than Mooncake's own default
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(1, min(_DEFAULT_TRANSFER_TIMEOUT_S, math.ceil(float(timeout_s)))))
        from ...net import advertised_host

        self.host = str(self.options.get("host") or advertised_host(None, None))
        self.engine = engine_cls()
        status = self.engine.initialize(self.host, "P2PHANDSHAKE", str(self.options.get("protocol", "tcp")), str(self.options.get("device", "")))
        if status != 0:
            raise KVConnectorError(f"Mooncake's transfer engine did not start on {self.host} (status {status})")
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        #: transfer id -> the registered buffer (kept alive until released)
        self.published: dict[str, ctypes.Array] = {}
        #: the prefill side's registered regions (the cache pools)
        self.regions: list[tuple[int, int]] = []

    def publish(self, transfer_id: str, payload: bytes) -> dict[str, Any]:
        """Registers ``[flag | payload]``; the decode side reads the payload after the flag word."""
        buf = ctypes.create_string_buffer(_FLAG.pack(_PUBLISHED) + payload, _FLAG.size + len(payload))
        address = ctypes.addressof(buf)
        if self.engine.register_memory(address, len(buf)) != 0:
            raise KVConnectorError(f"Mooncake could not register {len(payload)} bytes for transfer {transfer_id}")
        self.published[transfer_id] = buf
        return {"session": self.session, "address": address}

    def fetch(self, location: Mapping[str, Any], nbytes: int) -> bytes:
        session, address = _where(location)
        record = self._read(session, [(address, _FLAG.size + nbytes)])
        _check_flag(record)
        self._mark_read(session, address)
        return bytes(record[_FLAG.size :])

    def fetched(self, transfer_id: str) -> bool:
        buf = self.published.get(transfer_id)
        return buf is not None and _FLAG.unpack_from(buf, 0)[0] == _READ

    def release(self, transfer_id: str) -> None:
        """The flag says released before the memory goes, so a reader racing the release refuses what it read."""
        buf = self.published.pop(transfer_id, None)
        if buf is not None:
            _FLAG.pack_into(buf, 0, _RELEASED)
            self.engine.unregister_memory(ctypes.addressof(buf))

    def _read(self, session: str, segments: list[tuple[int, int]]) -> bytearray:
        """The remote ``segments`` in order, in one buffer registered for the read (one batch)."""
        total = sum(n for _, n in segments)
        buf = bytearray(max(total, 1))
        local = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        if self.engine.register_memory(local, len(buf)) != 0:
            raise KVConnectorError(f"Mooncake could not register a {total}-byte buffer to read into")
        offsets = [0]
        for _, n in segments[:-1]:
            offsets.append(offsets[-1] + n)
        try:
            status = self.engine.batch_transfer_sync_read(
                session, [local + o for o in offsets], [a for a, _ in segments], [n for _, n in segments]) if segments else 0
        finally:
            self.engine.unregister_memory(local)
        if status < 0:
            raise KVConnectorError(f"reading {total} bytes from {session} failed (status {status}); {_hint(session)}")
        return buf if total else bytearray()

    def _mark_read(self, session: str, address: int) -> None:
        """Tell the prefill side its transfer was read (the record's flag word becomes 1)."""
        flag = ctypes.create_string_buffer(_FLAG.pack(_READ), _FLAG.size)
        local = ctypes.addressof(flag)
        if self.engine.register_memory(local, _FLAG.size) != 0:
            raise KVConnectorError("Mooncake could not register the 8-byte done flag")
        try:
            status = self.engine.transfer_sync_write(session, local, address, _FLAG.size)
        finally:
            self.engine.unregister_memory(local)
        if status < 0:
            raise KVConnectorError(f"telling {session} the state was read failed (status {status}); {_hint(session)}")

    # ----- in place -----

    def register_regions(self, regions: list[tuple[int, int]]) -> None:
        for address, length in regions:
            if self.engine.register_memory(address, length) != 0:
                raise KVConnectorError(f"Mooncake could not register the {length}-byte cache pool at {address:#x}")
            self.regions.append((address, length))

    def publish_regions(self, transfer_id: str, manifest: bytes, segments: list[tuple[int, int]]) -> dict[str, Any]:
        body = _COUNT.pack(len(segments)) + b"".join(_SEGMENT.pack(a, n) for a, n in segments) + manifest
        return {**self.publish(transfer_id, body), "segments": len(segments)}

    def fetch_regions(
        self, location: Mapping[str, Any], manifest_nbytes: int, check: Callable[[bytes], int]
    ) -> tuple[bytes, bytearray]:
        session, address = _where(location)
        count = location.get("segments")
        if not isinstance(count, int) or count < 0:
            raise KVConnectorError("the transfer's location has no segment count; it was not published in place by a mooncake connector")
        head = _FLAG.size + _COUNT.size + count * _SEGMENT.size
        record = self._read(session, [(address, head + manifest_nbytes)])
        _check_flag(record)
        if _COUNT.unpack_from(record, _FLAG.size)[0] != count:
            raise KVConnectorError("the transfer's record holds another segment count than its location; refused")
        segments = [_SEGMENT.unpack_from(record, _FLAG.size + _COUNT.size + k * _SEGMENT.size) for k in range(count)]
        manifest = bytes(record[head:])
        expected = check(manifest)
        if sum(n for _, n in segments) != expected or any(n <= 0 for _, n in segments):
            raise KVConnectorError(f"the transfer's segments hold {sum(n for _, n in segments)} bytes, not the {expected} its manifest "
                                   "describes; refused")
        data = self._read(session, segments)
        _check_flag(self._read(session, [(address, _FLAG.size)]))  # not released while its rows were read
        self._mark_read(session, address)
        return manifest, data

    def close(self) -> None:
        for transfer_id in list(self.published):
            self.release(transfer_id)
        for address, _ in self.regions:
            self.engine.unregister_memory(address)
        self.regions.clear()


def _hint(session: str) -> str:
    """What to check when a read from ``session`` failed: the prefill server's life, or the loopback address it offered
    (which a decode server on another host reaches as itself)."""
    host = session.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return ("is the prefill server alive? It offered a loopback address, which only a decode server on its own host can "
                "reach: start it with --host <its address> or --advertise-host")
    return "is the prefill server alive?"


def _check_flag(record: bytearray) -> None:
    if _FLAG.unpack_from(record, 0)[0] != _PUBLISHED:
        raise KVConnectorError("the prefill server released this KV state (it expired, or another decode server read it); refused")


def _where(location: Mapping[str, Any]) -> tuple[str, int]:
    session, address = location.get("session"), location.get("address")
    if not isinstance(session, str) or not isinstance(address, int):
        raise KVConnectorError("the transfer's location has no 'session' and 'address'; it was not published by a mooncake connector")
    return session, address

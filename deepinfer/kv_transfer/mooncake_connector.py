"""The ``mooncake`` connector: Mooncake's transfer engine reads the prefill side's memory from the decode side.

In place (what a prefill server with an in-process engine uses): the prefill
side registers its cache pools with the transfer engine once; per request it
publishes one small registered record, a done flag, the ``(address, length)``
segments of the pools holding the request's state and a manifest of their
shapes, and leaves the state in the pools. The decode side reads the record,
then every segment in one ``batch_transfer_sync_read`` into a buffer of the
request's size (never a whole pool), and writes the flag, upon which the
prefill side frees the request's blocks. By value (``publish``/``fetch``, an
expert-parallel prefill server whose pools live in its ranks): the payload's
buffer is registered and read whole. RDMA where the machines have it, TCP
elsewhere (``protocol`` option; the CPU reference and the tests use TCP through
``mooncake-transfer-engine-non-cuda``).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Mapping
from typing import Any

from deepinfer_interfaces.kv_connector import KVConnector, KVConnectorError

#: the in-place record: an 8-byte done flag, the segment count, then ``(address, length)`` pairs, then the manifest
_HEAD = struct.Struct("<qq")
_SEGMENT = struct.Struct("<qq")

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
    """``options``: ``host`` (this side's address, default 127.0.0.1), ``protocol`` (``tcp`` or ``rdma``), ``device``
    (the RDMA device names, empty for TCP)."""

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
        self.host = str(self.options.get("host", "127.0.0.1"))
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
        buf = ctypes.create_string_buffer(payload, len(payload))
        address = ctypes.addressof(buf)
        if self.engine.register_memory(address, len(payload)) != 0:
            raise KVConnectorError(f"Mooncake could not register {len(payload)} bytes for transfer {transfer_id}")
        self.published[transfer_id] = buf
        return {"session": self.session, "address": address}

    def fetch(self, location: Mapping[str, Any], nbytes: int) -> bytes:
        session, address = _where(location)
        return bytes(self._read(session, [(address, nbytes)]))

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
            raise KVConnectorError(f"reading {total} bytes from {session} failed (status {status}); is the prefill server alive?")
        return buf if total else bytearray()

    # ----- in place -----

    def register_regions(self, regions: list[tuple[int, int]]) -> None:
        for address, length in regions:
            if self.engine.register_memory(address, length) != 0:
                raise KVConnectorError(f"Mooncake could not register the {length}-byte cache pool at {address:#x}")
            self.regions.append((address, length))

    def publish_regions(self, transfer_id: str, manifest: bytes, segments: list[tuple[int, int]]) -> dict[str, Any]:
        record = _HEAD.pack(0, len(segments)) + b"".join(_SEGMENT.pack(a, n) for a, n in segments) + manifest
        location = self.publish(transfer_id, record)
        return {**location, "segments": len(segments)}

    def fetch_regions(self, location: Mapping[str, Any], manifest_nbytes: int) -> tuple[bytes, bytearray]:
        session, address = _where(location)
        count = location.get("segments")
        if not isinstance(count, int) or count < 0:
            raise KVConnectorError("the transfer's location has no segment count; it was not published in place by a mooncake connector")
        head = _HEAD.size + count * _SEGMENT.size
        record = self._read(session, [(address, head + manifest_nbytes)])
        segments = [_SEGMENT.unpack_from(record, _HEAD.size + k * _SEGMENT.size) for k in range(count)]
        data = self._read(session, segments)
        self._write_flag(session, address)
        return bytes(record[head:]), data

    def _write_flag(self, session: str, address: int) -> None:
        """Tell the prefill side the segments were read (its record's first word becomes 1)."""
        flag = ctypes.create_string_buffer(struct.pack("<q", 1), 8)
        local = ctypes.addressof(flag)
        if self.engine.register_memory(local, 8) != 0:
            raise KVConnectorError("Mooncake could not register the 8-byte done flag")
        try:
            status = self.engine.transfer_sync_write(session, local, address, 8)
        finally:
            self.engine.unregister_memory(local)
        if status < 0:
            raise KVConnectorError(f"telling {session} the state was read failed (status {status}); is the prefill server alive?")

    def fetched(self, transfer_id: str) -> bool:
        buf = self.published.get(transfer_id)
        return buf is not None and struct.unpack_from("<q", buf, 0)[0] == 1

    def release(self, transfer_id: str) -> None:
        buf = self.published.pop(transfer_id, None)
        if buf is not None:
            self.engine.unregister_memory(ctypes.addressof(buf))

    def close(self) -> None:
        for transfer_id in list(self.published):
            self.release(transfer_id)
        for address, _ in self.regions:
            self.engine.unregister_memory(address)
        self.regions.clear()


def _where(location: Mapping[str, Any]) -> tuple[str, int]:
    session, address = location.get("session"), location.get("address")
    if not isinstance(session, str) or not isinstance(address, int):
        raise KVConnectorError("the transfer's location has no 'session' and 'address'; it was not published by a mooncake connector")
    return session, address

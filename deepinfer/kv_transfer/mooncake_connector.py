"""The ``mooncake`` connector: Mooncake's transfer engine reads the prefill side's bytes straight into the decode side.

The prefill side registers each payload's buffer with its transfer engine and
publishes ``(session, address)``; the decode side registers a buffer of its own
and reads into it with one ``transfer_sync_read``, over RDMA where the machines
have it and TCP elsewhere (``protocol`` option; the CPU reference and the tests
use TCP through ``mooncake-transfer-engine-non-cuda``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

from deepinfer_interfaces.kv_connector import KVConnector, KVConnectorError

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

    def publish(self, transfer_id: str, payload: bytes) -> dict[str, Any]:
        buf = ctypes.create_string_buffer(payload, len(payload))
        address = ctypes.addressof(buf)
        if self.engine.register_memory(address, len(payload)) != 0:
            raise KVConnectorError(f"Mooncake could not register {len(payload)} bytes for transfer {transfer_id}")
        self.published[transfer_id] = buf
        return {"session": self.session, "address": address}

    def fetch(self, location: Mapping[str, Any], nbytes: int) -> bytes:
        session, address = location.get("session"), location.get("address")
        if not isinstance(session, str) or not isinstance(address, int):
            raise KVConnectorError("the transfer's location has no 'session' and 'address'; it was not published by a mooncake connector")
        buf = ctypes.create_string_buffer(nbytes)
        local = ctypes.addressof(buf)
        if self.engine.register_memory(local, nbytes) != 0:
            raise KVConnectorError(f"Mooncake could not register a {nbytes}-byte buffer to read into")
        try:
            status = self.engine.transfer_sync_read(session, local, address, nbytes)
        finally:
            self.engine.unregister_memory(local)
        if status < 0:
            raise KVConnectorError(f"reading {nbytes} bytes from {session} failed (status {status}); is the prefill server alive?")
        return buf.raw

    def release(self, transfer_id: str) -> None:
        buf = self.published.pop(transfer_id, None)
        if buf is not None:
            self.engine.unregister_memory(ctypes.addressof(buf))

    def close(self) -> None:
        for transfer_id in list(self.published):
            self.release(transfer_id)

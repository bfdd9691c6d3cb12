"""The ``store`` connector: request state through a directory both sides mount (the KV store's, e.g. 3FS or NFS)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deepinfer_interfaces.kv_connector import KVConnector, KVConnectorError


class StoreConnector(KVConnector):
    """Writes each payload to ``<directory>/transfers/<id>.kv`` (atomically: a temporary name, then a rename);
    the decode side reads it and deletes it (so the prefill side knows it was read); ``release`` deletes it. ``options``: ``directory`` (the shared mount)."""

    name = "store"

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        directory = self.options.get("directory")
        if not directory:
            raise KVConnectorError("the store connector needs a shared directory; pass --kv-store DIR (a mount both servers see)")
        self.root = Path(directory) / "transfers"
        self.root.mkdir(parents=True, exist_ok=True)
        self.published: dict[str, Path] = {}

    def _path(self, transfer_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in transfer_id)
        return self.root / f"{safe}.kv"

    def publish(self, transfer_id: str, payload: bytes) -> dict[str, Any]:
        path = self._path(transfer_id)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_bytes(payload)
        os.replace(tmp, path)
        self.published[transfer_id] = path
        return {"path": str(path)}

    def fetch(self, location: Mapping[str, Any], nbytes: int) -> bytes:
        path = location.get("path")
        if not isinstance(path, str):
            raise KVConnectorError("the transfer's location has no 'path'; it was not published by a store connector")
        try:
            payload = Path(path).read_bytes()
        except OSError as exc:
            raise KVConnectorError(f"cannot read the transferred KV state at {path} ({exc.strerror}); is the directory shared?") from None
        Path(path).unlink(missing_ok=True)  # read: the prefill side sees it gone (``fetched``)
        return payload

    def fetched(self, transfer_id: str) -> bool:
        path = self.published.get(transfer_id)
        return path is not None and not path.exists()

    def release(self, transfer_id: str) -> None:
        path = self.published.pop(transfer_id, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        for transfer_id in list(self.published):
            self.release(transfer_id)

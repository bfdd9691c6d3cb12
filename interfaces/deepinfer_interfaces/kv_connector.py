"""The KVConnector contract: how a prefill server's request state reaches a decode server.

A connector moves opaque bytes; the engine decides what they are (a request's
cache state, serialized with its size and checksum, which the engine checks
before it decodes from them). The prefill side ``publish``es a request's bytes
and gets back a *location*, a small JSON-able mapping that travels to the decode
side through the router (vLLM's ``kv_transfer_params``) or the bootstrap
handshake (SGLang's); the decode side ``fetch``es them from that location; the
prefill side ``release``s them once they were fetched or the decode side gave up.

A connector registers as a ``deepinfer.kv_connectors`` entry point, so a vendor
ships its own transport (RDMA, a shared file system, a device-to-device link)
without touching the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar


class KVConnectorError(RuntimeError):
    """A transfer that cannot be made: the one-line reason (what is missing, what failed, the fix)."""


class KVConnector(ABC):
    """One side (or both) of a KV handoff. ``options``: connector settings (e.g. ``host``, ``directory``)."""

    name: ClassVar[str] = "connector"

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        """Whether it can run here, and if not why (one line naming what to install)."""
        return True, None

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    @abstractmethod
    def publish(self, transfer_id: str, payload: bytes) -> dict[str, Any]:
        """Make ``payload`` fetchable under ``transfer_id``; the location the decode side fetches it from."""

    @abstractmethod
    def fetch(self, location: Mapping[str, Any], nbytes: int) -> bytes:
        """The ``nbytes`` published at ``location`` (raises ``KVConnectorError`` when they cannot be read)."""

    @abstractmethod
    def release(self, transfer_id: str) -> None:
        """Forget a published payload (fetched, or abandoned); unknown ids are ignored."""

    def close(self) -> None:
        """Release everything still published and the transport itself."""

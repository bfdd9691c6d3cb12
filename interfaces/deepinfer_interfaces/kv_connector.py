"""The KVConnector contract: how a prefill server's request state reaches a decode server.

A connector moves opaque bytes; the engine decides what they are (a request's
cache state, serialized with its size and checksum, which the engine checks
before it decodes from them). The prefill side ``publish``es a request's bytes
and gets back a *location*, a small JSON-able mapping that travels to the decode
side through the router (vLLM's ``kv_transfer_params``) or the bootstrap
handshake (SGLang's); the decode side ``fetch``es them from that location (and
marks them read); the prefill side ``release``s them once they were read
(``fetched``) or the decode side gave up.

A connector that reads memory in place (``reads_in_place``: RDMA, a device
link) also offers a zero-copy path: the prefill side registers the memory its
cache pools live in once (``register_regions``) and publishes, per request, a
small manifest plus the ``segments`` (address, length) of that memory holding
the request's state, which stays in the pools until the decode side has read
it (``fetched``); the decode side checks the manifest, then reads exactly those
segments, in bulk (``fetch_regions``).

A connector registers as a ``deepinfer.kv_connectors`` entry point, so a vendor
ships its own transport (RDMA, a shared file system, a device-to-device link)
without touching the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
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
        """The ``nbytes`` published at ``location``, marked read for the prefill side (raises ``KVConnectorError``
        when they cannot be read)."""

    def fetched(self, transfer_id: str) -> bool:
        """Prefill side: whether the decode side has read a published transfer (it may be released now)."""
        return False

    @abstractmethod
    def release(self, transfer_id: str) -> None:
        """Forget a published payload (fetched, or abandoned); unknown ids are ignored."""

    # ----- reading registered memory in place (optional) -----

    #: the connector implements ``register_regions``, ``publish_regions``, ``fetch_regions`` and ``fetched``
    reads_in_place: ClassVar[bool] = False

    def register_regions(self, regions: list[tuple[int, int]]) -> None:
        """Prefill side, once: the ``(address, length)`` regions published segments lie in (the cache pools)."""
        raise NotImplementedError(f"the {self.name} connector does not read memory in place")

    def publish_regions(self, transfer_id: str, manifest: bytes, segments: list[tuple[int, int]]) -> dict[str, Any]:
        """Make ``manifest`` (copied) and the registered memory's ``segments`` (read in place, left untouched
        until ``fetched``) fetchable under ``transfer_id``; the location."""
        raise NotImplementedError(f"the {self.name} connector does not read memory in place")

    def fetch_regions(
        self, location: Mapping[str, Any], manifest_nbytes: int, check: Callable[[bytes], int]
    ) -> tuple[bytes, bytearray]:
        """Decode side: the manifest, and every segment's bytes in order in one buffer. ``check`` is called with the
        manifest before any segment is read: it raises to refuse the transfer (left published, unread) or returns
        the bytes the manifest describes, which the segments must add up to. The data is valid only if the
        prefill side did not release it meanwhile (checked after the read); then it is marked read. Raises
        ``KVConnectorError`` when it cannot be read."""
        raise NotImplementedError(f"the {self.name} connector does not read memory in place")

    def close(self) -> None:
        """Release everything still published and the transport itself."""

"""Every failure a handler meets, as an HTTP status and OpenAI's error object."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from ..errors import ChatFormatError, DeepInferError
from ..sampling_params import InvalidRequestError
from .async_engine import EngineDeadError, QueueFullError
from .protocol import error_body
from .state import ModelNotFound
from .streaming import DONE, ClientDisconnected, RequestFailed, sse

log = logging.getLogger("deepinfer")

#: seconds a client refused for overload is told to wait
RETRY_AFTER_S = 1
#: the status of a reply whose client left before it (nginx's "client closed request"; only access logs see it)
CLIENT_CLOSED = 499


def error_for(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """``(status, body)`` for a failure; anything unexpected is a 500 whose message is its first line."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(exc, ModelNotFound):
        return 404, error_body(message, "invalid_request_error", 404, "model")
    if isinstance(exc, InvalidRequestError):
        return 400, error_body(message, "invalid_request_error", 400, exc.param)
    if isinstance(exc, ChatFormatError):
        return 400, error_body(message, "invalid_request_error", 400, "messages")
    if isinstance(exc, QueueFullError):
        return 503, error_body(message, "service_unavailable_error", 503)
    if isinstance(exc, EngineDeadError):
        return 503, error_body(message, "service_unavailable_error", 503)
    if isinstance(exc, ClientDisconnected):
        return CLIENT_CLOSED, error_body(message, "invalid_request_error", CLIENT_CLOSED)
    if isinstance(exc, (RequestFailed, DeepInferError)):
        return 500, error_body(message, "server_error", 500)
    return 500, error_body(f"internal error: {message}", "server_error", 500)


async def guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A response's SSE events; a fault while making them (parsing the output, building a chunk) ends the
    stream with OpenAI's error object as its last event and ``[DONE]``: the status line is already sent."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - this response fails alone
        log.exception("a streamed response failed")
        yield sse(error_for(exc)[1])
        yield DONE

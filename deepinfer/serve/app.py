"""The FastAPI application: routes, the API key, the body-size limit, the OpenAPI schema, and every error as
OpenAI's object.

The route bodies are the request models bounded by the server's limits (``limits.request_models``); their
annotations are evaluated when the routes are defined, so this module does not postpone annotations.
"""

import hmac
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import DeepInferError
from ..sampling_params import InvalidRequestError
from . import anthropic, chat, completions, conversation, render, responses
from .async_engine import EngineDeadError
from .bootstrap import ROOM_WAIT_S
from .errors import RETRY_AFTER_S, error_for
from .metrics import CONTENT_TYPE
from .limits import RAISED_BY, request_models
from .protocol import ChatCompletionRequest, DetokenizeRequest, error_body
from .state import ServerState

#: endpoints anyone may call without the API key (orchestrators' probes, Prometheus, the decode servers' rendezvous)
OPEN_PATHS = ("/health", "/metrics")
OPEN_PREFIXES = ("/bootstrap/",)


def _error(status: int, body: dict[str, Any], path: str = "") -> JSONResponse:
    """The error reply; on the Anthropic Messages paths, in Anthropic's error shape."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    if anthropic.owns(path):
        body = anthropic.error_object(status, body)
    return JSONResponse(body, status_code=status, headers=headers)


class _Guard:
    """ASGI middleware in front of everything: bodies past ``max_body_bytes`` are refused before they
    are read whole (413: by Content-Length, or as a chunked body passes the limit), and with an API key
    every path but the open ones needs ``Bearer KEY`` or, as Anthropic's clients send it, ``x-api-key: KEY`` (401)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and not scope["path"].startswith(OPEN_PREFIXES):
            given = headers.get(b"authorization", b"")
            bearer = hmac.compare_digest(given, b"Bearer " + self.api_key)
            if not (bearer or hmac.compare_digest(headers.get(b"x-api-key", b""), self.api_key)):
                await _error(401, error_body("a valid API key is required: send the header 'Authorization: Bearer KEY' "
                                             "(or 'x-api-key: KEY')", "authentication_error", 401), scope["path"])(scope, receive, send)
                return
        length = headers.get(b"content-length")
        too_big = error_body(f"the request body is larger than this server accepts ({self.max_body_bytes} bytes)",
                             "invalid_request_error", 413)
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _error(413, too_big, scope["path"])(scope, receive, send)
            return
        # read the body here (up to the limit) and hand it on: a chunked body has no length to check first
        head: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            head.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                await _error(413, too_big, scope["path"])(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return head.pop(0) if head else await receive()

        await self.app(scope, replay, send)


def _field(errors: list[dict[str, Any]]) -> str | None:
    """The field the first validation error is about, as a dotted path; a union's member names (the ``str``
    of ``prompt.str``, one error per member) are left out: the path the first field's errors share."""
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    first = locs[0]
    same = [loc for loc in locs if loc[:1] == first[:1]]
    n = 0
    while n < len(first) and all(len(loc) > n and loc[n] == first[n] for loc in same):
        n += 1
    return ".".join(first[:n]) or None


#: characters of a refused value a message echoes
ECHO_CHARS = 80


def _echo(value: Any) -> str:
    """A refused value as the message shows it: its repr, cut short (a list past its bound can be long)."""
    text = repr(value)
    return text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 3] + "..."


def _telling(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report: the first field's first error that is not a union member's type mismatch (a list
    past its bound also fails ``str | list[str]``'s ``str`` member; the bound is what the client needs)."""
    first = [str(p) for p in errors[0].get("loc", ()) if p != "body"][:1]
    same = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == first]
    return next((e for e in same if not str(e.get("type", "")).endswith("_type")), errors[0])


def build_app(state: ServerState, api_key: str | None = None, max_body_bytes: int = 32 << 20, docs: bool = True) -> FastAPI:
    """The server's application. ``docs``: serve ``/openapi.json`` and ``/docs`` (behind the API key like the rest)."""
    app = FastAPI(
        title="deepinfer", version=str(state.info.get("version", "unknown")), docs_url="/docs" if docs else None, redoc_url=None,
        openapi_url="/openapi.json" if docs else None,
        description="OpenAI-compatible inference for the DeepSeek-V4 family. Every error is OpenAI's error object.",
    )
    app.state.server = state
    models = request_models(state.limits)
    Completion, Chat, Tokenize = models.completion, models.chat, models.tokenize
    Responses, Messages, CountTokens = models.responses, models.messages, models.count_tokens
    stored = responses.ResponseStore()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _telling(exc.errors())
        field = _field(exc.errors())
        path = request.url.path
        if err.get("type") == "json_invalid":
            return _error(400, error_body(f"the request body is not valid JSON: {err.get('msg')}", "invalid_request_error", 400), path)
        if not field:
            message = f"invalid request body: {err.get('msg')}"
        elif err.get("type") == "missing":  # its input is the whole body: not echoed
            message = f"invalid request field '{field}': {err.get('msg')}"
        else:
            message = f"invalid request field '{field}' = {_echo(err.get('input'))}: {err.get('msg')}"
            flag = RAISED_BY.get(field.split(".")[0])
            if flag is not None and err.get("type") == "less_than_equal":
                message += f" (the server's {flag})"
        return _error(400, error_body(message, "invalid_request_error", 400, field), path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = error_body(str(exc.detail), kind, exc.status_code)
        if anthropic.owns(request.url.path):
            body = anthropic.error_object(exc.status_code, body)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(DeepInferError)
    async def _refused(request: Request, exc: DeepInferError) -> JSONResponse:
        return _error(*error_for(exc), request.url.path)

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSONResponse:
        return _error(*error_for(exc), request.url.path)  # Starlette then re-raises it: the traceback is logged

    def refuse_when_draining() -> None:
        if state.draining:
            raise EngineDeadError("the server is shutting down; send the request to another replica")

    @app.post("/v1/completions")
    async def create_completion(body: Completion, request: Request):
        refuse_when_draining()
        return await completions.create_completion(body, state, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: Chat, request: Request):
        refuse_when_draining()
        return await chat.create_chat_completion(body, state, request)

    @app.post("/v1/responses")
    async def create_response(body: Responses, request: Request):
        """OpenAI Responses: the conversation's reply as output items (stored, the newest few, unless store=false)."""
        refuse_when_draining()
        return await responses.create_response(body, state, stored, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        """A stored response."""
        return responses.stored_response(stored, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        """Forget a stored response."""
        responses.stored_response(stored, response_id)
        stored.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/messages")
    async def create_message(body: Messages, request: Request):
        """Anthropic Messages: the conversation's reply as content blocks; errors in Anthropic's shape."""
        refuse_when_draining()
        return await anthropic.create_message(body, state, request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokens) -> dict[str, int]:
        """The prompt's length in tokens as ``/v1/messages`` renders it."""
        return await anthropic.count_tokens(body, state)

    @app.post("/v1/completions/render")
    async def render_completion(body: Completion) -> list[dict[str, Any]]:
        """The prompts' token ids (vLLM's router routes by them)."""
        return render.render_completion(body, state)

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(body: Chat) -> dict[str, Any]:
        """The conversation's token ids in the chat format (vLLM's router routes by them)."""
        return render.render_chat(body, state)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(state.started), "owned_by": "deepinfer", "root": state.model_names[0],
             "max_model_len": state.max_model_len}
            for name in state.model_names
        ]}

    @app.get("/health")
    async def health() -> Response:
        if state.engine.dead is not None:
            return _error(503, error_body(f"the engine has failed: {state.engine.dead}", "service_unavailable_error", 503))
        if state.draining:
            return _error(503, error_body("the server is shutting down", "service_unavailable_error", 503))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        counters: dict[str, Any] = {}
        if state.engine.dead is None:
            counters = await state.engine.query("metrics")
        return Response(state.metrics.render(counters, state.engine.load), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: Tokenize) -> dict[str, Any]:
        state.model_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            ids = conversation.render(ChatCompletionRequest(
                messages=body.messages, tools=body.tools, reasoning_effort=body.reasoning_effort,
                chat_template_kwargs=body.chat_template_kwargs, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            ), state).token_ids
        else:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens).ids
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.model_name(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} is outside the vocabulary [0, {state.vocab_size})", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        load = state.engine.load
        return {**state.info, "served_model_names": state.model_names, "max_model_len": state.max_model_len,
                "uptime_s": time.time() - state.started, "num_requests_running": load.num_running,
                "num_requests_waiting": load.num_waiting, "kv_cache_usage": load.kv_cache_usage,
                "engine_error": state.engine.dead}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        """What SGLang's router asks a worker when it registers it."""
        return {"model_path": state.info.get("model_path"), "tokenizer_path": state.info.get("model_path"), "is_generation": True,
                "model_type": state.info.get("model_type"), "served_model_name": state.model_names[0],
                "has_image_understanding": state.image_placeholder is not None, "has_audio_understanding": False, "max_model_len": state.max_model_len}

    @app.get("/bootstrap/rooms/{room}")
    async def bootstrap_room(room: str, wait: float = 0.0) -> JSONResponse:
        """A prefill server's rendezvous (SGLang's router): where the room's KV state is, once its prefill ended."""
        if state.rooms is None:
            return _error(404, error_body("this server is not a prefill server; it has no bootstrap rooms", "invalid_request_error", 404))
        params, problem = await state.rooms.wait(room, max(0.0, min(wait, ROOM_WAIT_S)))
        if params is None:
            return _error(404, error_body(problem or "no KV state", "invalid_request_error", 404))
        return JSONResponse({"kv_transfer_params": params})

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        load = state.engine.load
        return [{"num_tokens": load.num_tokens, "num_reqs": load.num_running + load.num_waiting,
                 "num_waiting_reqs": load.num_waiting}]

    @app.post("/flush_cache")
    async def flush_cache() -> dict[str, Any]:
        await state.engine.query("flush")
        return {"success": True, "message": "the prefix cache no request is using was flushed"}

    return _Guard(app, api_key, max_body_bytes)  # type: ignore[return-value]


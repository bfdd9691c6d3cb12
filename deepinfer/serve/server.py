"""``deepinfer serve``: load the engine, bind the port, serve until SIGTERM or an engine failure.

Start-up prints what it is doing (weights, the KV-cache plan, graph capture)
and one ``ready`` line. SIGTERM (or Ctrl-C) drains: the listening socket
closes, ``/health`` turns 503, requests in flight finish for up to
``--shutdown-timeout`` seconds and are then aborted, and the process exits 0.
An engine failure (a dead rank) fails the requests in flight with 500, turns
``/health`` to 503 and exits 1, so an orchestrator restarts the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from ..chat import ChatFormat, chat_format_for
from ..chat.tool_grammar import tool_call_format
from ..config import EngineConfig
from ..engine import resolve_model_dir
from ..errors import ChatFormatError, ConfigError
from ..image_input import ImageLimits
from ..lifetime import die_with_parent
from ..loader import load_tokenizer, read_config
from ..models.registry import image_reader
from ..net import advertised_host
from ..prompts import image_placeholder
from ..ranks.engines import make_engine
from ..ranks.launch import torchrun_rank
from ..request_limits import RequestLimits
from ..version import package_version
from .async_engine import AsyncEngine
from .bootstrap import Rooms
from .engine_launch import EngineLaunch, launch_engine
from .engine_process import TransferSettings
from .chat_parsing import TOOL_PARSERS
from .metrics import ServerMetrics
from .state import ServerState

log = logging.getLogger("deepinfer")

#: seconds a failed engine's server keeps answering 503 before it exits (probes see why)
DEAD_EXIT_DELAY_S = 1.0


@dataclass
class ServeOptions:
    """The server's own settings (the engine's are an ``EngineConfig``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    #: the address peers (decode servers, the KV connector's readers) are told to reach this server at;
    #: None: ``net.advertised_host``'s choice (the bind host, else the interface that routes to the peers)
    advertise_host: str | None = None
    api_key: str | None = None
    served_model_names: list[str] | None = None
    chat_template: str | None = None
    max_queued_requests: int = 1024
    shutdown_timeout: float = 30.0
    max_request_bytes: int = 32 << 20
    reasoning_parser: bool = True
    #: "auto": the format the chat template writes calls in (DSML for DeepSeek-V4, else <tool_call> JSON if the template uses it)
    tool_call_parser: str | None = "auto"
    access_log: bool = False
    #: ``both`` (colocated), ``prefill`` or ``decode``: this server's part of disaggregated serving
    disaggregation_mode: str = "both"
    kv_connector: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    #: seconds a prefill server keeps a published state no decode server fetched
    kv_transfer_timeout: float = 60.0
    #: decode server, when a transfer fails: ``fail`` the request, or ``recompute`` its prompt here
    kv_load_failure_policy: str = "fail"
    #: serve ``/openapi.json`` and ``/docs``
    docs: bool = True


class _Server(uvicorn.Server):
    """uvicorn's server that also marks the state draining on SIGTERM / SIGINT, so ``/health`` says so."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame) -> None:
        if not self.state.draining:
            log.info("shutting down: finishing the requests in flight (up to %.0f s)", self.config.timeout_graceful_shutdown or 0)
        self.state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, but without raising the signal again once drained (that would kill the process
        before the engine is stopped, and exit -15 instead of 0)."""
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port or --host") from None
    sock.set_inheritable(True)
    return sock


def _tool_call_parser(choice: str | None, fmt: ChatFormat | None) -> str | None:
    """``auto``: DSML for the DeepSeek-V4 format and templates that write it, ``hermes`` for templates writing
    ``<tool_call>`` JSON."""
    return choice if choice != "auto" else tool_call_format(fmt)


def _transfer(config: EngineConfig, options: ServeOptions) -> TransferSettings | None:
    """The connector of a prefill or decode server (None: colocated)."""
    if options.disaggregation_mode == "both":
        return None
    host = advertised_host(options.advertise_host, options.host)  # what the connector registers and hands to peers
    return TransferSettings(options.kv_connector, {"host": host, "directory": config.kv_store}, options.kv_transfer_timeout,
                            recompute=options.kv_load_failure_policy == "recompute")


def _default_name(config: EngineConfig) -> str:
    return config.model if config.model is not None else resolve_model_dir(None).name


def serve(config: EngineConfig, options: ServeOptions, launched: EngineLaunch | None = None) -> int:
    """Run the server in this process until it is told to stop; the exit status. ``launched``: the engine
    process, spawned for ``config`` before this module was imported (so the two started side by side)."""
    try:
        return _serve(config, options, launched)
    except BaseException:
        if launched is not None and launched.process.exitcode is None and not launched.conn.closed:
            launched.kill()  # refused before the engine was taken over (a taken port, a bad flag)
        raise


def _serve(config: EngineConfig, options: ServeOptions, launched: EngineLaunch | None) -> int:
    if options.tool_call_parser not in (None, "auto", *TOOL_PARSERS):
        raise ConfigError(f"--tool-call-parser {options.tool_call_parser!r} is unknown; choose auto, {', '.join(TOOL_PARSERS)} or none")
    template = None
    if options.chat_template:
        try:
            template = Path(options.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --chat-template {options.chat_template}: {getattr(exc, 'strerror', None) or exc}") from None
    place = torchrun_rank()
    if place is not None:  # a torchrun worker, rank 0 (HTTP) too, dies with torchrun's agent: it cannot be orphaned
        die_with_parent()
    if place is not None and launched is not None:  # the ranks are torchrun's: no engine process of our own
        launched.kill()
        launched = None
    if place is not None and place.rank != 0:  # under torchrun, rank 0 serves HTTP; this rank serves its experts
        make_engine(config)
        return 0
    sock = _bind(options.host, options.port)  # before loading: a taken port fails at once
    try:
        transfer = _transfer(config, options)  # a wrong --advertise-host fails at once too
    except BaseException:
        sock.close()
        raise
    model_dir = resolve_model_dir(config.model)
    started = time.monotonic()
    log.info("loading %s (backend %s%s)", model_dir, config.backend, f", --ep {config.expert_parallel_size}" if config.expert_parallel_size > 1 else "")
    engine = AsyncEngine(config, options.max_queued_requests, verbose=log.isEnabledFor(logging.INFO), transfer=transfer)
    try:
        launched = launched if launched is not None else launch_engine(config.model_dump_json(), engine.verbose, transfer)
        # while the engine process builds the engine: this process's own remaining imports and the tokenizer
        importlib.import_module(".app", __package__)
        tokenizer = load_tokenizer(model_dir)
        info = engine.start_process(launched=launched)
        try:
            fmt, fmt_error = chat_format_for(model_dir, tokenizer, info.model_type, template), None
        except ChatFormatError as exc:
            fmt, fmt_error = None, str(exc)
    except BaseException:
        sock.close()
        asyncio.run(engine.stop())
        raise
    names = options.served_model_names or [_default_name(config)]
    facts = {
        "model_path": str(model_dir), "model_type": info.model_type, "engine_config": config.model_dump(mode="json"),
        "backend": info.backend, "chat_format": fmt.name if fmt is not None else None, "version": package_version(),
        "disaggregation_mode": options.disaggregation_mode,
        "kv_connector": options.kv_connector if options.disaggregation_mode != "both" else None,
    }
    raw = read_config(model_dir)
    placeholder = image_placeholder(raw, tokenizer)
    state = ServerState(
        engine=engine, tokenizer=tokenizer, model_names=names, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        metrics=ServerMetrics(names[0]), chat_format=fmt, chat_format_error=fmt_error, reasoning_parser=options.reasoning_parser,
        tool_call_parser=_tool_call_parser(options.tool_call_parser, fmt), info=facts, disaggregation_mode=options.disaggregation_mode,
        recompute_failed_transfers=options.kv_load_failure_policy == "recompute",
        image_placeholder=placeholder, image_limits=ImageLimits.from_config(config),
        image_reader=image_reader(raw) if placeholder is not None else None, limits=RequestLimits.from_config(config),
    )
    sockets = [sock]
    if options.disaggregation_mode == "prefill":  # SGLang's router sends decode servers here to find each room's state
        state.rooms = Rooms(options.kv_transfer_timeout)
        sockets.append(_bind(options.host, options.disaggregation_bootstrap_port))
    return _event_loop_run(_run(state, options, sockets, time.monotonic() - started))


def _event_loop_run(main) -> int:
    """Run the server's coroutine on uvloop where it is installed (uvicorn's own choice), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def _run(state: ServerState, options: ServeOptions, sockets: list[socket.socket], load_seconds: float) -> int:
    from .app import build_app

    failed: list[str] = []
    server: _Server | None = None

    def on_dead(message: str) -> None:
        failed.append(message)
        state.draining = True
        if server is not None:
            asyncio.get_running_loop().call_later(DEAD_EXIT_DELAY_S, setattr, server, "should_exit", True)

    state.engine.on_dead = on_dead
    app = build_app(state, options.api_key, options.max_request_bytes, docs=options.docs)
    config = uvicorn.Config(
        app, log_level="warning", access_log=options.access_log, timeout_graceful_shutdown=math.ceil(options.shutdown_timeout),
        timeout_keep_alive=5,
    )
    if options.access_log:  # uvicorn logs each request at INFO, below the level set for the rest of its lines
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    server = _Server(config, state)
    state.engine.start()
    ready = asyncio.create_task(_announce(server, state, options, load_seconds))
    try:
        await server.serve(sockets=sockets)
    finally:
        ready.cancel()
        await state.engine.stop()
    if failed:
        print(f"deepinfer: error: the engine failed: {failed[0]}; exiting so the server is restarted", file=sys.stderr)
        return 1
    return 0


async def _announce(server: _Server, state: ServerState, options: ServeOptions, load_seconds: float) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host = f"[{options.host}]" if ":" in options.host else options.host
    auth = ", API key required" if options.api_key else ""
    print(
        f"deepinfer: ready: serving {', '.join(map(repr, state.model_names))} at http://{host}:{options.port} "
        f"(loaded in {load_seconds:.1f} s{auth})", file=sys.stderr, flush=True,
    )


def api_key_from_env(given: str | None) -> str | None:
    """``--api-key``, else ``DEEPINFER_API_KEY``; an empty key means none."""
    key = given if given is not None else os.environ.get("DEEPINFER_API_KEY")
    return key or None

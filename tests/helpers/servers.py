"""Real ``deepinfer serve`` processes for tests: started on a free port, waited for until ``/health`` answers
200, and always stopped — the whole process group, so the ranks of an ``--ep`` server die with it.

- ``ServerProcess``: one server (a context manager); ``.url``, ``.proc``, ``.log_text()``, ``.stop()``.
- ``ServerPool``: starts servers and stops every one it started when it closes (a test's factory).
- ``running_server``: one server for a ``with`` block (a module-scoped fixture's body).

A test module wires them to fixtures::

    @pytest.fixture(scope="module")
    def server(tmp_path_factory):
        with running_server(log_dir=tmp_path_factory.mktemp("server")) as s:
            yield s

    @pytest.fixture
    def serve(tmp_path):
        with ServerPool(tmp_path) as pool:
            yield pool.start
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]

#: seconds a server may take to answer ``/health`` 200 (an ``--ep`` group on a busy machine is slow)
READY_TIMEOUT_S = 240.0
#: variables of the caller's environment that would change how the server runs (``DEEPINFER_<FIELD>`` are engine
#: settings, ``DEEPINFER_API_KEY`` the key): a test names what it wants in ``env``
_CLEARED_PREFIXES = ("DEEPINFER_",)
_CLEARED = ("TRITON_INTERPRET", "ASCEND_RT_VISIBLE_DEVICES")
#: deepinfer's variables a server keeps: where start-up profiles are cached is no engine setting
_KEPT = ("DEEPINFER_CACHE_DIR",)
#: start attempts when the port picked is taken by someone else meanwhile
_PORT_ATTEMPTS = 3


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int, args: list[str]) -> list[str]:
    """``python -m deepinfer.cli serve --port PORT ARGS`` with this interpreter."""
    return [sys.executable, "-m", "deepinfer.cli", "serve", "--port", str(port), *args]


def server_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment without deepinfer's settings, one OpenMP thread, then ``env``. The profile cache's
    directory (``DEEPINFER_CACHE_DIR``) is kept: every server of a run shares the start-up profiles."""
    full = {k: v for k, v in os.environ.items()
            if (not k.startswith(_CLEARED_PREFIXES) or k in _KEPT) and k not in _CLEARED}
    full["OMP_NUM_THREADS"] = "1"
    full.update(env or {})
    return full


class ServerExited(RuntimeError):
    """The server process ended before it was ready (the message carries its log's tail)."""


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, what: str, log_tail: Callable[[], str]) -> None:
    """Until ``url``'s ``/health`` answers 200; ``ServerExited`` when ``proc`` ends first, ``TimeoutError`` past
    ``timeout_s`` (``what`` names the server in the message, ``log_tail`` gives its log's end)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            code = proc.poll()
            if code is not None:
                raise ServerExited(f"{what} exited with status {code} before it was ready:\n{log_tail()}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} was not ready within {timeout_s:.0f} s:\n{log_tail()}")
            time.sleep(0.25)


class ServerLog:
    """A server's output file (``log_path``) read back."""

    log_path: Path

    def log_text(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class ServerProcess(ServerLog):
    """One ``deepinfer serve`` process in a session (and process group) of its own; its output goes to ``log_path``."""

    def __init__(self, args: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None,
                 log_dir: Path | None = None, ready_timeout: float = READY_TIMEOUT_S) -> None:
        self.args = list(args)
        self.env = server_env(env)
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="deepinfer-serve-"))
        self.ready_timeout = ready_timeout
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.log_path = self.log_dir / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the server was not started"
        return self.proc.pid

    # ----- lifecycle -----

    def start(self) -> ServerProcess:
        """Start the server and wait until ``/health`` is 200; raises (after stopping it) when it cannot get there."""
        for attempt in range(_PORT_ATTEMPTS):
            self.port = free_port()
            self.log_path = self.log_dir / (f"server-{self.port}.log")
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(serve_command(self.port, self.args), env=self.env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                self._wait_ready()
                return self
            except ServerExited:
                self.kill()
                if "cannot listen on" in self.log_text() and attempt + 1 < _PORT_ATTEMPTS:
                    continue  # another process took the port between the pick and the bind
                raise
            except BaseException:
                self.kill()
                raise
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        wait_healthy(self.proc, self.url, self.ready_timeout, "the server", self.log_tail)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` to the server process and wait up to ``timeout`` s for it to exit; its exit status.
        Past the timeout the whole group is killed and ``TimeoutError`` raised. Either way no process of
        the group is left."""
        assert self.proc is not None, "the server was not started"
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the server did not exit within {timeout:.0f} s of signal {sig}:\n{self.log_tail()}") from None
        self._kill_group()
        return code

    def wait(self, timeout: float) -> int:
        """The exit status once the server exits by itself within ``timeout`` s (else ``TimeoutError``)."""
        assert self.proc is not None, "the server was not started"
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the server did not exit within {timeout:.0f} s:\n{self.log_tail()}") from None

    def kill(self) -> None:
        """SIGKILL the whole process group (the server and its ranks) and reap the server."""
        if self.proc is None:
            return
        self._kill_group()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout: float = 15.0) -> None:
        """Stop the server if it still runs (SIGTERM, then SIGKILL of the group past ``timeout``)."""
        if self.proc is None:
            return
        try:
            self.stop(signal.SIGTERM, timeout)
        except TimeoutError:
            pass

    # ----- looking at it -----

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def children(self) -> list[int]:
        """Pids of every process below the server (its engine process, and an ``--ep`` engine's ranks,
        ``deepinfer.ranks.rank_main``)."""
        found: list[int] = []
        todo = [self.pid]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    kids = [int(p) for p in (task / "children").read_text().split()]
                except OSError:
                    continue
                found += kids
                todo += kids
        return sorted(set(found))

    def rank_pids(self) -> list[int]:
        """The processes below the server running ``deepinfer.ranks.rank_main``, in start order (rank 0 first)."""
        ranks = []
        for pid in self.children():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"deepinfer.ranks.rank_main" in cmdline:
                ranks.append(pid)
        return ranks


def start_server(args: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None, log_dir: Path | None = None,
                 ready_timeout: float = READY_TIMEOUT_S) -> ServerProcess:
    """A started, ready server (stop it with ``close`` or use it in ``with``)."""
    return ServerProcess(args, env, log_dir, ready_timeout).start()


@contextmanager
def running_server(args: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None, log_dir: Path | None = None,
                   ready_timeout: float = READY_TIMEOUT_S) -> Iterator[ServerProcess]:
    """A ready server for the ``with`` block, stopped at its end whatever happened."""
    server = ServerProcess(args, env, log_dir, ready_timeout)
    try:
        yield server.start()
    finally:
        server.close()


class ServerPool:
    """Starts servers (``start(*args, env=...)``) and stops all of them when it closes, on failure too."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.servers: list[ServerProcess] = []

    def start(self, *args: str, env: dict[str, str] | None = None, ready_timeout: float = READY_TIMEOUT_S) -> ServerProcess:
        log_dir = None
        if self.log_dir is not None:
            log_dir = self.log_dir / f"server{len(self.servers)}"
            log_dir.mkdir(parents=True, exist_ok=True)
        server = ServerProcess(list(args), env, log_dir, ready_timeout)
        self.servers.append(server)  # before start: a server that fails to get ready is still stopped
        return server.start()

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""``deepinfer serve`` and the routers on test hosts (``tests/helpers/hosts.py``): each started inside a host's
network namespace, listening on the host's own address, and waited for from the test process over the bridge
(``http://<host address>:<port>``), never over loopback. Every process is stopped (its whole session) when the
``Hosts`` close, and sooner by ``HostServer.close`` / ``routed``'s exit.

- ``HostServer(host, args, log_dir)``: one server on ``host`` (``.url``, ``.log_tail()``, ``.close()``).
- ``start_all(servers)``: start several side by side (their loading overlaps), each waited for.
- ``routed(host, command, log)``: a router command line on ``host``, its URL once it routes a completion.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path


from tests.helpers.hosts import Host, stop_group
from tests.helpers.routers import wait_routing
from tests.helpers.servers import READY_TIMEOUT_S, ROOT, ServerLog, serve_command, server_env, wait_healthy

#: the port every server listens on in its own host (a namespace has every port free)
SERVE_PORT = 8000
#: a prefill server's bootstrap port (SGLang's router)
BOOTSTRAP_PORT = 8998
#: the port a router listens on in its host
ROUTER_PORT = 30000
#: seconds a router may take to register its workers and route a first completion
ROUTER_READY_S = 180.0


class HostServer(ServerLog):
    """One ``deepinfer serve`` on ``host``, listening on the host's address (``--host <address>``)."""

    def __init__(self, host: Host, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 port: int = SERVE_PORT, bind: str | None = None) -> None:
        self.host = host
        self.port = port
        self.args = ["--host", bind or host.address, *args]
        self.env = server_env(env)
        self.log_path = Path(log_dir) / f"{host.name}-{port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{self.port}"

    def start(self) -> HostServer:
        """Start the server and wait until ``/health`` is 200 (stopped again when it does not get there)."""
        self.launch()
        try:
            self.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def launch(self) -> HostServer:
        """Start the server's process on its host (``wait_ready`` waits for it)."""
        self.proc = self.host.popen(serve_command(self.port, self.args), log=self.log_path, env=self.env, cwd=ROOT)
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until ``/health`` answers 200 from this (the client's) side of the bridge; raises when the server exits first
        or ``timeout_s`` passes."""
        wait_healthy(self.proc, self.url, timeout_s, f"the server on {self.host.address}", self.log_tail)

    def close(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server's session, SIGKILL it past ``grace_s``."""
        if self.proc is None:
            return
        stop_group(self.proc, grace_s)
        if self.proc in self.host.processes:
            self.host.processes.remove(self.proc)


def start_all(servers: list[HostServer]) -> list[HostServer]:
    """Start ``servers`` side by side and wait for each; on any failure every one is stopped and it raises."""
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(HostServer.start, servers))
    except BaseException:
        for s in servers:
            s.close()
        raise
    return servers


@contextmanager
def routed(host: Host, command: list[str], log: Path, model: str = "tiny-v4", port: int = ROUTER_PORT) -> Iterator[str]:
    """The router ``command`` on ``host`` (``--host``, ``--port`` and ``--prometheus-port`` added), once it routes a
    completion; its URL. Stopped on exit, failure too."""
    argv = [*command, "--host", host.address, "--port", str(port), "--prometheus-port", str(port + 1)]
    proc = host.popen(argv, log=log, env={**os.environ, "NO_COLOR": "1"})
    url = f"http://{host.address}:{port}"
    try:
        wait_routing(proc, url, log, ROUTER_READY_S, model)
        yield url
    finally:
        stop_group(proc, 10.0)
        if proc in host.processes:
            host.processes.remove(proc)

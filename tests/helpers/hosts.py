"""Hosts for tests: network namespaces on one bridge, each a machine with its own interface and address.

``Hosts(n)`` makes ``n`` namespaces, each joined to a bridge in this (the test's) namespace by a veth pair,
with an address of its own on a private test subnet in RFC 2544's benchmarking range (198.18.0.0/15,
never anyone's network). The test process is a further machine on that subnet (the bridge's address,
``Hosts.client``): it reaches every host over the bridge, never over loopback, and a host's loopback is
its own. ``Host.popen`` starts a process on a host; ``Host.link_down`` cuts the host's cable. Teardown
kills every process started on the hosts and removes the namespaces and links, on failure too.

Tests that need hosts skip with ``namespaces_unavailable()``'s one line where they cannot be made (not root,
no ``ip``, no namespace support).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

#: the first two octets of the test subnets (RFC 2544's benchmarking range)
SUBNET_PREFIX = "198.18"
#: the bridge's (the test process's) host number on each subnet, and the first host's
CLIENT_HOST, FIRST_HOST = 1, 10
#: seconds a stopped process group gets between SIGTERM and SIGKILL
STOP_GRACE_S = 5.0
#: per-namespace files ``ip netns exec`` mounts over ``/etc``'s
NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done


def namespaces_unavailable() -> str | None:
    """Why test hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip` (apt-get install iproute2)"
    probe = f"di-probe-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"this kernel or container cannot make network namespaces: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


def _no_name_server(netns: str) -> None:
    """Give the host a ``resolv.conf`` without name servers (``ip netns exec`` mounts ``/etc/netns/NAME/``'s files
    over ``/etc``'s): this machine's name server is unreachable from the test subnet, and every reverse lookup a
    library makes of a peer (torch's TCPStore does one per connection) would otherwise wait for it to time out,
    longer than the peer waits for an answer. Names then resolve from ``/etc/hosts`` alone, at once."""
    folder = NETNS_ETC / netns
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "resolv.conf").write_text("# a test host: no name server (tests/helpers/hosts.py)\noptions timeout:1 attempts:1\n")


def _free_subnet() -> str:
    """A /24 of the test range no route of this machine uses (concurrent test runs take different ones)."""
    routes = _ip("-4", "route", "show").stdout
    start = os.getpid() % 200
    for k in range(200):
        third = 20 + (start + k) % 200
        subnet = f"{SUBNET_PREFIX}.{third}"
        if f"{subnet}.0/24" not in routes:
            return subnet
    raise RuntimeError("no free test subnet in 198.18.20.0 - 198.18.219.0")


@dataclass
class Host:
    """One machine: a namespace, its address, and the cable (the bridge-side veth) that joins it."""

    name: str
    address: str
    cable: str
    processes: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: list[str], log: Path | None = None, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        """Start ``argv`` on this host in a session of its own (output to ``log``); stopped at teardown."""
        out = open(log, "wb") if log is not None else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(self.command(argv), env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not None:
                out.close()
        self.processes.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to its end; its result (output captured)."""
        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout)

    def link_down(self) -> None:
        """Cut this host's cable: nothing reaches it or leaves it until ``link_up``."""
        _ip("link", "set", self.cable, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.cable, "up")

    def stop(self) -> None:
        """Stop every process started here: their whole sessions, SIGTERM then SIGKILL."""
        for proc in self.processes:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.processes:
            _kill_group_after(proc, max(0.0, deadline - time.monotonic()))
        self.processes.clear()


def stop_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """Stop ``proc``'s whole session: SIGTERM, then SIGKILL (to anything of it still left) after ``grace_s``."""
    _signal_group(proc, signal.SIGTERM)
    _kill_group_after(proc, grace_s)


def _kill_group_after(proc: subprocess.Popen, wait_s: float) -> None:
    """Give ``proc`` ``wait_s`` to end, then SIGKILL whatever of its session is left and reap it."""
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Hosts:
    """``n`` hosts on one bridge (a context manager): ``hosts[i].address``, ``hosts.client`` (this process's
    address on their subnet)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"dibr{self.tag}"
        self.hosts: list[Host] = []
        self.subnet = ""
        self.client = ""

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __iter__(self):
        return iter(self.hosts)

    def _make(self) -> None:
        self.subnet = _free_subnet()
        self.client = f"{self.subnet}.{CLIENT_HOST}"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.client}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            name = f"di-{self.tag}-h{i}"
            host = Host(name, f"{self.subnet}.{FIRST_HOST + i}", f"di{self.tag}h{i}")
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
            self.hosts.append(host)
            _no_name_server(name)
            _ip("link", "add", host.cable, "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("link", "set", host.cable, "master", self.bridge, "up")
            _ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=name)
            _ip("link", "set", "eth0", "up", netns=name)
            _ip("link", "set", "lo", "up", netns=name)
            _ip("route", "add", "default", "via", self.client, netns=name)

    def close(self) -> None:
        """Stop every host's processes and remove the namespaces, the cables and the bridge."""
        for host in self.hosts:
            host.stop()
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=30)
            shutil.rmtree(NETNS_ETC / host.name, ignore_errors=True)
            _ip("link", "del", host.cable, check=False)
        _ip("link", "del", self.bridge, check=False)
        self.hosts.clear()

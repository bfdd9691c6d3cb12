"""Expert parallelism across hosts, as it is deployed: one ``torchrun`` per machine (here, per network namespace
with its own interface and loopback; ``tests/helpers/hosts.py``), meeting through the c10d rendezvous at host 0.

- ``torchrun --nnodes 2 --nproc-per-node 1|2 --rdzv-backend c10d --rdzv-endpoint HOST0:PORT ... deepinfer.cli
  generate`` gives the output of EP 1 (before ``deepinfer.net``, each rank offered its peer a loopback address:
  "Gloo connectFullMesh failed ... Connection refused, remote=[127.0.0.1]").
- a host whose link goes down mid-stream ends every process of the group, on both hosts, soon after
  ``--ep-timeout-s``, each rank with one line naming the rank it lost, and leaves no process behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import process_tree
from tests.helpers.hosts import Hosts, namespaces_unavailable
from tests.helpers.servers import ROOT, server_env

pytestmark = pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))

FAST = ["--speculative", "none", "--enforce-eager", "--max-num-seqs", "4"]
PROMPTS = ["def read_file(path):", "The capital of France is"]
#: seconds a rank waits in a collective (and for a silent peer's machine) before the group is declared failed
EP_TIMEOUT_S = 10
#: after EP_TIMEOUT_S: the time to notice, name the lost rank and exit (torchrun's agents included) on a busy machine
EXIT_SLACK_S = 50
#: bound on a group's start (two processes loading the model on a shared 2-core machine)
START_TIMEOUT_S = 240


def torchrun(hosts: Hosts, i: int, port: int, args: list[str], nproc: int = 1) -> list[str]:
    """Host ``i``'s ``torchrun`` of a 2-machine group meeting at host 0 through the c10d rendezvous.

    ``--local-addr``: the address this machine is known by (torchrun otherwise tells the ranks to meet at its
    hostname, which resolves to loopback here); ``is_host``: host 0 runs the rendezvous store (torchrun cannot tell
    an address of a secondary interface is its own); ``read_timeout``: how long an agent waits for the rendezvous
    store (an agent cut off from it otherwise stays a minute per try after its rank ended)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{port}", "--rdzv-id", f"ep{port}",
            "--rdzv-conf", f"is_host={int(i == 0)},read_timeout=5,close_timeout=2", "--local-addr", hosts[i].address, "--max-restarts", "0",
            "-m", "deepinfer.cli", *args]


def _env() -> dict[str, str]:
    env = server_env({"OMP_NUM_THREADS": "1"})
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in procs]


def _generate_args() -> list[str]:
    return ["generate", *[a for p in PROMPTS for a in ("--prompt", p)], "--max-tokens", "12", *FAST,
            "--ep-timeout-s", str(EP_TIMEOUT_S)]


@pytest.mark.parametrize("nproc", [1, 2], ids=["ep2", "ep4"])
def test_two_hosts_generate_as_ep1(tmp_path: Path, nproc: int):
    reference = subprocess.run([sys.executable, "-m", "deepinfer.cli", *_generate_args()], env=_env(), cwd=ROOT,
                               capture_output=True, text=True, timeout=180)
    assert reference.returncode == 0, reference.stderr[-2000:]
    with Hosts(2) as hosts:
        logs = [tmp_path / f"host{i}.log" for i in range(2)]
        outs = [tmp_path / f"host{i}.out" for i in range(2)]
        procs = []
        for i, host in enumerate(hosts):
            argv = ["sh", "-c", 'out=$0 err=$1; shift; exec "$@" >"$out" 2>"$err"', str(outs[i]), str(logs[i]),
                    *torchrun(hosts, i, 29400, _generate_args(), nproc)]
            procs.append(host.popen(argv, env=_env(), cwd=ROOT))
        codes = _wait(procs, START_TIMEOUT_S)
        text = [log.read_text(errors="replace") for log in logs]
        assert codes == [0, 0], f"exit statuses {codes}:\n" + "\n".join(t[-3000:] for t in text)
        assert "connectFullMesh" not in "".join(text)
        # torchrun prefixes nothing on stdout: rank 0 prints the outputs, the other ranks nothing
        assert outs[0].read_text() == reference.stdout
        assert outs[1].read_text() == ""


class _Stream:
    """A long streamed completion read on a thread: ``started`` once tokens arrive; ``ended`` (monotonic) and
    ``last`` (the last event) when it ends."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.started = threading.Event()
        self.ended: float | None = None
        self.last = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        body = {"prompt": PROMPTS[0], "temperature": 0.0, "ignore_eos": True, "stream": True, "max_tokens": 600}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.started.set()
                        self.last = line
        except httpx.HTTPError as exc:
            self.last = repr(exc)
        self.ended = time.monotonic()


def _ready(url: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p in procs), "a torchrun exited while starting"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no /health 200 from {url} within {timeout_s:.0f} s")


def test_a_host_whose_link_goes_down_ends_the_group(tmp_path: Path):
    seen: list[process_tree.Proc] = []
    with Hosts(2) as hosts:
        logs = [tmp_path / f"host{i}.log" for i in range(2)]
        serve = ["serve", "--host", "0.0.0.0", "--port", "8000", *FAST, "--ep-timeout-s", str(EP_TIMEOUT_S)]
        procs = [host.popen(torchrun(hosts, i, 29500, serve), log=logs[i], env=_env(), cwd=ROOT) for i, host in enumerate(hosts)]
        try:
            url = f"http://{hosts[0].address}:8000"
            _ready(url, procs, START_TIMEOUT_S)
            # --host 0.0.0.0 serves every interface: the host's own loopback too, not only the address peers reach
            inside = hosts[0].run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "http://127.0.0.1:8000/health"])
            assert inside.stdout == "200", inside
            for p in procs:
                seen += [process_tree.proc(p.pid)] + process_tree.descendants(p.pid)
            stream = _Stream(url)
            assert stream.started.wait(120), "the stream never started"
            for p in procs:
                seen += [q for q in process_tree.descendants(p.pid) if q not in seen]
            hosts[1].link_down()
            cut = time.monotonic()
            codes = _wait(procs, EP_TIMEOUT_S + EXIT_SLACK_S)
            took = time.monotonic() - cut
            text = [log.read_text(errors="replace") for log in logs]
            assert None not in codes, f"still running {took:.0f} s after the link went down:\n" + "\n".join(t[-3000:] for t in text)
            assert all(c != 0 for c in codes), codes
            # every process of the group, on both hosts, is gone: torchrun's agents, the server, its engine process
            left = process_tree.wait_gone([p for p in seen if p is not None], 10.0)
            assert not left, "orphans:\n" + process_tree.describe(left)
            lines = [[l for l in t.splitlines() if l.startswith("deepinfer: error:")] for t in text]
            assert any("lost rank 1 of 2" in l for l in lines[0]), "\n".join(lines[0]) or text[0][-3000:]
            assert any("lost rank 0 of 2" in l for l in lines[1]), "\n".join(lines[1]) or text[1][-3000:]
            assert stream.ended is not None and stream.ended - cut < EP_TIMEOUT_S + EXIT_SLACK_S
            event = json.loads(stream.last[6:]) if stream.last.startswith("data: {") else {}
            assert "error" in event or "Error" in stream.last, stream.last  # the request failed, it did not hang
        finally:
            process_tree.kill_all([p for p in seen if p is not None])


def test_a_loopback_rendezvous_across_machines_is_refused_in_one_line(monkeypatch):
    """torchrun's c10d rendezvous without ``--local-addr`` tells the ranks to meet at node 0's hostname, which
    resolves to loopback on many machines: refused, naming the flag, instead of a hang or a gloo error."""
    from deepinfer.errors import ConfigError
    from deepinfer.ranks.launch import torchrun_rank

    for var, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "1", "MASTER_ADDR": "localhost"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("DEEPINFER_RANK_SPEC", raising=False)
    with pytest.raises(ConfigError, match="--local-addr") as caught:
        torchrun_rank()
    assert "\n" not in str(caught.value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one machine: loopback is right
    place = torchrun_rank()
    assert place is not None and place.num_nodes == 1 and place.rendezvous_host == "localhost"


def test_the_lost_rank_is_the_one_whose_machine_does_not_answer():
    """A failed collective is blamed on the rank whose machine answers nothing (its link is down); a machine
    that answers (refuses a connection) only broke off its connections; the engine's own errors are not blamed."""
    from deepinfer.net import answer_probes
    from deepinfer.ranks.rank_server import RankServer, _collective_error

    assert _collective_error(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv"))
    assert not _collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    with Hosts(1) as hosts:
        server = RankServer.__new__(RankServer)
        server.rank, server.world, server.timeout_s = 0, 2, EP_TIMEOUT_S
        server.peers = [(hosts.client, answer_probes(hosts.client)), (hosts[0].address, 9)]
        error = RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection closed by peer [198.18.0.11]:1234")
        line, silent = server.lost_line(error)
        assert not silent and line.startswith("lost rank 1 of 2: it broke off its connections"), line
        hosts[0].link_down()
        line, silent = server.lost_line(error)
        assert silent and line.startswith(f"lost rank 1 of 2: its machine {hosts[0].address} does not answer"), line
        assert line.endswith("stopped rank 0 (restart the group)") and "\n" not in line

"""No orphans: every process ``deepinfer serve`` starts dies with it when it is SIGKILLed (so it cannot stop
them itself), in every role and shape — colocated, prefill, decode, ``--ep N``, torchrun ranks — idle, mid-step,
or stuck in a step that never returns (a stopped process stands for a hung kernel or collective: it cannot
notice anything itself).

Each server test starts a real server, records every process below it (pid and start time, so a reused pid is
not mistaken for it), SIGKILLs the server process alone (not its group) and waits until none of them is alive.
``deepinfer.lifetime.die_with_parent`` itself is checked first, in both of its ways (the kernel's signal, the
watchdog thread)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from deepinfer.lifetime import ORPHAN_EXIT_STATUS
from tests.helpers import process_tree
from tests.helpers.process_tree import Proc
from tests.helpers.servers import ROOT, ServerProcess, free_port, serve_command, server_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks /proc")

#: seconds the processes below a killed server may take to die (about 0.2 s on a quiet machine)
DIE_WITHIN_S = 30.0
#: flags that make a server start sooner; no test here depends on what they turn off
FAST = ["--speculative", "none", "--enforce-eager", "--max-num-seqs", "4"]


# ----- die_with_parent itself -----

#: a child bound to its parent (argv: the parent's pid, "1" when the parent's thread lives); says so on stderr, then sleeps
_CHILD = """
import sys, time
from deepinfer.lifetime import die_with_parent
die_with_parent(int(sys.argv[1]), parent_thread_lives=sys.argv[2] == "1")
print("bound", file=sys.stderr, flush=True)
time.sleep(120)
"""
#: a parent that starts ``_CHILD`` and prints its pid (argv: the child; the pid the child is told is its parent's, "" for
#: this process's; the child's thread flag; "thread": start it from a thread that ends when a line arrives on stdin)
_PARENT = """
import os, subprocess, sys, threading
kids, started = [], threading.Event()
def start():
    kids.append(subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2] or str(os.getpid()), sys.argv[3]]))
    started.set()
    if sys.argv[4] == "thread":
        sys.stdin.readline()
if sys.argv[4] == "thread":
    thread = threading.Thread(target=start)
    thread.start()
    started.wait()
    print(kids[0].pid, flush=True)
    thread.join()
    print("thread ended", flush=True)
else:
    start()
    print(kids[0].pid, flush=True)
sys.exit(kids[0].wait())
"""


@contextmanager
def _parent_and_child(told_parent: str = "", thread_lives: bool = True,
                      from_thread: bool = False) -> Iterator[tuple[subprocess.Popen, Proc]]:
    """A parent (its stdin, stdout and stderr piped: the child's stderr too) and the child it started."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, told_parent, "1" if thread_lives else "0",
                               "thread" if from_thread else "main"], cwd=ROOT, env=server_env(), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    child = None
    try:
        child = process_tree.proc(int(parent.stdout.readline()))
        yield parent, child
    finally:
        if child is not None:
            process_tree.kill_all([child])
        with suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)


@pytest.mark.parametrize("thread_lives", [True, False], ids=["pdeathsig", "watchdog"])
def test_a_bound_child_dies_with_its_parent(thread_lives):
    with _parent_and_child(thread_lives=thread_lives) as (parent, child):
        assert parent.stderr.readline().strip() == "bound"
        assert process_tree.is_alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        assert not process_tree.wait_gone([child], DIE_WITHIN_S), "the child outlived its parent"


def test_a_child_started_by_a_thread_that_ends_lives_until_its_parent_dies():
    """The kernel's signal fires when the parent's *thread* ends: a child started from a thread that ends first is
    watched instead (``parent_thread_lives=False``, as ``spawn_ranks`` passes from any thread but the main one)."""
    with _parent_and_child(thread_lives=False, from_thread=True) as (parent, child):
        assert parent.stderr.readline().strip() == "bound"
        parent.stdin.write("end\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "thread ended"
        assert process_tree.wait_gone([child], 1.0) == [child], "the child died with its parent's thread"
        os.kill(parent.pid, signal.SIGKILL)
        assert not process_tree.wait_gone([child], DIE_WITHIN_S), "the child outlived its parent"


def test_a_child_whose_parent_is_already_gone_exits_at_once():
    """The parent died before the child bound itself (here: the child is told another parent): it exits."""
    with _parent_and_child(told_parent="1") as (parent, child):
        assert parent.wait(DIE_WITHIN_S) == ORPHAN_EXIT_STATUS
        assert parent.stderr.read() == ""  # it never got past die_with_parent


# ----- real servers -----


class TorchrunServer(ServerProcess):
    """``torchrun --nproc-per-node N -m deepinfer.cli serve``: ``proc`` is torchrun's agent; rank 0 serves HTTP."""

    def __init__(self, args: list[str], nproc: int, log_dir: Path) -> None:
        super().__init__(args, log_dir=log_dir)
        self.nproc = nproc

    def start(self) -> TorchrunServer:
        self.port = free_port()
        self.log_path = self.log_dir / f"torchrun-{self.port}.log"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.nproc), "--master-addr", "127.0.0.1",
                   "--master-port", str(free_port()), *serve_command(self.port, self.args)[1:]]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, env=self.env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def worker(self, rank: int) -> Proc:
        """The process torchrun started as ``rank``."""
        for kid in process_tree.children(self.pid):
            try:
                env = Path(f"/proc/{kid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return process_tree.proc(kid)
        raise AssertionError(f"torchrun has no rank {rank} worker")


class Watched:
    """A started server and every process ever seen below it."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.seen: list[Proc] = []

    @property
    def url(self) -> str:
        return self.server.url

    def below(self) -> list[Proc]:
        """The processes below the server now (remembered for the cleanup)."""
        procs = process_tree.descendants(self.server.pid)
        self.seen += [p for p in procs if p not in self.seen]
        return procs


@contextmanager
def started(server: ServerProcess) -> Iterator[Watched]:
    """``server`` started; at the end, whatever happened, it, its group and every process once seen below it are
    killed (torchrun starts its workers in sessions of their own, so killing the server's group is not enough)."""
    watched = Watched(server)
    try:
        server.start()
        watched.below()
        yield watched
    finally:
        if server.alive:
            watched.below()
        server.kill()
        process_tree.kill_all(watched.seen)
        process_tree.wait_gone(watched.seen, 10.0)


class LongStream:
    """A streamed completion that runs for the rest of the context, read in a thread; ``wait_started`` returns once
    its first tokens arrived (the engine is stepping it)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.started = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        body = {"prompt": "def read_file(path):", "temperature": 0.0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                        self.started.set()
        except httpx.HTTPError:
            pass  # the server was killed under it

    def wait_started(self, timeout: float = 120.0) -> None:
        assert self.started.wait(timeout), "the long completion streamed nothing"


def kill_and_check(watched: Watched, before_kill: Callable[[list[Proc]], None] | None = None, victim: Proc | None = None) -> None:
    """SIGKILL ``victim`` (default: the server process alone, not its group) and assert that every process below the
    server dies within ``DIE_WITHIN_S``. ``before_kill`` gets those processes first (to stop one, say)."""
    below = watched.below()
    assert below, "the server started no process"
    if before_kill is not None:
        before_kill(below)
    os.kill(victim.pid if victim is not None else watched.server.pid, signal.SIGKILL)
    victims = [p for p in below if p != victim]
    left = process_tree.wait_gone(victims, DIE_WITHIN_S)
    assert not left, (f"{len(left)} of the {len(victims)} processes below the killed {'process' if victim else 'server'} "
                      f"outlived it by {DIE_WITHIN_S:.0f} s:\n{process_tree.describe(left)}\nserver log:\n{watched.server.log_tail()}")


def _engine_process(procs: list[Proc]) -> Proc:
    found = [p for p in procs if "multiprocessing.spawn" in process_tree.cmdline(p)]
    assert len(found) == 1, process_tree.describe(procs)
    return found[0]


def _ranks(procs: list[Proc]) -> list[Proc]:
    return [p for p in procs if "deepinfer.ranks.rank_main" in process_tree.cmdline(p)]


def test_colocated_server_killed_mid_step(tmp_path):
    with started(ServerProcess(FAST, log_dir=tmp_path)) as server:
        LongStream(server.url).wait_started()
        kill_and_check(server)


def test_prefill_server_killed_while_its_engine_is_stuck(tmp_path):
    """The engine process stopped (SIGSTOP: a step that never returns) cannot notice the server is gone itself."""
    args = ["--disaggregation-mode", "prefill", "--kv-connector", "store", "--kv-store", str(tmp_path / "kv"), *FAST]
    with started(ServerProcess(args, log_dir=tmp_path)) as server:
        kill_and_check(server, lambda below: os.kill(_engine_process(below).pid, signal.SIGSTOP))


def test_decode_server_killed(tmp_path):
    args = ["--disaggregation-mode", "decode", "--kv-connector", "store", "--kv-store", str(tmp_path / "kv"), *FAST]
    with started(ServerProcess(args, log_dir=tmp_path)) as server:
        kill_and_check(server)


def test_expert_parallel_server_killed_mid_step_with_a_hung_rank(tmp_path):
    """``--ep 2`` mid-step, its last rank stopped (a rank hung in a collective: the others wait on it)."""
    with started(ServerProcess(["--ep", "2", *FAST], log_dir=tmp_path)) as server:
        LongStream(server.url).wait_started()

        def hang_a_rank(below: list[Proc]) -> None:
            ranks = _ranks(below)
            assert len(ranks) == 2, process_tree.describe(below)
            os.kill(ranks[-1].pid, signal.SIGSTOP)

        kill_and_check(server, hang_a_rank)


def test_torchrun_agent_killed_mid_step(tmp_path):
    """Under torchrun every worker (rank 0, which serves HTTP, included) and rank 0's engine die with the agent."""
    with started(TorchrunServer(FAST, 2, tmp_path)) as server:
        LongStream(server.url).wait_started()
        kill_and_check(server)


def test_torchrun_rank0_killed(tmp_path):
    """Rank 0's process killed: its engine dies with it, and torchrun stops the other rank."""
    with started(TorchrunServer(FAST, 2, tmp_path)) as server:
        kill_and_check(server, victim=server.server.worker(0))

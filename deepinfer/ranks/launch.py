"""Starting the ranks of an expert-parallel group: spawned on this machine, or under torchrun.

``spawn_ranks`` starts one ``python -m deepinfer.ranks.rank_main`` process
per rank (nothing of the caller's script is re-imported, so it needs no
``__main__`` guard); they rendezvous on a free local port. Each rank connects
back to the front over an authenticated local socket: rank 0 carries the
tick protocol's commands and reports on it, every rank reports its failure on
it as one line before it exits, and a rank whose front goes away stops. A
rank's own output goes to a log file in the group's directory.
``torchrun_rank`` reads torchrun's environment instead; there every process
is a rank and rank 0 is the front.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

from deepinfer_interfaces.distributed import free_local_port
from deepinfer_interfaces.errors import first_line

from ..config import EngineConfig
from ..errors import DeepInferError
from ..net import is_loopback
from .protocol import Tick

#: seconds rank 0 waits for a command before it ticks anyway (a heartbeat: a dead rank is noticed while idle)
HEARTBEAT_S = 0.5
#: environment variable carrying a spawned rank's ``RankPlace`` and how to reach its front
SPEC_ENV = "DEEPINFER_RANK_SPEC"
#: environment variable naming torchrun's agent (``RUN_ID:PID``) to the processes below its worker
LAUNCHER_ENV = "DEEPINFER_TORCHRUN_AGENT"


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs and how it meets the others."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str
    #: machines in the group (EPLB keeps expert groups within one when it can)
    num_nodes: int = 1
    #: the host the ranks meet at (torchrun's ``MASTER_ADDR``); None for a group spawned on this machine
    rendezvous_host: str | None = None


def torchrun_rank() -> RankPlace | None:
    """This process's place when torchrun (or any launcher setting its variables) started it with more than one rank."""
    env = os.environ
    if SPEC_ENV in env or int(env.get("WORLD_SIZE", "1")) <= 1 or "RANK" not in env or "MASTER_ADDR" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    if "TORCHELASTIC_RUN_ID" in env:  # the first process torchrun started: its parent is torchrun's agent
        env.setdefault(LAUNCHER_ENV, f"{env['TORCHELASTIC_RUN_ID']}:{os.getppid()}")
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    num_nodes = max(1, world // max(local_world, 1))
    master = env["MASTER_ADDR"]
    if num_nodes > 1 and is_loopback(master):
        from ..errors import ConfigError

        raise ConfigError(
            f"torchrun told rank {env['RANK']} to meet rank 0 at MASTER_ADDR={master}, a loopback address, though the group "
            f"spans {num_nodes} machines; start torchrun with --local-addr <this machine's address> on every machine "
            f"(under --rdzv-backend c10d) or --master-addr <machine 0's address>"
        )
    return RankPlace(int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), "env://", num_nodes, master)


def end_launcher() -> None:
    """After this rank lost another machine: end torchrun's agent on this machine when it would not restart the
    group anyway (``--max-restarts 0``). An agent cut off from the rendezvous store (on the lost machine, or
    across the lost link) otherwise waits on it for minutes after its ranks ended; its other ranks die with it
    (``lifetime.die_with_parent``)."""
    env = os.environ
    run_id, _, pid = env.get(LAUNCHER_ENV, "").rpartition(":")
    if not pid.isdigit() or run_id != env.get("TORCHELASTIC_RUN_ID") or env.get("TORCHELASTIC_MAX_RESTARTS", "0") != "0":
        return
    try:
        os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def failure_line(exc: BaseException) -> str:
    """A rank's failure as one line: a user-facing error's own message, anything else with its type."""
    if isinstance(exc, DeepInferError) and str(exc).strip():
        return str(exc).strip().splitlines()[0]
    return first_line(exc)


def lead(server, conn: Connection) -> None:
    """Rank 0 of a spawned group: ticks with the front's commands; sends reports back while there is news.
    A closed front connection stops the group."""
    reports = server.tick(Tick())  # every rank is up once this returns
    conn.send(("ready", reports))
    busy = False
    while not server.stopped:
        commands = []
        try:
            if busy or conn.poll(HEARTBEAT_S):
                while conn.poll():
                    commands.extend(conn.recv())
        except (EOFError, OSError):
            from .protocol import Shutdown

            commands = [Shutdown()]
        reports = server.tick(Tick(commands))
        busy = any(r.stepped for r in reports) or any(r.outstanding_tokens for r in reports)
        if not server.stopped and (commands or any(r.outputs or r.metrics is not None for r in reports)):
            conn.send(("reports", reports))


@dataclass
class SpawnedGroup:
    """The processes of a spawned group and the front's ends of their connections."""

    processes: list[subprocess.Popen]
    #: rank 0's connection: commands out, reports in
    conn: Connection
    #: every rank's connection, by rank (failures arrive on them)
    conns: list[Connection]
    log_dir: Path

    def send(self, commands: list) -> None:
        self.conn.send(commands)

    def failures(self) -> list[tuple[int, str]]:
        """``(rank, line)`` of every failure the ranks reported so far."""
        out = []
        for rank, c in enumerate(self.conns):
            if c is self.conn:
                continue  # rank 0's failures are read with its reports
            try:
                while c.poll():
                    kind, line = c.recv()
                    out.append((rank, line))
            except (EOFError, OSError):
                pass
        return out

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the ranks to exit, then kill whatever is left."""
        for p in self.processes:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)
        for c in self.conns:
            c.close()


def spawn_ranks(config: EngineConfig, world_size: int, start_timeout_s: float) -> SpawnedGroup:
    """Start ``world_size`` rank processes on this machine and wait until each has connected back."""
    key = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    log_dir = Path(tempfile.mkdtemp(prefix="deepinfer-ep-"))
    init = f"tcp://127.0.0.1:{free_local_port()}"
    procs = []
    # each rank dies with this process (``lifetime.die_with_parent``): with this very thread when it is the main one
    parent = {"pid": os.getpid(), "thread_lives": threading.current_thread() is threading.main_thread()}
    for rank in range(world_size):
        spec = {"place": asdict(RankPlace(rank, world_size, rank, init)), "front": list(listener.address), "key": key.hex(),
                "config": config.model_dump_json(), "parent": parent}
        env = dict(os.environ, **{SPEC_ENV: json.dumps(spec)})
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
        log = open(log_dir / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "deepinfer.ranks.rank_main"], env=env, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT))
        log.close()
    conns: list[Connection | None] = [None] * world_size
    accepted = threading.Event()

    def accept() -> None:
        for _ in range(world_size):
            try:
                c = listener.accept()
            except OSError:
                return
            conns[c.recv()] = c
        accepted.set()

    threading.Thread(target=accept, daemon=True, name="deepinfer-ep-accept").start()
    waited = 0.0
    while not accepted.wait(0.2):
        waited += 0.2
        dead = [(r, p.returncode) for r, p in enumerate(procs) if p.poll() is not None]
        if dead or waited > start_timeout_s:
            for p in procs:
                p.kill()
            listener.close()
            from ..errors import RankFailure

            r, code = dead[0] if dead else (None, None)
            tail = _last_line(log_dir / f"rank{r}.log") if r is not None else ""
            what = f"rank {r} exited with status {code} while starting" if dead else f"the ranks did not start within {start_timeout_s:.0f} s"
            raise RankFailure(f"{what}{': ' + tail if tail else ''} (logs in {log_dir})")
    listener.close()
    return SpawnedGroup(procs, conns[0], conns, log_dir)


def _last_line(path: Path) -> str:
    try:
        lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def connect_front(spec: dict) -> Connection:
    """A spawned rank's connection to its front, announced with its rank."""
    conn = Client(tuple(spec["front"]), authkey=bytes.fromhex(spec["key"]))
    conn.send(spec["place"]["rank"])
    return conn

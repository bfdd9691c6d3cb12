"""One rank of an expert-parallel group: its engine, stepped in lockstep through the tick protocol.

Control messages go over their own gloo group (object collectives on the
host), apart from the data communicator the model's dispatch and combine use
(gloo, NCCL or HCCL). A tick is: rank 0 broadcasts the commands, each rank
applies its own, one all-reduce tells whether any rank has work, if so every
rank steps once (an empty step joins the others' dispatch and combine), and
rank 0 gathers the reports.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from concurrent.futures import ThreadPoolExecutor

from ..engine import Engine
from ..errors import DeepInferError, RankFailure
from ..net import host_answers
from .launch import end_launcher
from ..request import Request
from .protocol import Abort, AddRequest, Command, FlushCache, Metrics, PackedState, RankReport, Shutdown, Tick


#: words of the errors torch.distributed's libraries raise (gloo's come as plain ``RuntimeError``)
_COLLECTIVE_WORDS = ("gloo", "nccl", "hccl", "c10d", "timed out", "connection", "peer", "socket")


def _collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective or the rendezvous store (a lost peer), not from the engine itself."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error) or isinstance(exc, ConnectionError):
        return True
    text = str(exc).lower()
    return any(w in text for w in _COLLECTIVE_WORDS)


def control_group(timeout_s: float) -> "dist.ProcessGroup":
    """A gloo group over every rank for the tick protocol (every rank must call this, in the same order)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _outstanding(req: Request) -> int:
    """Tokens a request still costs: what remains to compute of its prompt and to generate, per completion."""
    return sum(max(c.max_total_tokens - c.num_computed_tokens, 0) for c in req.siblings if not c.finished)


class RankServer:
    """Applies a tick's commands to this rank's engine, steps it, and reports."""

    def __init__(self, engine: Engine, group: "dist.ProcessGroup", peers: list[tuple[str, int]] | None = None,
                 timeout_s: float = 0.0) -> None:
        self.engine = engine
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.stopped = False
        #: across machines (torchrun): each rank's address and the port it answers probes on (``net.answer_probes``),
        #: by rank, to tell which one was lost when a collective fails
        self.peers = peers
        self.timeout_s = timeout_s

    def tick(self, tick: Tick | None = None) -> list[RankReport] | None:
        """Run one tick (``tick`` is rank 0's; others pass None). Rank 0 gets every rank's report. Across machines,
        a collective that fails (a peer's link or machine is down) raises ``RankFailure`` naming the lost rank."""
        if self.peers is None:
            return self._tick(tick)
        try:
            return self._tick(tick)
        except (RuntimeError, ConnectionError) as exc:
            if not _collective_error(exc):
                raise  # the engine's own fault: reported as such
            line, silent = self.lost_line(exc)
            print(f"deepinfer: error: {line}", file=sys.stderr, flush=True)
            if silent:  # a machine is gone: this machine's torchrun agent cannot reach the group's store either
                end_launcher()
            raise RankFailure(line) from None

    def lost_line(self, exc: BaseException) -> tuple[str, bool]:
        """One line naming the rank this one lost: the first whose machine does not answer at all, else (two
        ranks) the other one; and whether a machine does not answer."""
        others = [r for r in range(self.world) if r != self.rank]
        machines = self._other_machines()
        with ThreadPoolExecutor(max(1, len(machines))) as pool:
            answers = dict(zip(machines, pool.map(lambda r: host_answers(*self.peers[r]), machines)))
        silent = [r for r in machines if not answers[r]]
        lost = silent[0] if silent else others[0] if len(others) == 1 else None
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        stop = f"stopped rank {self.rank} (restart the group)"
        if lost is None:
            return f"a collective of the expert-parallel group failed on rank {self.rank} of {self.world}: {cause}; {stop}", False
        why = f"its machine {self.peers[lost][0]} does not answer" if lost in silent else "it broke off its connections"
        return (f"lost rank {lost} of {self.world}: {why} (waited up to {self.timeout_s:.0f} s, --ep-timeout-s; "
                f"{cause.split('] ')[-1]}); {stop}"), bool(silent)

    def _other_machines(self) -> list[int]:
        """The first rank on each machine other than this one's (one probe per machine, not per rank)."""
        first: dict[str, int] = {}
        for r, (address, _) in enumerate(self.peers):
            first.setdefault(address, r)
        return [r for address, r in first.items() if address != self.peers[self.rank][0]]

    def watch_peers(self, interval_s: float = 1.0) -> threading.Thread:
        """Across machines: a thread that ends this process (status 1, one line naming the rank) once another
        machine of the group (probed once a second at its first rank's probe port) has not answered for
        ``timeout_s``, also while no collective runs to notice it (an idle group, a rank waiting for rank 0's tick)."""

        def watch() -> None:
            last_heard = {r: time.monotonic() for r in self._other_machines()}
            while not self.stopped:
                now = time.monotonic()
                for r in last_heard:
                    if host_answers(*self.peers[r], timeout_s=interval_s):
                        last_heard[r] = time.monotonic()
                    elif now - last_heard[r] > self.timeout_s and not self.stopped:
                        print(f"deepinfer: error: lost rank {r} of {self.world}: its machine {self.peers[r][0]} has not "
                              f"answered for {self.timeout_s:.0f} s (--ep-timeout-s); stopped rank {self.rank} "
                              f"(restart the group)", file=sys.stderr, flush=True)
                        end_launcher()
                        os._exit(1)
                time.sleep(interval_s)

        thread = threading.Thread(target=watch, daemon=True, name="deepinfer-peer-watch")
        thread.start()
        return thread

    def _tick(self, tick: Tick | None) -> list[RankReport] | None:
        box = [tick]
        dist.broadcast_object_list(box, src=0, group=self.group)
        tick = box[0]
        changed: dict[str, Request] = {}
        metrics = False
        for cmd in tick.commands:
            if isinstance(cmd, Shutdown):
                self.stopped = True
            elif isinstance(cmd, Metrics):
                metrics = True
            elif isinstance(cmd, FlushCache):
                self.engine.reset_prefix_cache()
            elif cmd.rank == self.rank:
                req = self._apply(cmd)
                if req is not None:
                    changed[req.request_id] = req
        busy = torch.tensor([int(self.engine.has_unfinished)], dtype=torch.int64)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.group)
        stepped = bool(busy.item()) and not self.stopped
        if stepped:
            for req in self.engine.step():
                changed[req.request_id] = req
        report = self._report(changed, stepped, metrics)
        gathered: list[RankReport] | None = [None] * self.world if self.rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(report, gathered, dst=0, group=self.group)
        return gathered

    def _apply(self, cmd: Command) -> Request | None:
        if isinstance(cmd, AddRequest):
            roles = {"hold_kv": True} if cmd.hold_kv else {"prefilled": cmd.prefilled.unpack()} if cmd.prefilled is not None else {}
            return self.engine.add_request(cmd.prompt, cmd.params, request_id=cmd.request_id, **roles)
        if isinstance(cmd, Abort):
            self.engine.abort(cmd.request_id)
            return self.engine.requests.get(cmd.request_id)
        return None

    def _report(self, changed: dict[str, Request], stepped: bool, metrics: bool) -> RankReport:
        report = RankReport(self.rank, stepped=stepped)
        for rid, req in changed.items():
            out = self.engine.output(req)
            report.outputs.append(out)
            if req.all_finished:
                report.finished.append(rid)
                if req.hold_kv and out.error is None:
                    try:
                        report.exported[rid] = self._export(rid)
                    except DeepInferError as exc:  # the request fails, the rank goes on
                        out.error = f"exporting the KV state failed: {exc}"
        self.engine.release(report.finished)
        report.outstanding_tokens = sum(_outstanding(r) for r in self.engine.requests.values())
        report.load = self.engine.load()
        report.max_model_len = self.engine.max_model_len
        if metrics:
            report.metrics = self.engine.get_metrics()
        return report

    def _export(self, request_id: str) -> PackedState:
        """A finished prefill request's state, off the device; its cache is freed at once."""
        try:
            return PackedState.pack(self.engine.export_prefilled(request_id))
        finally:
            self.engine.release_prefilled(request_id)

    def close(self) -> None:
        """Stop the engine (its executor, its store writes) and leave the process groups."""
        self.engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    def serve(self) -> None:
        """A rank other than 0: take ticks until rank 0 says stop."""
        while not self.stopped:
            self.tick()

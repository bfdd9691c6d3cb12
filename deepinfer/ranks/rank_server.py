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

import torch
import torch.distributed as dist

from ..engine import Engine
from ..errors import DeepInferError
from ..request import Request
from .protocol import Abort, AddRequest, Command, FlushCache, Metrics, PackedState, RankReport, Shutdown, Tick


def control_group(timeout_s: float) -> "dist.ProcessGroup":
    """A gloo group over every rank for the tick protocol (every rank must call this, in the same order)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _outstanding(req: Request) -> int:
    """Tokens a request still costs: what remains to compute of its prompt and to generate, per completion."""
    return sum(max(c.max_total_tokens - c.num_computed_tokens, 0) for c in req.siblings if not c.finished)


class RankServer:
    """Applies a tick's commands to this rank's engine, steps it, and reports."""

    def __init__(self, engine: Engine, group: "dist.ProcessGroup") -> None:
        self.engine = engine
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.stopped = False

    def tick(self, tick: Tick | None = None) -> list[RankReport] | None:
        """Run one tick (``tick`` is rank 0's; others pass None). Rank 0 gets every rank's report."""
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

"""This rank's share of every MoE layer's routed experts, and how tokens reach them.

Attention is data parallel: each rank runs its own requests. In every MoE
layer a rank maps its tokens' logical experts to physical replicas (the
layer's ``ExpertPlacement``, the one logical → physical map), sends them to
the ranks holding those replicas through the Communicator's ``dispatch``,
runs the experts it holds on what it received, and brings the results back
with ``combine``. ``begin_step`` first agrees with every rank on the step's
layout (``lockstep.agree``). Padding tokens route to no expert. The device
tables a graph reads (routing tables, load counters, expert weights) are only
ever updated in place.

Load is counted on the device as tokens are routed (no host sync). Every
``eplb_interval`` steps the window's load, summed over ranks, gives each layer
a new placement (``eplb.plan``, the same on every rank); the weights then move
one layer per step (``weight_moves``), so no step waits for more than one
layer's transfer, and a layer switches to its new map exactly when its
weights have arrived.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from deepinfer_interfaces import Communicator

from ..errors import ConfigError
from ..models.common.moe import ExpertCompute, MoE
from .counters import EPCounters
from .eplb import EPLBSettings, LoadWindow, plan
from .lockstep import StepDispatch, StepKind, agree
from .placement import ExpertPlacement
from .weight_moves import move_experts


#: the least rise in a layer's expected balancedness worth moving its experts for
MIN_GAIN = 0.02


class ExpertParallel:
    """The ``ExpertSharding`` of one rank: placements, device tables, load counters and weight moves."""

    def __init__(
        self, comm: Communicator, num_layers: int, num_experts: int, top_k: int, device: torch.device, eplb: EPLBSettings,
        deterministic: bool = False,
    ) -> None:
        """``deterministic``: every step dispatches in the fixed layout (combine then sums each token's expert
        outputs in rank order, whatever the backend's fast path) and a token's replica follows its position
        alone, so its result depends neither on its row in the batch nor on the other ranks' tokens."""
        self.comm = comm
        self.deterministic = deterministic
        self.rank, self.world = comm.rank, comm.world_size
        self.device = torch.device(device)
        self.top_k = top_k
        self.eplb = eplb
        try:
            identity = ExpertPlacement.identity(num_experts, self.world, eplb.num_redundant)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.placements: list[ExpertPlacement] = [identity] * num_layers
        #: per layer, the device tables the forward routes by (updated in place by ``_move``)
        self._tables = [identity.to(self.device) for _ in range(num_layers)]
        physical = identity.num_physical
        self._physical_load = torch.zeros(num_layers, physical, dtype=torch.int64, device=self.device)
        self._logical_load = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=self.device)
        self.window = LoadWindow(eplb.window, num_layers, num_experts)
        self.capacity: int | None = None
        #: the graphs' sizes: a fixed capacity is the token count of one of them (None: no graphs)
        self.capture_sizes: list[int] | None = None
        #: most drafts a verify graph's sequence brings (0: no verify graphs)
        self.capture_drafts = 0
        self.steps = 0
        self.counters = EPCounters(balancedness=[None] * num_layers)
        #: per token of the current forward, what spreads it over an expert's replicas, and whether it is real
        self._index: torch.Tensor | None = None
        self._live: torch.Tensor | None = None
        self._pending: deque[tuple[int, ExpertPlacement]] = deque()
        self.moe_layers: list[MoE] = []

    # ----- ExpertSharding -----

    def local_experts(self, layer: int) -> list[int]:
        return [int(e) for e in self.placements[layer].local_logical(self.rank).tolist()]

    def begin_forward(self, positions: torch.Tensor, live: torch.Tensor) -> None:
        # spread over replicas by row and position: rows of one step differ, and so do one row's steps
        # (deterministic: by position alone, so a token's replica does not depend on its row in the batch)
        self._index = positions if self.deterministic else positions + torch.arange(positions.shape[0], device=positions.device)
        self._live = live

    def routed(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, compute: ExpertCompute
    ) -> torch.Tensor:
        table = self._tables[layer]
        if self._index is not None and self._index.shape[0] == x.shape[0]:
            index = self._index
            topk_ids = torch.where(self._live[:, None], topk_ids, -1)  # padding reaches no expert
        else:  # an idle rank's empty step
            index = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
        physical = table.to_physical(topk_ids, index)
        self._count(layer, topk_ids, physical)
        t0 = time.perf_counter()
        fixed = {} if self.capacity is None else {"capacity": self.capacity}  # communicators older than the fixed layout
        got = self.comm.dispatch(x, physical, topk_weights, table.physical_rank, table.physical_local, **fixed)
        t1 = time.perf_counter()
        y = compute(got.hidden, got.topk_ids, got.topk_weights)
        t2 = time.perf_counter()
        out = self.comm.combine(y, got.handle)
        self.counters.dispatch_seconds += t1 - t0
        self.counters.combine_seconds += time.perf_counter() - t2
        return out

    def _count(self, layer: int, logical: torch.Tensor, physical: torch.Tensor) -> None:
        """Tokens per logical expert and per physical replica, added on the device."""
        for load, ids in ((self._logical_load[layer], logical), (self._physical_load[layer], physical)):
            flat = ids.reshape(-1)
            load.index_add_(0, flat.clamp(min=0), (flat >= 0).to(torch.int64))

    # ----- the lockstep step -----

    def use_graphs(self, sizes: list[int], drafts: int) -> None:
        """Let ``begin_step`` agree on graphs: the capture sizes (sorted) and the drafts a verify graph's sequence brings."""
        self.capture_sizes = sizes
        self.capture_drafts = drafts

    def begin_step(self, num_seqs: int, num_tokens: int, kind: StepKind) -> StepDispatch:
        """Agree with every rank on this step's kind and dispatch layout (one small all-reduce of the
        most sequences, tokens and kind any rank brings). Prefill anywhere: variable splits. Else a fixed
        capacity: the token count of the graph every rank replays, a verify graph when any rank verifies,
        of the smallest capture size holding every rank's batch; without one (no graphs, or more than
        the largest holds), the most tokens any rank brings, run eagerly."""
        vote = torch.tensor([num_seqs, num_tokens, int(kind)], dtype=torch.int64, device=self.device)
        self.comm.all_reduce(vote, op="max")
        seqs, tokens, step_kind = (int(v) for v in vote.tolist())
        dispatch = agree(seqs, tokens, StepKind(step_kind), self.capture_sizes, self.capture_drafts)
        if self.deterministic and dispatch.capacity is None:  # variable splits sum in arrival order on some backends
            dispatch = StepDispatch(max(tokens, 1))
        self.capacity = dispatch.capacity
        return dispatch

    def use_capacity(self, tokens: int) -> None:
        """Fix the dispatch layout at ``tokens`` rows per rank without a vote: every rank captures the
        same graphs in the same order, each with the capacity of its size."""
        self.capacity = tokens

    def end_step(self) -> None:
        """After every rank's forward: record the load, re-plan when due, move at most one layer."""
        self.steps += 1
        self.window.record(self._logical_load)
        self._logical_load.zero_()
        interval = self.eplb.interval
        if interval and self.steps % interval == 0 and not self._pending:
            self._replan()
        if self._pending:
            layer, placement = self._pending.popleft()
            self._move(layer, placement)

    def _replan(self) -> None:
        load = self.comm.all_reduce(self.window.total().to(self.device), op="sum").cpu()
        self.refresh_balance()
        if self.counters.balancedness_before is None:
            self.counters.balancedness_before = list(self.counters.balancedness)
            self.counters.balancedness_total_before = self.counters.balancedness_total
        changed = False
        for layer, current in enumerate(self.placements):
            new = plan(load[layer], self.world, self.eplb.num_redundant, self.eplb.num_nodes, self.eplb.num_groups, current)
            # move weights only for a real gain on the measured load (the same decision on every rank)
            gain = new.expected_balancedness(load[layer]) - current.expected_balancedness(load[layer])
            if gain > MIN_GAIN and not torch.equal(new.physical_to_logical, current.physical_to_logical):
                self._pending.append((layer, new))
                changed = True
        if changed:
            self.counters.rebalances += 1

    def refresh_balance(self) -> list[float | None]:
        """Balancedness per layer of the traffic since the last rebalance, over every rank (collective)."""
        load = self.comm.all_reduce(self._physical_load.clone(), op="sum").cpu()
        per_rank = torch.zeros(self.world, dtype=torch.int64)
        for layer, placement in enumerate(self.placements):
            self.counters.balancedness[layer] = placement.balancedness(load[layer]) if int(load[layer].sum()) else None
            per_rank.index_add_(0, placement.physical_rank.cpu(), load[layer])
        self.counters.balancedness_total = float(per_rank.float().mean() / per_rank.max()) if int(per_rank.sum()) else None
        return self.counters.balancedness

    def metrics(self) -> dict:
        """The figures ``get_metrics`` reports (refreshes the balance figures: every rank calls it in the same tick)."""
        self.refresh_balance()
        c = self.counters
        return {
            "size": self.world, "num_redundant_experts": self.eplb.num_redundant, "eplb_interval": self.eplb.interval,
            "dispatch_seconds": c.dispatch_seconds, "combine_seconds": c.combine_seconds,
            "balancedness": list(c.balancedness), "balancedness_total": c.balancedness_total,
            "balancedness_before": c.balancedness_before, "balancedness_total_before": c.balancedness_total_before,
            "rebalances": c.rebalances, "layers_moved": c.layers_moved, "experts_moved": c.experts_moved,
        }

    def _move(self, layer: int, new: ExpertPlacement) -> None:
        """Switch one layer to ``new``: every slot whose expert changes gets its weights from a rank
        holding that expert now (itself when it can), all tensors through one ``all_to_all`` each."""
        moe = self.moe_layers[layer]
        moved = move_experts(self.comm, moe.expert_tensors(), self.placements[layer], new)
        self.placements[layer] = new
        self._tables[layer].assign_(new.to(self.device))
        moe.slots = self.local_experts(layer)
        self._physical_load[layer].zero_()
        self.counters.layers_moved += 1
        self.counters.experts_moved += moved

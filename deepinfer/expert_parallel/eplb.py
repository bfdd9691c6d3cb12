"""The expert-parallel load balancer: replicas for hot experts and a balanced packing onto ranks.

From each logical expert's measured load (tokens routed to it over a window,
summed over ranks) ``plan`` decides how many replicas each expert gets
(each extra slot goes to the expert with the most load per replica), then
packs the replicas onto the ranks' slots heaviest first, each onto the
least-loaded rank with a free slot that does not hold that expert yet.
Hierarchically, when the experts form groups that divide evenly over the
machines, groups are packed onto machines first (so a token's experts tend to
sit on one machine) and replicas within each machine; otherwise globally.
Everything is deterministic (ties go to the lower id), so every rank planning
from the same load gets the same placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .placement import ExpertPlacement


@dataclass(frozen=True)
class EPLBSettings:
    """When and how the balancer re-places experts (0 interval: never)."""

    num_redundant: int = 0
    interval: int = 0
    window: int = 64
    num_nodes: int = 1
    num_groups: int | None = None


def _replica_counts(load: list[float], extra: int, cap: int) -> list[int]:
    counts = [1] * len(load)
    for _ in range(extra):
        best = max(
            (e for e in range(len(load)) if counts[e] < cap), key=lambda e: (load[e] / counts[e], -e), default=None
        )
        if best is None:  # every expert already on every rank: replicate the heaviest again
            best = max(range(len(load)), key=lambda e: (load[e] / counts[e], -e))
        counts[best] += 1
    return counts


def _pack(experts: list[int], load: list[float], counts: list[int], ranks: int, per_rank: int) -> list[list[int]]:
    """Replicas of ``experts`` (``counts[i]`` of expert ``experts[i]``, each carrying its share of ``load[i]``)
    onto ``ranks`` ranks of ``per_rank`` slots: heaviest first, least-loaded rank that lacks that expert."""
    items = sorted(
        ((load[i] / counts[i], experts[i]) for i in range(len(experts)) for _ in range(counts[i])), key=lambda t: (-t[0], t[1])
    )
    held: list[list[int]] = [[] for _ in range(ranks)]
    total = [0.0] * ranks
    for weight, expert in items:
        free = [r for r in range(ranks) if len(held[r]) < per_rank]
        fresh = [r for r in free if expert not in held[r]] or free
        r = min(fresh, key=lambda r: (total[r], len(held[r]), r))
        held[r].append(expert)
        total[r] += weight
    return held


def _slots(held: list[int], previous: list[int] | None) -> list[int]:
    """Order one rank's experts over its slots, keeping an expert where it already sits (fewer moves)."""
    if previous is None:
        return sorted(held)
    slots: list[int | None] = [None] * len(held)
    rest = sorted(held)
    for i, had in enumerate(previous):
        if had in rest:
            slots[i] = had
            rest.remove(had)
    it = iter(rest)
    return [s if s is not None else next(it) for s in slots]


def plan(
    load: torch.Tensor,
    world_size: int,
    num_redundant: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    current: ExpertPlacement | None = None,
) -> ExpertPlacement:
    """A placement for one layer from ``load`` ``[L]`` (tokens per logical expert); ``current`` keeps
    experts in the slots they already occupy where the plan allows."""
    if load.dim() != 1 or load.numel() == 0:
        raise ValueError(f"plan needs the load of each logical expert [L]; got shape {tuple(load.shape)}")
    if world_size < 1 or num_redundant < 0 or num_nodes < 1:
        raise ValueError(f"plan needs world_size >= 1, num_redundant >= 0, num_nodes >= 1; got {world_size}, {num_redundant}, {num_nodes}")
    values = [float(v) for v in load.double().cpu().tolist()]
    num_logical = len(values)
    physical = num_logical + num_redundant
    if physical % world_size:
        return ExpertPlacement.identity(num_logical, world_size, num_redundant)  # raises with the numbers
    per_rank = physical // world_size
    hierarchical = (
        num_groups is not None and num_nodes > 1 and num_groups % num_nodes == 0 and world_size % num_nodes == 0
        and num_logical % num_groups == 0 and num_redundant % num_nodes == 0
    )
    if hierarchical:
        size = num_logical // num_groups
        group_load = [sum(values[g * size : (g + 1) * size]) for g in range(num_groups)]
        per_node = num_groups // num_nodes
        nodes = _pack(list(range(num_groups)), group_load, [1] * num_groups, num_nodes, per_node)
        ranks_per_node = world_size // num_nodes
        held: list[list[int]] = []
        for groups in nodes:
            experts = sorted(e for g in groups for e in range(g * size, (g + 1) * size))
            sub = [values[e] for e in experts]
            counts = _replica_counts(sub, num_redundant // num_nodes, ranks_per_node)
            held.extend(_pack(experts, sub, counts, ranks_per_node, per_rank))
    else:
        counts = _replica_counts(values, num_redundant, world_size)
        held = _pack(list(range(num_logical)), values, counts, world_size, per_rank)
    order = []
    for r, experts in enumerate(held):
        previous = current.local_logical(r).tolist() if current is not None else None
        order.extend(_slots(experts, previous))
    return ExpertPlacement(num_logical, world_size, torch.tensor(order, dtype=torch.int64))


class LoadWindow:
    """The last ``window`` steps of tokens per layer and logical expert, as a ring on the load's device.

    Counts are kept per logical expert, not per physical slot, so steps recorded before a layer's
    placement changed still add up to the right experts after it."""

    def __init__(self, window: int, num_layers: int, num_logical: int) -> None:
        if window < 1:
            raise ValueError(f"the load window needs at least one step; got eplb_window = {window}")
        self.window = window
        self.shape = (num_layers, num_logical)
        self._ring: torch.Tensor | None = None
        self.steps = 0

    def record(self, step_load: torch.Tensor) -> None:
        """Add one step's ``[layers, L]`` counts, dropping the oldest step once the window is full."""
        if tuple(step_load.shape) != self.shape:
            raise ValueError(f"a step's load must be [layers, L] = {list(self.shape)}; got {list(step_load.shape)}")
        if self._ring is None:
            self._ring = torch.zeros(self.window, *self.shape, dtype=torch.int64, device=step_load.device)
        self._ring[self.steps % self.window].copy_(step_load)
        self.steps += 1

    def total(self) -> torch.Tensor:
        """``[layers, L]``: the tokens of the steps in the window."""
        if self._ring is None:
            return torch.zeros(self.shape, dtype=torch.int64)
        return self._ring.sum(0)

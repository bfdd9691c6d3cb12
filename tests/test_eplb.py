"""Expert placement and the balancer, without processes: the logical → physical map, replica choice,
planning on skewed loads (global and hierarchical), weight-move lists and the load window."""

from __future__ import annotations

import pytest
import torch

from deepinfer.parallel.eplb import LoadWindow, plan
from deepinfer.parallel.placement import ExpertPlacement


def _zipf(n: int, s: float = 1.2) -> torch.Tensor:
    return (1000.0 / torch.arange(1, n + 1, dtype=torch.float64) ** s).round()


def test_a_placement_checks_its_slots():
    with pytest.raises(ValueError, match=r"--ep 3 does not divide .* 8 \+ 0"):
        ExpertPlacement.identity(8, 3)
    with pytest.raises(ValueError, match="expert 3 has no physical slot"):
        ExpertPlacement(4, 2, torch.tensor([0, 1, 2, 2]))
    p = ExpertPlacement.identity(8, 2, 2)
    assert p.slots_per_rank == 5 and p.local_logical(1).tolist() == [5, 6, 7, 0, 1]
    assert p.replicas.tolist() == [2, 2, 1, 1, 1, 1, 1, 1]
    assert p.logical_to_physical[0].tolist() == [0, 8] and p.logical_to_physical[2].tolist() == [2, -1]
    assert p.physical_rank.tolist() == [0] * 5 + [1] * 5 and p.physical_local.tolist() == [0, 1, 2, 3, 4] * 2


def test_replicas_are_chosen_deterministically_spread_evenly_and_without_graph_breaks():
    p = ExpertPlacement(4, 2, torch.tensor([0, 3, 0, 1, 2, 0]))  # expert 0 in slots 0, 2 and 5
    ids = torch.tensor([[0, 3], [0, -1], [2, 0], [-1, -1]] * 300)
    index = torch.arange(ids.shape[0])
    phys = p.to_physical(ids, index)
    assert torch.equal(phys, p.to_physical(ids, index))
    assert torch.equal(phys == -1, ids == -1)
    valid = ids >= 0
    assert torch.equal(p.physical_to_logical[phys[valid]], ids[valid])
    counts = torch.bincount(phys[ids == 0], minlength=6)[[0, 2, 5]].double()
    assert (counts / counts.sum() - 1 / 3).abs().max() < 0.05
    explained = torch._dynamo.explain(p.to_physical)(ids, index)
    assert explained.graph_break_count == 0


def test_planning_a_skewed_load_balances_it_with_redundant_experts():
    load = _zipf(64)
    identity = ExpertPlacement.identity(64, 8)
    planned = plan(load, 8, 8)
    assert planned.num_physical == 72 and (planned.replicas >= 1).all()
    assert int(planned.replicas[0]) > 1  # the hottest expert is replicated
    before, after = identity.expected_balancedness(load), planned.expected_balancedness(load)
    assert before < 0.6 and after >= 0.9, (before, after)
    for r in range(8):  # no rank holds two replicas of one expert
        held = planned.local_logical(r).tolist()
        assert len(held) == len(set(held))
    assert torch.equal(plan(load, 8, 8).physical_to_logical, planned.physical_to_logical)
    # without redundant slots the packing alone still helps
    assert plan(load, 8, 0).expected_balancedness(load) > before


def test_hierarchical_planning_keeps_each_group_on_one_node_and_falls_back_to_global():
    load = _zipf(32)[torch.randperm(32, generator=torch.Generator().manual_seed(0))]
    p = plan(load, 8, 8, num_nodes=2, num_groups=4)
    node_of_slot = p.physical_rank // 4
    for g in range(4):
        nodes = {int(node_of_slot[s]) for s in range(p.num_physical) if int(p.physical_to_logical[s]) // 8 == g}
        assert len(nodes) == 1, (g, nodes)
    assert p.expected_balancedness(load) > ExpertPlacement.identity(32, 8, 8).expected_balancedness(load)
    # 3 groups do not divide 2 nodes: global planning, as without groups
    assert torch.equal(plan(load, 8, 8, num_nodes=2, num_groups=3).physical_to_logical, plan(load, 8, 8).physical_to_logical)


def test_moves_name_the_changed_slots_and_a_source_holding_each_expert():
    old = ExpertPlacement.identity(8, 2, 2)  # rank 0: 0 1 2 3 4, rank 1: 5 6 7 0 1
    assert old.moved_from(old, 0) == [] and old.moved_from(old, 1) == []
    new = ExpertPlacement(8, 2, torch.tensor([0, 1, 2, 3, 7, 5, 6, 4, 0, 1]))
    assert new.moved_from(old, 0) == [(4, 7, 1)]  # expert 7 only on rank 1 before
    assert new.moved_from(old, 1) == [(2, 4, 0)]
    local = ExpertPlacement(8, 2, torch.tensor([1, 0, 2, 3, 4, 5, 6, 7, 0, 1]))
    assert local.moved_from(old, 0) == [(0, 1, 0), (1, 0, 0)]  # already on the rank: a local copy
    # planning from a current placement keeps experts in their slots where it can
    def moves(p: ExpertPlacement) -> int:
        return sum(len(p.moved_from(old, r)) for r in range(2))

    load = torch.ones(8)
    kept, fresh = plan(load, 2, 2, current=old), plan(load, 2, 2)
    assert sorted(kept.physical_to_logical.tolist()) == sorted(fresh.physical_to_logical.tolist())
    assert moves(kept) < moves(fresh) and moves(kept) <= 2


def test_the_load_window_keeps_the_last_steps_only():
    w = LoadWindow(3, 2, 4)
    assert w.total().sum() == 0
    for step in range(5):
        w.record(torch.full((2, 4), step + 1, dtype=torch.int64))
    assert torch.equal(w.total(), torch.full((2, 4), 3 + 4 + 5, dtype=torch.int64))

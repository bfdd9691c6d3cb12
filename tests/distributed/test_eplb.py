"""Expert placement and the balancer, without processes: the logical → physical map, replica choice,
planning on skewed loads (global and hierarchical), weight-move lists and the load window."""

from __future__ import annotations

import pytest
import torch

from deepinfer.expert_parallel.eplb import LoadWindow, plan
from deepinfer.expert_parallel.placement import ExpertPlacement


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
    # as wide as the most replicas any placement of 10 slots can give one of 8 experts: every placement's tables share a shape
    assert p.logical_to_physical[0].tolist() == [0, 8, -1] and p.logical_to_physical[2].tolist() == [2, -1, -1]
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


def _routed_tokens(num_tokens: int, seed: int, num_experts: int = 64, top_k: int = 6) -> torch.Tensor:
    """``[T, K]`` distinct experts per token, drawn from a zipf popularity (as a router's skew looks)."""
    popularity = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2
    gen = torch.Generator().manual_seed(seed)
    return torch.multinomial(popularity.expand(num_tokens, -1), top_k, replacement=False, generator=gen)


def _slot_counts(p: ExpertPlacement, ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    phys = p.to_physical(ids, index).reshape(-1)
    return torch.bincount(phys[phys >= 0], minlength=p.num_physical)


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("stride", [1, 2])
def test_replicas_share_tokens_evenly_whatever_the_top_k_and_the_index_stride(replicas: int, stride: int):
    # V4 routes 6 experts per token: 2 and 3 divide 6, the hot expert always sits in slot 0, and the
    # index may step by 2 (row + position within one prefill)
    slots = [0, 1, 2, 3] + [0] * (replicas - 1)
    slots += [1] * (-len(slots) % 2)
    p = ExpertPlacement(4, 2, torch.tensor(slots))
    ids = torch.tensor([[0, 1, 2, 3, -1, -1]] * 1200)
    index = stride * torch.arange(1200) + 7
    counts = _slot_counts(p, ids, index)[p.logical_to_physical[0, :replicas]].double()
    assert (counts / counts.sum() - 1 / replicas).abs().max() < 0.05, counts.tolist()


def test_routing_real_tokens_through_the_plan_balances_the_ranks():
    ids_window, ids_next = _routed_tokens(4096, 0), _routed_tokens(4096, 1)
    load = torch.bincount(ids_window.reshape(-1), minlength=64)  # what the window measured
    identity, planned = ExpertPlacement.identity(64, 8), plan(load, 8, 8)
    index = torch.arange(ids_next.shape[0])  # the next tokens, routed through each placement
    before = identity.balancedness(_slot_counts(identity, ids_next, index))
    after = planned.balancedness(_slot_counts(planned, ids_next, index))
    assert before < 0.5 and after >= 0.9, (before, after)


def test_placements_compare_by_value_and_describe_where_dispatch_sends_each_slot():
    p = plan(_zipf(16), 4, 4)
    assert p == plan(_zipf(16), 4, 4) and hash(p) == hash(plan(_zipf(16), 4, 4))
    assert p != ExpertPlacement.identity(16, 4, 4) and p != ExpertPlacement.identity(20, 4)
    for s in range(p.num_physical):  # the receiving rank's local slot holds the expert the token asked for
        rank, local = int(p.physical_rank[s]), int(p.physical_local[s])
        assert int(p.local_logical(rank)[local]) == int(p.physical_to_logical[s])


def test_bad_placements_plans_and_loads_are_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"--ep 3 does not divide .* = 256 \+ 0; choose an EP degree that divides 256"):
        ExpertPlacement.identity(256, 3)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        ExpertPlacement(4, 2, torch.arange(4.0))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        ExpertPlacement(4, 2, torch.arange(4).view(2, 2))
    with pytest.raises(ValueError, match="at least one expert and one rank"):
        ExpertPlacement(4, 0, torch.arange(4))
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        ExpertPlacement(4, 2, torch.tensor([0, 1, 2, 4]))
    assert ExpertPlacement(4, 2, torch.arange(4, dtype=torch.int32)).physical_to_logical.dtype == torch.int64
    p = ExpertPlacement.identity(8, 2)
    with pytest.raises(ValueError, match="cannot move"):
        p.moved_from(ExpertPlacement.identity(8, 2, 2), 0)
    with pytest.raises(ValueError, match=r"one count per physical slot \[8\]"):
        p.balancedness(torch.ones(10))
    assert p.balancedness(torch.zeros(8)) == 1.0
    with pytest.raises(ValueError, match=r"load of each logical expert \[L\]"):
        plan(torch.ones(2, 4), 2, 0)
    with pytest.raises(ValueError, match="num_redundant >= 0"):
        plan(torch.ones(8), 2, -2)
    with pytest.raises(ValueError, match=r"\[layers, L\] = \[2, 4\]"):
        LoadWindow(3, 2, 4).record(torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="eplb_window = 0"):
        LoadWindow(0, 2, 4)


def test_device_tables_take_a_new_placement_in_place_and_route_by_it():
    # a captured graph keeps reading the tables it was captured with: a move must rewrite them, not replace them
    old = ExpertPlacement.identity(16, 4, 4)
    new = plan(_zipf(16), 4, 4, current=old)
    assert new != old and new.logical_to_physical.shape == old.logical_to_physical.shape
    tables = old.to("cpu")
    assert tables.physical_to_logical.data_ptr() != old.physical_to_logical.data_ptr()  # tables of its own
    ptrs = [t.data_ptr() for t in (tables.physical_to_logical, tables.replicas, tables.logical_to_physical)]
    tables.assign_(new)
    assert [t.data_ptr() for t in (tables.physical_to_logical, tables.replicas, tables.logical_to_physical)] == ptrs
    assert tables == new and old == ExpertPlacement.identity(16, 4, 4)
    ids = torch.randint(0, 16, (64, 4), generator=torch.Generator().manual_seed(0))
    index = torch.arange(64)
    assert torch.equal(tables.to_physical(ids, index), new.to_physical(ids, index))
    with pytest.raises(ValueError, match="cannot assign a placement of 16 experts in 16 slots"):
        tables.assign_(ExpertPlacement.identity(16, 4))

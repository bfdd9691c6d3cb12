"""The adaptive policy on synthetic cost models: no drafting, partial verification or full verification,
each where it pays; switching as load and measured costs change within one run; live costs that follow
what steps really take, robust to noise, graph replays apart from eager steps."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer.config import EngineConfig
from deepinfer.spec_decode import StepCostProfile, admit
from deepinfer.spec_decode.admission import plan_drafting
from deepinfer.spec_decode.live_costs import CostKey, LiveCosts
from deepinfer.spec_decode.speculation import EXPLORE_AFTER, REPLAN_STEPS, Speculation, StepOutlook
from deepinfer.stats import EngineStats

SURVIVAL = [0.9, 0.8, 0.7, 0.6, 0.5]
#: memory-bound: a step costs the same up to 512 tokens
FLAT = StepCostProfile.monotone([1, 512, 1024], [10.0, 10.0, 20.0])
#: compute-bound from the start: every token costs the same
LINEAR = StepCostProfile.monotone([1, 64, 1024], [1.05, 4.2, 52.2])
CHEAP_DRAFT = StepCostProfile.monotone([1, 512], [0.5, 0.6])
DEAR_DRAFT = StepCostProfile.monotone([1, 512], [20.0, 200.0])


def _speculation(step: StepCostProfile, draft: StepCostProfile, graph_shape=None, learn: bool = True) -> Speculation:
    spec = Speculation(EngineConfig(speculative_policy="adaptive"), 5, lambda: step, EngineStats(), lambda: draft, graph_shape)
    spec.costs.learn = learn
    return spec


def _decide(spec: Speculation, requests: int) -> tuple[int, float]:
    """(requests drafting, drafts verified per drafting request) for a batch of ``requests`` decodes, once the
    plan for that shape is fresh (a plan serves ``REPLAN_STEPS`` steps of one shape)."""
    outlook = StepOutlook(requests, requests)
    for _ in range(REPLAN_STEPS + 1):
        chosen = spec.drafters([SURVIVAL] * requests, [5] * requests, outlook, budget=4096)
    counts = spec.admit([SURVIVAL] * len(chosen), [5] * len(chosen), 4096, outlook) if chosen else []
    return len(chosen), (sum(counts) / len(chosen) if chosen else 0.0)


def test_each_option_wins_where_it_pays():
    # memory-bound device, cheap draft: everyone drafts and verifies every position
    assert _decide(_speculation(FLAT, CHEAP_DRAFT), 32) == (32, 5.0)
    # compute-bound device: drafting pays only for the likeliest positions (partial verification)
    n, verified = _decide(_speculation(LINEAR, CHEAP_DRAFT), 16)
    assert n == 16 and 0 < verified < 5
    # a draft pass dearer than all it can save: no drafting at all
    assert _decide(_speculation(FLAT, DEAR_DRAFT), 64) == (0, 0.0)
    assert _decide(_speculation(LINEAR, DEAR_DRAFT), 8) == (0, 0.0)


def test_the_choice_follows_load_and_back_within_one_run():
    # a step flat to 64 tokens then linear, a draft pass that grows with requests drafting
    step = StepCostProfile.monotone([1, 64, 1024], [1.0, 1.0, 16.0])
    draft = StepCostProfile.monotone([1, 256], [0.1, 2.0])
    spec = _speculation(step, draft)
    choices = [_decide(spec, r) for r in (1, 8, 128, 512, 8, 1)]
    assert choices[0] == (1, 5.0) and choices[1] == (8, 5.0)
    assert choices[3] == (0, 0.0) and choices[2][1] < 5.0
    assert choices[4] == choices[1] and choices[5] == choices[0]


def test_measured_costs_turn_drafting_off_and_on():
    spec = _speculation(FLAT, CHEAP_DRAFT)
    assert _decide(spec, 16)[0] == 16
    # the device turns out to pay for every verified token (a busier machine than the profile saw)
    for _ in range(8):
        for tokens in (16, 32, 48, 64, 96):
            spec.record_step("verify", False, tokens, 10.0 * tokens / 16, 0, 0.0)
        spec.record_step("decode", False, 16, 10.0, 0, 0.0)
    assert _decide(spec, 16) == (0, 0.0)
    # and the draft pass too; then the verify steps become cheap again: drafting returns
    for _ in range(40):
        for tokens in (16, 32, 48, 64, 96):
            spec.record_step("verify", False, tokens, 10.0, 0, 0.0)
    assert _decide(spec, 16) == (16, 5.0)


def test_the_plain_step_is_always_an_option():
    # drafting nothing is compared with drafting: a plan must beat the plain step's goodput
    plan = plan_drafting([SURVIVAL] * 4, emitted=4, plain_cost=1.0, verify_cost=lambda t: 1.0 + 0 * t, draft_cost=lambda n: 10.0 + 0 * n)
    assert plan.drafters == 0 and plan.goodput == plan.plain_goodput == 4.0
    plan = plan_drafting([SURVIVAL] * 4, emitted=4, plain_cost=1.0, verify_cost=lambda t: 1.0 + 0 * t, draft_cost=lambda n: 0.1 + 0 * n)
    assert plan.drafters == 4 and plan.goodput == pytest.approx((4 + 4 * sum(SURVIVAL)) / 1.1)
    # candidates are taken best first: with room for two requests' drafts, the two likeliest draft
    plan = plan_drafting([SURVIVAL, SURVIVAL, [0.1] * 5], emitted=3, plain_cost=1.0,
                         verify_cost=lambda t: 1.0 + 0.01 * t, draft_cost=lambda n: 0.05 * n)
    assert plan.drafters == 2


def test_graph_steps_are_priced_at_their_padded_size():
    # a verify graph of 8 sequences pads to 48 tokens: verifying one draft costs what verifying all does
    eager = StepCostProfile.monotone([1, 8, 48], [1.0, 1.0, 6.0])
    spec = _speculation(eager, CHEAP_DRAFT, graph_shape=lambda seqs, verify: 48 if verify else 8, learn=False)
    outlook = StepOutlook(8, 8)
    costs = spec.step_cost(outlook, np.asarray([0, 1, 20, 40, 41]))
    assert costs[0] == pytest.approx(1.0) and costs[1] == costs[2] == costs[3] == pytest.approx(6.0)
    assert costs[4] > 6.0  # past the graph's tokens: eager
    # once drafting at all, the padded graph makes every position free: all or nothing
    counts = spec.admit([SURVIVAL] * 8, [5] * 8, 4096, outlook)
    assert counts in ([0] * 8, [5] * 8)


def test_live_costs_follow_observations_robustly():
    prior = StepCostProfile.monotone([1, 16, 64, 256], [1.0, 1.0, 2.0, 8.0])
    costs = LiveCosts(prior, window=8)
    key = CostKey("decode")
    assert costs.seconds(key, np.asarray([16]))[0] == pytest.approx(1.0)
    for s in (3.0, 3.1, 2.9, 3.0, 300.0):  # one outlier among steady 3x observations
        costs.record(key, 16, s)
    assert costs.seconds(key, np.asarray([16]))[0] == pytest.approx(3.0, rel=0.1)
    # a shape never seen borrows the others' corrections; a graph replay is its own shape once seen
    assert costs.seconds(CostKey("verify"), np.asarray([16]))[0] == pytest.approx(3.0, rel=0.1)
    for _ in range(3):
        costs.record(CostKey("decode", graph=True), 16, 0.5)
    assert costs.seconds(CostKey("decode", graph=True), np.asarray([16]))[0] == pytest.approx(0.5, rel=0.1)
    assert costs.seconds(key, np.asarray([16]))[0] == pytest.approx(3.0, rel=0.1)
    # monotone in tokens even when the corrections fall
    for _ in range(3):
        costs.record(key, 64, 0.2)
    grid = costs.seconds(key, np.asarray([1, 16, 32, 64, 128]))
    assert np.all(np.diff(grid) >= 0)
    # a window forgets: newer observations replace old ones
    for _ in range(40):
        costs.record(key, 16, 1.0)
    assert costs.seconds(key, np.asarray([16]))[0] == pytest.approx(1.0, rel=0.1)


def test_a_busier_machine_moves_the_shapes_it_does_not_run():
    prior = StepCostProfile.monotone([1, 16, 64, 256], [1.0, 1.0, 2.0, 8.0])
    costs = LiveCosts(prior, window=16)
    decode, verify = CostKey("decode"), CostKey("verify")
    for _ in range(8):
        costs.record(decode, 16, 1.0)
        costs.record(verify, 64, 2.0)
    before = costs.seconds(verify, np.asarray([64]))[0]
    # from now on only decode steps run, and each takes twice as long: the machine got busier
    for _ in range(40):
        costs.record(decode, 16, 2.0)
    assert costs.seconds(decode, np.asarray([16]))[0] == pytest.approx(2.0, rel=0.1)
    assert costs.seconds(verify, np.asarray([64]))[0] == pytest.approx(2 * before, rel=0.15)


def test_admission_keeps_its_rules():
    profile = StepCostProfile.monotone([1, 16, 64, 128, 256, 512], [1.0, 1.0, 1.0, 2.0, 4.0, 8.0])
    survival = [0.9, 0.75, 0.6, 0.45, 0.3]
    assert [sum(admit([survival] * b, "adaptive", profile=profile)) / b for b in (1, 8, 16, 64)] == [5, 5, 3, 0]
    assert admit([survival, [0.95, 0.2]], "all", budget=3) == [2, 1]
    assert admit([survival], "threshold", threshold=0.5) == [3]
    with pytest.raises(ValueError, match="not one of"):
        admit([survival], "sometimes")


def test_a_close_call_left_unmeasured_is_measured_again():
    # drafting everyone is expected to reach 95 % of the plain step's goodput: not chosen, but after a long
    # run of plain steps the policy drafts for one plan's steps to measure the real costs again
    near = _speculation(FLAT, StepCostProfile.monotone([1, 512], [28.8, 28.8]), learn=False)
    far = _speculation(FLAT, StepCostProfile.monotone([1, 512], [40.0, 40.0]), learn=False)
    outlook = StepOutlook(16, 16)
    for spec, expect in ((near, True), (far, False)):
        picks = [len(spec.drafters([SURVIVAL] * 16, [5] * 16, outlook, 4096)) for _ in range(300)]
        drafting = [i for i, n in enumerate(picks) if n]
        assert picks[:EXPLORE_AFTER] == [0] * EXPLORE_AFTER
        if expect:
            assert drafting and len(drafting) <= (300 // EXPLORE_AFTER) * REPLAN_STEPS, drafting
        else:
            assert not drafting


def test_a_close_call_for_drafting_measures_the_plain_step_again():
    # drafting everyone is expected to beat the plain step by 5 %: chosen, but after a long run of drafting
    # steps one plan's steps run plain to measure them again
    spec = _speculation(FLAT, StepCostProfile.monotone([1, 512], [25.0, 25.0]), learn=False)
    outlook = StepOutlook(16, 16)
    picks = [len(spec.drafters([SURVIVAL] * 16, [5] * 16, outlook, 4096)) for _ in range(300)]
    plain = [i for i, n in enumerate(picks) if not n]
    assert picks[:EXPLORE_AFTER] == [16] * EXPLORE_AFTER
    assert plain and len(plain) <= (300 // EXPLORE_AFTER) * REPLAN_STEPS, plain

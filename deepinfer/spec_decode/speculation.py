"""The engine's side of speculative decoding: the admission policy it applies, what it prices, what it counts.

Each step the scheduler asks two things. Which drafts already made the step
verifies (``admit``), and which of the step's sampling requests draft for the
next step (``drafters``). ``adaptive`` answers both from live step and draft
costs (``LiveCosts``: the start-up profiles corrected by the steps the engine
observes), so drafting stops when the draft pass no longer pays and resumes
when load falls; ``all`` and ``threshold`` always draft for every request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..config import EngineConfig
from ..stats import EngineStats
from ..step import Step
from .admission import StepCostProfile, admit, plan_drafting
from .live_costs import CostKey, LiveCosts, StepKind

#: what the draft is expected to achieve before it has drafted once: the survival of each position
#: (optimistic, so a fresh engine tries drafting when the device is idle and learns the real figures)
FIRST_GUESS = 0.8
#: weight of each new draft's survival rows in the running estimate
ESTIMATE_RATE = 0.05
#: pseudo-verifications (at the draft's own word) behind the calibration of each position's survival
CALIBRATION_PRIOR = 8.0
#: steps a drafting plan serves while the step's shape stays the same (costs and estimates move slowly)
REPLAN_STEPS = 4
#: a close call is overruled for one plan's steps when its other side went unmeasured for long (costs not
#: observed for long drift): a plan that drafts nobody, when the best plan that drafts comes within this share of
#: the plain step's goodput and nobody drafted for this many steps; a plan that drafts, likewise with the plain step
EXPLORE_WITHIN = 0.9
EXPLORE_AFTER = 64
#: token counts the live estimate is reported at
REPORT_POINTS = (1, 8, 32, 64, 128, 256)


@dataclass(frozen=True)
class StepOutlook:
    """What a step (this one, or the next one as this one predicts it) computes besides drafts."""

    #: sequences that sample one token each (they emit it with or without drafts)
    decoding: int
    #: tokens computed besides drafts (decoding tokens plus prefill chunks)
    base_tokens: int

    @property
    def mixed(self) -> bool:
        return self.base_tokens > self.decoding


def step_kind(step: Step) -> StepKind:
    """``decode`` (one token per sequence), ``verify`` (one token and drafts per sequence) or ``mixed``."""
    compute = [s for s in step.sequences if s.num_tokens]
    if all(s.is_decode for s in compute):
        return "decode"
    return "verify" if all(s.decodes for s in compute) else "mixed"


#: (sequences, verify) -> the token count of the graph a decode (verify) step of that many sequences replays,
#: or None when it runs eager
GraphShape = Callable[[int, bool], "int | None"]


class Speculation:
    """Binds the configured policy to the scheduler's questions and records each verification, step and
    draft pass into the engine's counters and the live costs."""

    def __init__(
        self,
        config: EngineConfig,
        gamma: int,
        profile: Callable[[], StepCostProfile],
        stats: EngineStats,
        draft_profile: Callable[[], StepCostProfile] | None = None,
        graph_shape: GraphShape | None = None,
    ) -> None:
        self.policy = config.speculative_policy
        self.threshold = config.speculative_threshold
        self.gamma = min(gamma, config.num_speculative_tokens or gamma)
        self.stats = stats
        self.graph_shape: GraphShape = graph_shape or (lambda seqs, verify: None)
        self.costs: LiveCosts | None = None
        if self.policy == "adaptive":
            self.costs = LiveCosts(profile(), draft_profile() if draft_profile is not None else None)
        #: the last drafting plan: the step shape it was made for, steps since, how many requests it drafts
        self._plan_shape: tuple | None = None
        self._plan_age = 0
        self._drafters = 0
        #: steps since any request last drafted, and since a step last drafted for nobody
        self._plain_steps = 0
        self._drafting_steps = 0
        #: the draft's own survival estimate per position, averaged over the drafts it made
        self.estimate = [FIRST_GUESS ** (j + 1) for j in range(self.gamma)]
        #: per position: the survival the drafts predicted, summed over verifications, and how many survived
        self._predicted = np.zeros(self.gamma)
        self._survived = np.zeros(self.gamma)
        if len(stats.spec_position_verified) < self.gamma:
            stats.spec_position_verified = [0] * self.gamma
            stats.spec_position_accepted = [0] * self.gamma

    # ----- prices -----

    def step_cost(self, outlook: StepOutlook, drafted: np.ndarray) -> np.ndarray:
        """Seconds of a step shaped as ``outlook`` with each count of ``drafted`` tokens added (a decode
        graph, a verify graph or an eager forward, as the runner would run it)."""
        costs = self.costs
        tokens = outlook.base_tokens + np.asarray(drafted, dtype=np.int64)
        if outlook.mixed:
            return costs.step("mixed", False, tokens)
        verify = tokens > outlook.decoding
        out = np.empty(len(tokens))
        for kind, rows in (("decode", ~verify), ("verify", verify)):
            if not rows.any():
                continue
            padded = self.graph_shape(outlook.decoding, kind == "verify")
            fits = rows & (tokens <= padded) if padded is not None else np.zeros_like(rows)
            if fits.any():
                out[fits] = costs.step(kind, True, np.asarray([padded]))[0]
            eager = rows & ~fits
            if eager.any():
                out[eager] = costs.step(kind, False, tokens[eager])
        return out

    # ----- decisions -----

    def admit(self, last: Sequence[Sequence[float] | None], rooms: Sequence[int], budget: int, outlook: StepOutlook | None = None) -> list[int]:
        """Drafted tokens each ready request verifies this step: ``last[r]``, the survival its pending draft
        predicted (None: not known yet, a chained record's), ``rooms[r]``, how many of its drafts it may verify.
        The draft pass that made them is priced in: the cycle spent it."""
        if not last:
            return []
        rows = self._expected(last, rooms)
        outlook = outlook or StepOutlook(len(rows), len(rows))
        cost, sunk = None, 0.0
        if self.costs is not None:
            cost = lambda t: self.step_cost(outlook, t - outlook.base_tokens)  # noqa: E731
            sunk = float(self.costs.draft(np.asarray([len(rows)]))[0])
        counts = admit(rows, self.policy, threshold=self.threshold, cost=cost, base_tokens=outlook.base_tokens,
                       emitted=outlook.decoding, budget=budget, sunk=sunk)
        self.stats.spec_offers += len(rows)
        return counts

    def _matrix(self, last: Sequence[Sequence[float] | None], rooms: Sequence[int]) -> np.ndarray:
        """``[N, γ]`` predicted survival (the running estimate where unknown), zero past each room."""
        g = self.gamma
        rows = np.zeros((len(last), g))
        for i, (row, room) in enumerate(zip(last, rooms)):
            row = self.estimate if not row else row
            k = max(0, min(len(row), room, g))
            rows[i, :k] = row[:k]
        return rows

    def _expected(self, last: Sequence[Sequence[float] | None], rooms: Sequence[int]) -> list[np.ndarray]:
        """Each request's survival per position it may verify, calibrated: each position's prediction times
        the ratio of what survived to what was predicted there over the verifications so far
        (``CALIBRATION_PRIOR`` pseudo-verifications at ratio 1 keep the first ones steady), at most 1 and
        never rising along the drafts."""
        ratio = (self._survived + CALIBRATION_PRIOR) / (self._predicted + CALIBRATION_PRIOR)
        rows = np.minimum.accumulate(np.minimum(self._matrix(last, rooms) * ratio, 1.0), axis=1)
        return [rows[i, : max(0, min(room, self.gamma))] for i, room in enumerate(rooms)]

    def drafters(self, last: Sequence[Sequence[float] | None], rooms: Sequence[int], outlook: StepOutlook, budget: int) -> list[int]:
        """Which candidates draft for the next step, which ``outlook`` predicts. ``last[r]``: the survival
        candidate ``r``'s last draft predicted (None: it has not drafted yet), ``rooms[r]``: how many drafts its
        next step may verify. Under ``adaptive``, those expected to gain most, as many as the drafting plan's
        goodput asks (none when a plain step is better; a close call whose other side went unmeasured for
        ``EXPLORE_AFTER`` steps takes that side for one plan, to measure it again; a plan is made anew when the step's shape changes, else every
        ``REPLAN_STEPS`` steps); else every one."""
        n = len(last)
        if self.costs is None or not n:
            return list(range(n))
        shape = (outlook, n, budget)
        replan = shape != self._plan_shape or self._plan_age >= REPLAN_STEPS
        self._plan_age += 1
        if not replan and not self._drafters:
            self._plain_steps += 1
            self._drafting_steps = 0
            return []
        ranked = np.argsort(-self._matrix(last, rooms).sum(axis=1), kind="stable")
        if replan:
            # what the next drafts will achieve: the measured survival per position (the drafts' own figures
            # pick who drafts first, but over the batch the verifications are what counts)
            measured = self.measured()
            plan = plan_drafting(
                [measured[: max(0, min(rooms[r], self.gamma))] for r in ranked], emitted=outlook.decoding,
                plain_cost=float(self.step_cost(outlook, np.zeros(1))[0]), verify_cost=lambda t: self.step_cost(outlook, t),
                draft_cost=self.costs.draft, budget=budget,
            )
            drafters = plan.drafters
            # a close call whose other side went unmeasured for long: take that side for this plan's steps
            if not drafters and plan.best_goodput >= EXPLORE_WITHIN * plan.plain_goodput and self._plain_steps >= EXPLORE_AFTER:
                drafters = plan.best_drafters
            elif drafters and plan.plain_goodput >= EXPLORE_WITHIN * plan.goodput and self._drafting_steps >= EXPLORE_AFTER:
                drafters = 0
            self._plan_shape, self._plan_age, self._drafters = shape, 1, drafters
        self._plain_steps = 0 if self._drafters else self._plain_steps + 1
        self._drafting_steps = self._drafting_steps + 1 if self._drafters else 0
        return ranked[: self._drafters].tolist()

    def measured(self) -> np.ndarray:
        """Survival per position as verifications measured it (the share of verified positions kept), the
        draft's running estimate standing in as ``CALIBRATION_PRIOR`` pseudo-verifications."""
        s = self.stats
        verified = np.asarray(s.spec_position_verified[: self.gamma], dtype=np.float64)
        kept = np.asarray(s.spec_position_accepted[: self.gamma], dtype=np.float64)
        est = np.asarray(self.estimate)
        return np.minimum.accumulate((kept + CALIBRATION_PRIOR * est) / (verified + CALIBRATION_PRIOR))

    # ----- observations -----

    def record(self, verified: int, accepted: int, predicted: Sequence[float] = ()) -> None:
        """One request's verification: ``verified`` drafts checked, the first ``accepted`` of them kept;
        ``predicted``: the survival its draft gave each position (the calibration learns from the pair)."""
        s = self.stats
        s.spec_verifications += 1
        s.spec_verified_tokens += verified
        s.spec_accepted_tokens += accepted
        for j in range(verified):
            s.spec_position_verified[j] += 1
            s.spec_position_accepted[j] += int(j < accepted)
        n = min(verified, len(predicted), self.gamma)
        if n:
            self._predicted[:n] += np.asarray(predicted[:n], dtype=np.float64)
            self._survived[:n] += np.arange(n) < accepted

    def record_drafts(self, survival: list[tuple[float, ...]]) -> None:
        """The survival rows of the drafts one pass made (the running estimate follows them)."""
        if not survival:
            return
        mean = np.mean([list(r[: self.gamma]) for r in survival], axis=0)
        rate = min(1.0, ESTIMATE_RATE * len(survival))
        self.estimate = [(1 - rate) * e + rate * float(m) for e, m in zip(self.estimate, mean)]

    def record_step(self, kind: StepKind, graph: bool, tokens: int, seconds: float, drafters: int, draft_seconds: float) -> None:
        """One completed step as the engine saw it: its shape, its seconds without the draft pass, and the
        draft pass (``drafters`` requests, ``draft_seconds``) it ran for the next step."""
        if self.costs is None:
            return
        self.costs.record(CostKey(kind, graph), tokens, seconds)
        if drafters:
            self.costs.record(CostKey("draft"), drafters, draft_seconds)

    def live_figures(self) -> dict[str, object]:
        """The live estimates and the start-up profile they correct (ms at a few points), for the metrics."""
        if self.costs is None:
            return {}
        points = tuple(p for p in REPORT_POINTS if p <= max(self.costs.prior.tokens[-1], 1)) or (1,)
        prior = self.costs.prior.costs(np.asarray(points)) * 1e3
        out: dict[str, object] = {
            "spec_cost_startup_ms": [[p, round(float(m), 4)] for p, m in zip(points, prior)],
            "spec_cost_live_ms": self.costs.snapshot(points),
            "spec_cost_samples": {f"{k.kind}/{'graph' if k.graph else 'eager'}": n for k, n in self.costs.samples.items()},
        }
        if self.costs.draft_prior is not None:
            d = self.costs.draft_prior
            dp = tuple(p for p in (1, 8, 32, 64, 128) if p <= d.tokens[-1]) or (1,)
            out["spec_draft_cost_startup_ms"] = [[p, round(float(m), 4)] for p, m in zip(dp, d.costs(np.asarray(dp)) * 1e3)]
        return out

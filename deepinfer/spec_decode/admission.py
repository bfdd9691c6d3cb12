"""Which drafted tokens a step verifies, and whether drafting for the next step pays at all.

A request's drafted position ``j`` survives verification only if every earlier
one does; the draft's confidence head gives that survival probability
``a(r, j)`` (non-increasing in ``j``). Every decision here maximises one
expected goodput: tokens a step emits (one per decoding request, plus the
admitted drafts' survival) over what the step costs.

- **Verification** (``admit``, ``adaptive``): take the batch's candidate
  positions in order of falling survival and keep the prefix whose goodput is
  highest (none, if no prefix beats the plain step). The drafts are already
  made, but the cycle that made them still took the draft pass's time: it
  stays in the price (``sunk``), so the marginal position is weighed against
  the goodput of the whole drafting cycle, not of the verify forward alone
  (which would verify too little).
- **Drafting** (``plan_drafting``): whether the next step gets drafts at all,
  and for how many requests. The price now includes the draft pass (its cost
  by the number of requests drafting) besides the verify forward, and the
  options include drafting nothing (a plain decode), drafting for the requests
  most likely to gain and verifying a prefix, and verifying everything. A
  busy device stops drafting; an idle one drafts for everyone and verifies
  every position.

Step costs come from ``StepCostProfile`` (a measured profile, forced
monotone) or any vectorised cost function (``live_costs.LiveCosts`` corrects
the start-up profile online from the steps the engine observes).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import numpy as np

Policy = Literal["all", "threshold", "adaptive"]
#: seconds of a step at each of an array of token counts
CostFn = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class StepCostProfile:
    """Seconds one forward takes at each measured token count; linear between, extrapolated past the last."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def monotone(cls, tokens: Sequence[int], seconds: Sequence[float]) -> "StepCostProfile":
        """From measurements (any order, noisy): sorted by tokens, the least-squares non-decreasing fit (pool
        adjacent violators: a run that falls is replaced by its mean, so one slow measurement does not raise
        every cost after it)."""
        pairs = sorted(zip(tokens, seconds))
        if not pairs or pairs[0][0] < 1 or any(s <= 0 for _, s in pairs):
            raise ValueError("a step-cost profile needs positive token counts and positive times")
        merged: dict[int, list[float]] = {}
        for t, s in pairs:
            merged.setdefault(t, []).append(s)
        # blocks of (mean, weight, token counts), merged while a block is cheaper than the one before
        blocks: list[tuple[float, int, list[int]]] = []
        for t, ss in merged.items():
            block = (sum(ss) / len(ss), len(ss), [t])
            while blocks and blocks[-1][0] > block[0]:
                mean, weight, ts = blocks.pop()
                total = weight + block[1]
                block = ((mean * weight + block[0] * block[1]) / total, total, ts + block[2])
            blocks.append(block)
        out_t = [t for _, _, ts in blocks for t in ts]
        out_s = [mean for mean, _, ts in blocks for _ in ts]
        return cls(tuple(out_t), tuple(out_s))

    def cost(self, tokens: int) -> float:
        """Seconds of a step computing ``tokens`` tokens (never less than the smallest measured)."""
        t, s = self.tokens, self.seconds
        if tokens <= t[0]:
            return s[0]
        if len(t) == 1:
            return s[0] * tokens / t[0]
        i = min(max(bisect.bisect_left(t, tokens), 1), len(t) - 1)
        slope = (s[i] - s[i - 1]) / (t[i] - t[i - 1])
        return s[i - 1] + slope * (tokens - t[i - 1])

    def costs(self, tokens: np.ndarray) -> np.ndarray:
        """``cost`` of each token count of an array."""
        t, s = np.asarray(self.tokens, dtype=np.float64), np.asarray(self.seconds, dtype=np.float64)
        x = np.asarray(tokens, dtype=np.float64)
        if len(t) == 1:
            return np.maximum(s[0], s[0] * x / t[0])
        inside = np.interp(x, t, s)
        slope = (s[-1] - s[-2]) / (t[-1] - t[-2])
        return np.where(x > t[-1], s[-1] + slope * (x - t[-1]), inside)


def best_prefix(values: np.ndarray, emitted: float, costs: np.ndarray) -> tuple[int, float]:
    """``(k, goodput)``: the prefix of ``values`` (survival chances in the order they are taken) whose
    expected goodput ``(emitted + Σ values[:k]) / costs[k]`` is highest; ``costs[k]``: seconds of the step
    with those ``k`` taken (``costs[0]``: with none). Ties keep the shorter prefix."""
    gain = emitted + np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))
    goodput = gain / np.maximum(costs, 1e-12)
    k = int(np.argmax(goodput))
    return k, float(goodput[k])


def _ranked(survival: Sequence[Sequence[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Every drafted position of the batch as ``(survival, request)`` arrays, in the order they are taken:
    falling survival, then earlier positions, then earlier requests (so a request's positions, whose
    survival never rises, come in order)."""
    lengths = np.asarray([len(r) for r in survival], dtype=np.int64)
    if not lengths.sum():
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    values = np.concatenate([np.asarray(r, dtype=np.float64) for r in survival if len(r)])
    request = np.repeat(np.arange(len(survival)), lengths)
    position = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    order = np.lexsort((request, position, -values))
    return values[order], request[order]


def admit(
    survival: Sequence[Sequence[float]],
    policy: Policy,
    *,
    threshold: float = 0.5,
    profile: StepCostProfile | None = None,
    cost: CostFn | None = None,
    base_tokens: int | None = None,
    emitted: float | None = None,
    budget: int | None = None,
    sunk: float = 0.0,
) -> list[int]:
    """Drafted tokens to verify per request (a prefix of each one's drafts).

    ``survival[r]`` holds request ``r``'s survival probabilities, one per drafted position.
    ``cost`` (or ``profile``): seconds of a step at each token count, for ``adaptive``.
    ``base_tokens``: tokens the step computes anyway (default: one per request, its anchor).
    ``emitted``: tokens the step emits anyway (default: one per request).
    ``budget``: most drafted tokens the step may add in all.
    ``sunk``: seconds the drafting cycle already spent on these drafts (the draft pass), part of its price.
    """
    if policy not in ("all", "threshold", "adaptive"):
        raise ValueError(f"speculative_policy {policy!r} is not one of 'all', 'threshold', 'adaptive'")
    values, request = _ranked(survival)
    if budget is not None:
        values, request = values[: max(budget, 0)], request[: max(budget, 0)]
    if policy == "threshold":
        request = request[values >= threshold]
    elif policy == "adaptive":
        if cost is None and profile is None:
            raise ValueError("adaptive admission needs a step-cost profile")
        cost = cost or profile.costs
        base = len(survival) if base_tokens is None else base_tokens
        costs = cost(base + np.arange(len(values) + 1)) + sunk  # verifying nothing does not win the draft pass back
        k, _ = best_prefix(values, float(len(survival) if emitted is None else emitted), costs)
        request = request[:k]
    return np.bincount(request, minlength=len(survival)).tolist()


@dataclass(frozen=True)
class DraftPlan:
    """What drafting for the next step is expected to bring."""

    #: how many requests draft (the first ones of the candidates ranked by expected gain)
    drafters: int
    #: expected goodput (tokens/s) of the next step with them drafting, and with nobody drafting
    goodput: float
    plain_goodput: float
    #: the best plan that drafts at all (the same as the chosen one unless drafting nobody won), and its goodput
    best_drafters: int = 0
    best_goodput: float = 0.0


def _draft_counts(n: int) -> list[int]:
    """The numbers of drafting requests tried out of ``n`` candidates: every one up to 8, then four per
    doubling, and ``n``."""
    out, step = list(range(1, 9)), 2
    while out[-1] < n:
        out.extend(range(out[-1] + step, 2 * out[-1] + 1, step))
        step *= 2
    return [c for c in out if c < n] + [n]


def plan_drafting(
    survival: Sequence[Sequence[float]],
    *,
    emitted: float,
    plain_cost: float,
    verify_cost: CostFn,
    draft_cost: CostFn,
    budget: int | None = None,
) -> DraftPlan:
    """How many requests draft for the next step, the draft pass priced in.

    ``survival[r]``: candidate ``r``'s expected survival per drafted position (its last draft's, or the
    engine's running estimate), as many positions as it may verify, candidates ranked best first (only a
    leading run of them drafts). ``emitted``: tokens the next step emits without drafts (one per decoding
    request); ``plain_cost``: its seconds without drafts; ``verify_cost(tokens)``: its seconds with
    ``tokens`` drafted tokens added; ``draft_cost(n)``: seconds of a draft pass for ``n`` requests. For each
    number ``n`` of drafting requests the best verified prefix of their positions is found as ``admit``
    finds it; the best ``n`` wins, and 0 when no plan beats the plain step.
    """
    plain = emitted / max(plain_cost, 1e-12)
    values, request = _ranked(survival)
    room = None if budget is None else max(budget, 0)
    if not len(values):
        return DraftPlan(0, plain, plain)
    counts = np.asarray(_draft_counts(len(survival)))
    # taken[i, p]: position p (in ranked order) belongs to one of the first counts[i] requests
    taken = request[None, :] < counts[:, None]
    order = np.cumsum(taken, axis=1)  # how many positions each plan has taken up to p
    if room is not None:  # within the budget, each plan keeps its own first `room` positions
        taken &= order <= room
        order = np.minimum(order, room)
    gain = emitted + np.cumsum(np.where(taken, values[None, :], 0.0), axis=1)
    top = int(order[:, -1].max()) if len(order) else 0
    verify = verify_cost(np.arange(top + 1))
    costs = verify[order] + draft_cost(counts)[:, None]
    goodput = np.where(taken, gain / np.maximum(costs, 1e-12), -np.inf)
    best = np.unravel_index(int(np.argmax(goodput)), goodput.shape)
    n, g = int(counts[best[0]]), float(goodput[best])
    if g <= plain:
        return DraftPlan(0, plain, plain, n, g)
    return DraftPlan(n, g, plain, n, g)

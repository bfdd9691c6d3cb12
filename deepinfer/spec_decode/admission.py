"""Which drafted tokens a step verifies: every one, those likely to survive, or as many as pay off.

A request's drafted position ``j`` survives verification only if every earlier
one does; the draft's confidence head gives that survival probability
``a(r, j)`` (non-increasing in ``j``). ``adaptive`` follows DSpark's admission
rule: take the batch's candidate positions in order of falling survival and
admit them while the expected goodput — tokens a step emits, ``R + Σ admitted
a``, times steps per second at the step's token count — still rises, stopping
at the first drop. Steps per second come from a step-cost profile measured on
the backend (``StepCostProfile``), forced monotone, so a busy device (large
batch, each token dearer) verifies fewer drafts and an idle one more.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal, Sequence

Policy = Literal["all", "threshold", "adaptive"]


@dataclass(frozen=True)
class StepCostProfile:
    """Seconds one forward takes at each measured token count; linear between, extrapolated past the last."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    @classmethod
    def monotone(cls, tokens: Sequence[int], seconds: Sequence[float]) -> "StepCostProfile":
        """From measurements (any order, noisy): sorted by tokens, each cost at least the one before."""
        pairs = sorted(zip(tokens, seconds))
        if not pairs or pairs[0][0] < 1 or any(s <= 0 for _, s in pairs):
            raise ValueError("a step-cost profile needs positive token counts and positive times")
        out_t, out_s, best = [], [], 0.0
        for t, s in pairs:
            best = max(best, s)
            if out_t and out_t[-1] == t:
                out_s[-1] = best
            else:
                out_t.append(t)
                out_s.append(best)
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


def admit(
    survival: Sequence[Sequence[float]],
    policy: Policy,
    *,
    threshold: float = 0.5,
    profile: StepCostProfile | None = None,
    base_tokens: int | None = None,
    budget: int | None = None,
) -> list[int]:
    """Drafted tokens to verify per request (a prefix of each one's drafts).

    ``survival[r]`` holds request ``r``'s survival probabilities, one per drafted position.
    ``base_tokens``: tokens the step computes anyway (default: one per request, its anchor).
    ``budget``: most drafted tokens the step may add in all.
    """
    counts = [0] * len(survival)
    candidates = sorted(
        ((a, r, j) for r, row in enumerate(survival) for j, a in enumerate(row)),
        key=lambda c: (-c[0], c[2], c[1]),
    )
    if policy == "threshold":
        candidates = [c for c in candidates if c[0] >= threshold]
    elif policy == "adaptive":
        if profile is None:
            raise ValueError("adaptive admission needs a step-cost profile")
        base = len(survival) if base_tokens is None else base_tokens
        emitted = float(len(survival))
        best = emitted / profile.cost(base)
        chosen = []
        for c in candidates:
            emitted += c[0]
            goodput = emitted / profile.cost(base + len(chosen) + 1)
            if goodput <= best:
                break
            best = goodput
            chosen.append(c)
        candidates = chosen
    elif policy != "all":
        raise ValueError(f"speculative_policy {policy!r} is not one of 'all', 'threshold', 'adaptive'")
    added = 0
    for _, r, j in candidates:
        if budget is not None and added >= budget:
            break
        if j == counts[r]:  # survival never rises along a request's drafts, so its positions arrive in order
            counts[r] += 1
            added += 1
    return counts

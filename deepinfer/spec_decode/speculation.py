"""The engine's side of speculative decoding: the admission policy it applies and what it counts."""

from __future__ import annotations

from typing import Callable

from ..config import EngineConfig
from ..stats import EngineStats
from .admission import StepCostProfile, admit


class Speculation:
    """Binds the configured policy (and, for ``adaptive``, the backend's step-cost profile) to the
    scheduler's admission calls, and records each verification into the engine's counters."""

    def __init__(self, config: EngineConfig, gamma: int, profile: Callable[[], StepCostProfile], stats: EngineStats) -> None:
        self.policy = config.speculative_policy
        self.threshold = config.speculative_threshold
        self.gamma = min(gamma, config.num_speculative_tokens or gamma)
        self.stats = stats
        self.profile = profile() if self.policy == "adaptive" else None
        if len(stats.spec_position_verified) < self.gamma:
            stats.spec_position_verified = [0] * self.gamma
            stats.spec_position_accepted = [0] * self.gamma

    def admit(self, survival: list[list[float]], budget: int) -> list[int]:
        """Drafted tokens each ready request verifies this step."""
        if not survival:
            return []
        rows = [row[: self.gamma] for row in survival]
        counts = admit(rows, self.policy, threshold=self.threshold, profile=self.profile, budget=budget)
        self.stats.spec_offers += len(rows)
        return counts

    def prior(self) -> list[float]:
        """Survival by position measured so far (the share of verifications of each position that kept
        it): the estimate for a request whose draft's confidences the host has not seen yet."""
        s = self.stats
        return [a / n if n else 0.0 for a, n in zip(s.spec_position_accepted[: self.gamma], s.spec_position_verified[: self.gamma])]

    def record(self, verified: int, accepted: int) -> None:
        """One request's verification: ``verified`` drafts checked, the first ``accepted`` of them kept."""
        s = self.stats
        s.spec_verifications += 1
        s.spec_verified_tokens += verified
        s.spec_accepted_tokens += accepted
        for j in range(verified):
            s.spec_position_verified[j] += 1
            s.spec_position_accepted[j] += int(j < accepted)

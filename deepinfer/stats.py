"""Counters the engine keeps across steps, printed by ``deepinfer generate --stats``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    #: prompt tokens found in the prefix cache
    cached_tokens: int = 0
    #: tokens recomputed to rebuild sliding-window state after a prefix hit
    replayed_tokens: int = 0
    #: tokens run through the model (prefill chunks, replays and decodes)
    computed_tokens: int = 0
    #: of those, tokens of prompts (or of outputs recomputed after preemption), replays included
    prefill_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    schedule_seconds: float = 0.0
    forward_seconds: float = 0.0
    #: host time spent waiting for the device to finish a step
    idle_wait_seconds: float = 0.0
    wall_seconds: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_idle_fraction(self) -> float:
        """Share of wall time the device had no step to run."""
        if not self.wall_seconds:
            return 0.0
        return max(0.0, 1.0 - self.forward_seconds / self.wall_seconds)

    def line(self) -> str:
        steps = max(self.steps, 1)
        tps = self.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0
        return (
            f"steps {self.steps}, computed tokens {self.computed_tokens} (prefill {self.prefill_tokens}), generated {self.generated_tokens} "
            f"({tps:.1f} tok/s), prefix hit rate {self.prefix_hit_rate:.1%} ({self.cached_tokens} tokens), "
            f"replayed {self.replayed_tokens}, preemptions {self.preemptions}, "
            f"schedule {1e3 * self.schedule_seconds / steps:.2f} ms/step, forward {1e3 * self.forward_seconds / steps:.2f} ms/step, "
            f"device idle {self.device_idle_fraction:.1%}"
        )

"""The engine's counters: one surface for ``LLM.get_metrics()`` and ``deepinfer generate --stats``.

Each counter has one writer: the scheduler counts what it schedules (steps,
tokens, prefix hits, preemptions), the engine what the device returns
(generated tokens, step times, graph replays), the runner what capture cost and which graph sizes it replays.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    #: completions that started as a copy of their prompt's first completion (parallel sampling)
    forked_sequences: int = 0
    schedule_seconds: float = 0.0
    forward_seconds: float = 0.0
    #: host time spent waiting for the device to finish a step
    idle_wait_seconds: float = 0.0
    wall_seconds: float = 0.0
    #: steps whose forward replayed a captured graph
    graph_replays: int = 0
    #: replays per capture size (an idle expert-parallel rank's replays over padding included): which sizes serve
    graph_replays_by_size: dict[int, int] = field(default_factory=dict)
    graphs_captured: int = 0
    graph_capture_seconds: float = 0.0
    #: device memory the captured graphs took (free memory before minus after), bytes
    graph_capture_bytes: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_idle_fraction(self) -> float:
        """Share of wall time the device had no step to run."""
        if not self.wall_seconds:
            return 0.0
        return max(0.0, 1.0 - self.forward_seconds / self.wall_seconds)

    def as_dict(self) -> dict[str, Any]:
        """Every counter, plus the rates derived from them."""
        steps = max(self.steps, 1)
        out = asdict(self)
        out.update(
            prefix_hit_rate=self.prefix_hit_rate,
            device_idle_fraction=self.device_idle_fraction,
            schedule_ms_per_step=1e3 * self.schedule_seconds / steps,
            forward_ms_per_step=1e3 * self.forward_seconds / steps,
            generated_tokens_per_second=self.generated_tokens / self.wall_seconds if self.wall_seconds else 0.0,
        )
        return out

    def line(self) -> str:
        m = self.as_dict()
        return (
            f"steps {self.steps}, computed tokens {self.computed_tokens} (prefill {self.prefill_tokens}), generated {self.generated_tokens} "
            f"({m['generated_tokens_per_second']:.1f} tok/s), prefix hit rate {self.prefix_hit_rate:.1%} ({self.cached_tokens} tokens), "
            f"replayed {self.replayed_tokens}, preemptions {self.preemptions}, "
            f"schedule {m['schedule_ms_per_step']:.2f} ms/step, forward {m['forward_ms_per_step']:.2f} ms/step, "
            f"device idle {self.device_idle_fraction:.1%}, graph replays {self.graph_replays} of {self.steps} steps"
        )

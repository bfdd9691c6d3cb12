"""The engine's counters: one surface for ``LLM.get_metrics()`` and ``deepinfer generate --stats``.

Each counter has one writer: the scheduler counts what it schedules (steps,
tokens, prefix hits, preemptions), the engine what the device returns
(generated tokens, step times, graph replays), the runner what capture cost and which graph sizes it replays.
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, field
from typing import Any


@dataclass
class EngineLoad:
    """What an engine holds right now: what a server reports as its load and its gauges."""

    num_running: int = 0
    num_waiting: int = 0
    #: tokens whose KV entries occupy cache blocks
    num_tokens: int = 0
    num_blocks: int = 0
    num_used_blocks: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    def __add__(self, other: "EngineLoad") -> "EngineLoad":
        return EngineLoad(*(a + b for a, b in zip(astuple(self), astuple(other))))


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
    #: replays per graph ("B": decode of B sequences, "BxK": verify of K tokens each; an idle expert-parallel
    #: rank's replays over padding included): which capture sizes serve
    graph_replays_by_size: dict[str, int] = field(default_factory=dict)
    graphs_captured: int = 0
    graph_capture_seconds: float = 0.0
    #: device memory the captured graphs took (free memory before minus after), bytes
    graph_capture_bytes: int = 0
    #: speculative decoding: ready requests offered to admission (one per request and step), verifications
    #: (a request verifying at least one draft in a step), drafted tokens verified and accepted, per position
    spec_offers: int = 0
    spec_verifications: int = 0
    spec_verified_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_position_verified: list[int] = field(default_factory=list)
    spec_position_accepted: list[int] = field(default_factory=list)
    #: records scheduled while the request's previous step was in flight (overlap with speculation)
    spec_chained_records: int = 0
    #: seconds the draft passes took
    draft_seconds: float = 0.0
    #: drafting decisions: steps with sampling requests that could draft, steps in which some did; those
    #: requests (one per request and step) and the ones that drafted
    spec_candidate_steps: int = 0
    spec_drafting_steps: int = 0
    spec_draft_candidates: int = 0
    spec_drafting_requests: int = 0
    #: images the vision tower encoded, the calls that encoded them (one per step that needed any: a step's
    #: new images of every request go in one batch) and the seconds those calls took
    images_encoded: int = 0
    image_encoder_calls: int = 0
    image_encode_seconds: float = 0.0

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
        out.update(spec_figures(out))
        return out

    def line(self, extra: dict[str, Any] | None = None) -> str:
        """The ``--stats`` line; ``extra``: figures kept elsewhere (the live step costs)."""
        m = {**self.as_dict(), **(extra or {})}
        return (
            f"steps {self.steps}, computed tokens {self.computed_tokens} (prefill {self.prefill_tokens}), generated {self.generated_tokens} "
            f"({m['generated_tokens_per_second']:.1f} tok/s), prefix hit rate {self.prefix_hit_rate:.1%} ({self.cached_tokens} tokens), "
            f"replayed {self.replayed_tokens}, preemptions {self.preemptions}, "
            f"schedule {m['schedule_ms_per_step']:.2f} ms/step, forward {m['forward_ms_per_step']:.2f} ms/step, "
            f"device idle {self.device_idle_fraction:.1%}, graph replays {self.graph_replays} of {self.steps} steps"
            + spec_line(m)
        )


def spec_figures(counters: dict[str, Any]) -> dict[str, Any]:
    """The speculative-decoding figures derived from the counters (also from counters summed over ranks):
    tokens a verification emits per request (accepted drafts + 1), drafted tokens verified per ready request
    and step, the accepted share per drafted position, and the draft pass's share of the forward time."""
    v = counters.get("spec_verifications", 0)
    verified, accepted = counters.get("spec_position_verified") or [], counters.get("spec_position_accepted") or []
    forward = counters.get("forward_seconds", 0.0)
    return dict(
        spec_mean_accepted_length=(counters.get("spec_accepted_tokens", 0) + v) / v if v else 0.0,
        spec_verified_tokens_per_step=counters.get("spec_verified_tokens", 0) / counters["spec_offers"] if counters.get("spec_offers") else 0.0,
        spec_acceptance_per_position=[a / n if n else 0.0 for a, n in zip(accepted, verified)],
        spec_draft_share=counters.get("draft_seconds", 0.0) / forward if forward else 0.0,
        spec_drafting_step_share=_share(counters, "spec_drafting_steps", "spec_candidate_steps"),
        spec_drafting_request_share=_share(counters, "spec_drafting_requests", "spec_draft_candidates"),
    )


def _share(counters: dict[str, Any], part: str, whole: str) -> float:
    n = counters.get(whole, 0)
    return counters.get(part, 0) / n if n else 0.0


def spec_line(m: dict[str, Any]) -> str:
    """The speculative part of ``--stats`` (empty when nothing was verified)."""
    if not m.get("spec_candidate_steps") and not m.get("spec_verifications"):
        return ""
    per_pos = " ".join(f"{a:.2f}" for a in m["spec_acceptance_per_position"])
    line = (
        f"; speculative: drafted in {m['spec_drafting_step_share']:.1%} of steps for {m['spec_drafting_request_share']:.1%} "
        f"of requests, accepted length {m['spec_mean_accepted_length']:.2f}, verified {m['spec_verified_tokens_per_step']:.2f} "
        f"drafts per request and step, acceptance by position {per_pos}, draft {m['spec_draft_share']:.1%} of forward"
    )
    live, startup = m.get("spec_cost_live_ms"), m.get("spec_cost_startup_ms")
    if startup:
        line += "; step cost ms at start-up " + " ".join(f"{int(t)}:{ms:.2f}" for t, ms in startup)
    for shape, points in (live or {}).items():
        line += f", live {shape} " + " ".join(f"{int(t)}:{ms:.2f}" for t, ms in points)
    return line

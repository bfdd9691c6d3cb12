"""The metrics of an expert-parallel group as one dict, and their line in ``--stats``."""

from __future__ import annotations

from typing import Any, Mapping

from ..stats import spec_figures


def merge_metrics(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One metrics dict: counters summed over ranks (lockstep steps and wall time: the most), the
    expert-parallel figures (global, the same on every rank) once, and every rank's own."""
    out: dict[str, Any] = {}
    for key, value in per_rank[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [m[key] for m in per_rank]
            out[key] = max(values) if key in ("steps", "wall_seconds") or key.endswith("_per_step") else sum(values)
    for key in ("spec_position_verified", "spec_position_accepted"):
        out[key] = [sum(col) for col in zip(*(m.get(key) or [] for m in per_rank))] if all(m.get(key) for m in per_rank) else []
    out.update(spec_figures(out))  # ratios of the summed counters, not sums of ratios
    out.update((k, v) for k, v in per_rank[0].items() if k.startswith(("spec_cost_", "spec_draft_cost_")))  # rank 0's estimates
    wall = out.get("wall_seconds") or 0.0
    if wall:
        out["generated_tokens_per_second"] = out.get("generated_tokens", 0) / wall
    ep = dict(per_rank[0].get("expert_parallel") or {})
    if ep:
        comm = sum(m["expert_parallel"]["dispatch_seconds"] + m["expert_parallel"]["combine_seconds"] for m in per_rank)
        forward = sum(m.get("forward_seconds", 0.0) for m in per_rank)
        ep["dispatch_seconds"] = sum(m["expert_parallel"]["dispatch_seconds"] for m in per_rank)
        ep["combine_seconds"] = sum(m["expert_parallel"]["combine_seconds"] for m in per_rank)
        ep["dispatch_combine_share"] = comm / forward if forward else 0.0
        out["expert_parallel"] = ep
    out["per_rank"] = per_rank
    return out


def ep_line(metrics: Mapping[str, Any]) -> str:
    """The expert-parallel part of ``--stats``."""
    ep = metrics.get("expert_parallel")
    if not ep:
        return ""
    before = ep.get("balancedness_total_before")
    total = ep.get("balancedness_total")
    return (
        f"; EP {ep['size']}: balancedness {_fmt(total)}" + (f" (before rebalancing {_fmt(before)})" if before is not None else "")
        + f", dispatch+combine {ep['dispatch_combine_share']:.1%} of forward, rebalances {ep['rebalances']} "
        f"({ep['experts_moved']} expert slots moved)"
    )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"

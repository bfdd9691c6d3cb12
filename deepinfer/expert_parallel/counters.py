"""What expert parallelism cost and achieved on one rank."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EPCounters:
    """What expert parallelism cost and achieved on this rank."""

    dispatch_seconds: float = 0.0
    combine_seconds: float = 0.0
    rebalances: int = 0
    layers_moved: int = 0
    experts_moved: int = 0
    #: per layer, mean over max tokens per rank since the last rebalance (None: nothing routed yet)
    balancedness: list[float | None] = field(default_factory=list)
    #: over every layer's tokens at once
    balancedness_total: float | None = None
    #: the same, for the traffic before the first rebalance
    balancedness_before: list[float | None] | None = None
    balancedness_total_before: float | None = None

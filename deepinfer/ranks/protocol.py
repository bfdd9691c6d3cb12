"""What the front sends the ranks and what they send back, one tick at a time.

Every tick, rank 0 broadcasts the commands the front queued (each names the
rank it is for, or -1 for all), every rank applies its own, all ranks run one
step together when any has work, and rank 0 gathers each rank's report.
Records are plain picklable data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..kv_transfer import handoff
from ..kv_transfer.sequence_state import PrefilledRequest
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..stats import EngineLoad


@dataclass(frozen=True)
class PackedState:
    """A prefilled request as bytes: its tensors cross the front's pipe by value (a pipe would otherwise pass
    them as shared-memory handles, which another process group cannot open)."""

    payload: bytes
    meta: handoff.Handoff

    @classmethod
    def pack(cls, prefilled: PrefilledRequest) -> "PackedState":
        return cls(*handoff.encode(prefilled))

    def unpack(self) -> PrefilledRequest:
        return handoff.decode(self.payload, self.meta)


@dataclass(frozen=True)
class AddRequest:
    rank: int
    request_id: str
    #: text, token ids, or a mapping with ``multi_modal_data`` (``deepinfer.prompts``)
    prompt: str | list[int] | dict[str, Any]
    params: SamplingParams | dict[str, Any] | None
    #: prefill role: keep its cache when it finishes; the rank exports its state into its last report
    hold_kv: bool = False
    #: decode role: its prompt's state, computed by a prefill server
    prefilled: PackedState | None = None


@dataclass(frozen=True)
class Abort:
    rank: int
    request_id: str


@dataclass(frozen=True)
class Metrics:
    """Every rank reports its counters (and refreshes the balance figures, a collective)."""

    rank: int = -1


@dataclass(frozen=True)
class FlushCache:
    """Every rank forgets the cached prefixes nobody uses."""

    rank: int = -1


@dataclass(frozen=True)
class Shutdown:
    rank: int = -1


Command = AddRequest | Abort | Metrics | FlushCache | Shutdown


@dataclass
class Tick:
    """Rank 0's broadcast: this tick's commands."""

    commands: list[Command] = field(default_factory=list)


@dataclass
class RankReport:
    """One rank's answer to a tick: snapshots of the requests that changed, and metrics when asked."""

    rank: int
    outputs: list[RequestOutput] = field(default_factory=list)
    #: request ids whose last snapshot is in ``outputs`` and which are finished
    finished: list[str] = field(default_factory=list)
    #: outstanding tokens (prompt still to compute and tokens still to generate) of its unfinished requests
    outstanding_tokens: int = 0
    metrics: dict[str, Any] | None = None
    #: its requests and cache occupancy after the tick
    load: EngineLoad = field(default_factory=EngineLoad)
    #: the longest context its engine serves
    max_model_len: int = 0
    #: the rank stepped (ran a forward) this tick
    stepped: bool = False
    #: prefill role: the state of each ``hold_kv`` request that finished this tick (its cache already freed)
    exported: dict[str, PackedState] = field(default_factory=dict)

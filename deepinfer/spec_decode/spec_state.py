"""A speculating request's drafts in flight: the record ``Request.spec`` holds and ``DraftLedger`` changes."""

from __future__ import annotations

from dataclasses import dataclass

from ..step import DraftProposal


@dataclass
class SpecState:
    """One speculating request's drafts in flight (``Request.spec``; None on a request that does not speculate)."""

    #: its drafted tokens for the step after the last one applied (None: none pending)
    draft: DraftProposal | None = None
    #: its latest sampling record drafts after its step (the admission policy picked it)
    proposing: bool = False
    #: survival per position of the last draft made for it (what its next draft is expected to achieve)
    last_survival: tuple[float, ...] | None = None

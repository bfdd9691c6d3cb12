"""Speculative decoding's in-flight state: each speculating request's drafts from the step that makes them
to the step that verifies them, and the operations the scheduler, the engine and the runner apply to it.

On the host, each speculating request carries a ``SpecState`` (``Request.spec``) that only the
``DraftLedger`` changes: the scheduler asks it which drafts a step verifies (``admit``) and which requests
draft after it (``choose``); the engine hands it each verification (``verified``) and each new draft
(``drafted``), and asks it which drafts a record verifies (``verifies``) to step the grammar over them.
With overlap scheduling a request's next record is *chained* to its step in flight (``chains``): its token
and drafts are placeholders for what that step samples and drafts, its positions assume every draft in
flight is accepted. On the device thread, ``StepOutcomes`` keeps what the runner's previous step left each
request, which resolves a chained record before the host has seen that step: positions moved back by the
rejected drafts (``rejected_drafts``), that step's last sample as the token, its new drafts as the drafts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from ..request import Request
from ..step import PLACEHOLDER, DraftProposal, SampledToken, ScheduledSequence, Step
from .spec_state import SpecState
from .speculation import Speculation, StepOutlook

if TYPE_CHECKING:
    from ..structured_output import StructuredOutputManager


def chained_drafts(draft: DraftProposal | None, anchor_position: int, k: int) -> list[int]:
    """The drafts a chained record verifies: the first ``k`` of the draft its previous step made, when that
    draft follows the record's resolved anchor; none when that step drafted nothing for it."""
    if draft is None or draft.anchor_position != anchor_position:
        return []
    return list(draft.tokens[:k])


def rejected_drafts(s: ScheduledSequence, new: Sequence[SampledToken]) -> int:
    """How many of the drafts ``s`` verified were rejected: its ``new`` tokens are the accepted ones and one more."""
    return len(s.draft_token_ids) + 1 - len(new)


def verified_counts(step: Step) -> dict[str, int]:
    """Drafted tokens each verifying sequence of a resolved ``step`` checks."""
    return {s.request_id: len(s.draft_token_ids) for s in step.sampled if s.draft_token_ids}


class DraftLedger:
    """The one owner of every request's ``SpecState``: what the scheduler reads to admit drafts and pick
    drafters, and what the engine updates as steps are verified and drafts made."""

    def __init__(
        self, speculation: Speculation | None = None, chain: bool = False, structured: StructuredOutputManager | None = None,
    ) -> None:
        """``speculation``: the admission policy and its counters (None: speculation is off, nobody drafts).
        ``chain``: steps are scheduled while the previous one is in flight (overlap), so speculating requests
        chain. ``structured``: the requests' grammars, which refuse drafts they do not allow."""
        self.speculation = speculation
        self.chain = chain
        self.structured = structured

    def start(self, req: Request) -> None:
        """Give a new request its state: a ``SpecState`` when speculation is on."""
        req.spec = SpecState() if self.speculation is not None else None

    def chains(self, req: Request) -> bool:
        """Whether ``req``'s next record chains to its step in flight: with overlap, a speculating request's
        every sampling step drafts for it, so the next one can feed that step's sample and verify its drafts."""
        return self.chain and req.spec is not None and req.num_pending == 1

    def _follows(self, req: Request) -> bool:
        """Whether ``req``'s pending draft follows the one token it feeds next (nothing else in flight)."""
        d = req.spec.draft if req.spec is not None else None
        return (
            d is not None and not req.num_pending and req.num_computed_tokens == req.num_tokens - 1
            and d.anchor_position == req.num_computed_tokens
        )

    def ready(self, running: Sequence[Request]) -> list[Request]:
        """The running requests whose next record may verify drafts: a pending draft follows their next
        token, or their record chains to their step in flight."""
        if self.speculation is None:
            return []
        return [r for r in running if not r.at_limit and (self._follows(r) or self.chains(r))]

    def admit(self, ready: Sequence[Request], budget: int, outlook: StepOutlook) -> dict[str, list[int]]:
        """The drafts each of the ``ready`` requests verifies this step (as the policy admits them within
        ``budget`` drafted tokens, the step shaped as ``outlook`` besides them), by request id."""
        last = [None if r.spec.draft is None else r.spec.draft.survival for r in ready]
        counts = self.speculation.admit(last, [self._verifiable(r) for r in ready], budget, outlook)
        return {r.request_id: self._drafts(r, k) for r, k in zip(ready, counts) if k}

    def _verifiable(self, req: Request) -> int:
        """How many drafts ``req``'s next step may verify: none past its last token (the step adds one more
        after them), and none its grammar refuses. A chained request's drafts are not known yet: its bound
        assumes every draft in flight is accepted, and its grammar checks them once they are (a refused
        draft's row then masks it out, so verification rejects it)."""
        if self.chains(req):
            return max(0, req.max_total_tokens - req.num_computed_tokens - 2) if req.spec.proposing else 0
        n = max(0, req.max_total_tokens - req.num_tokens - 1)
        if n and self.structured is not None and self.structured.constrains(req.request_id):
            n = self.structured.accepted_drafts(req.request_id, list(req.spec.draft.tokens[:n]))
        return n

    def _drafts(self, req: Request, k: int) -> list[int]:
        """The ``k`` drafts ``req`` verifies next: its pending draft's, or placeholders for a chained request
        (the drafts its step in flight makes)."""
        return [PLACEHOLDER] * k if self.chains(req) else list(req.spec.draft.tokens[:k])

    def choose(self, sequences: Sequence[ScheduledSequence], running: Sequence[Request], outlook: StepOutlook, budget: int) -> None:
        """Mark the step's sampling records that draft after it (``propose``), as the policy picks them for
        the next step, which ``outlook`` predicts (``budget``: drafted tokens it has room for)."""
        if self.speculation is None:
            return
        live = {r.request_id: r for r in running}
        candidates: list[tuple[ScheduledSequence, Request]] = []
        last, rooms = [], []
        for s in sequences:
            req = live.get(s.request_id) if s.sample is not None and s.speculate else None
            if req is None:
                continue
            req.spec.proposing = False
            room = req.max_total_tokens - req.num_computed_tokens - 2  # drafts its next step may verify
            if room > 0:
                candidates.append((s, req))
                last.append(req.spec.last_survival)
                rooms.append(room)
        if not candidates:
            return
        chosen = self.speculation.drafters(last, rooms, outlook, budget)
        for i in chosen:
            s, req = candidates[i]
            s.propose = req.spec.proposing = True
        stats = self.speculation.stats
        stats.spec_draft_candidates += len(candidates)
        stats.spec_drafting_requests += len(chosen)
        stats.spec_candidate_steps += 1
        stats.spec_drafting_steps += int(bool(chosen))

    def preempted(self, req: Request) -> None:
        """``req`` starts over: its pending draft no longer follows anything it will feed."""
        if req.spec is not None:
            req.spec.draft = None

    def verifies(self, s: ScheduledSequence, req: Request) -> list[int]:
        """The drafts ``s`` verifies: its own, or for a chained record those its previous step made (the
        request's pending draft once that step is applied; none when it drafted nothing)."""
        if not s.chained:
            return s.draft_token_ids
        return chained_drafts(req.spec.draft, req.num_known_tokens - 1, len(s.draft_token_ids))

    def verified(self, req: Request, s: ScheduledSequence, new: Sequence[SampledToken], checked: int) -> None:
        """``s`` verified ``checked`` drafts of ``req``'s pending draft and kept all but the last of its ``new``
        tokens: counted, with the survival that draft predicted (the calibration learns from the pair)."""
        if s.draft_token_ids and self.speculation is not None:
            predicted = req.spec.draft.survival if req.spec.draft is not None else ()
            self.speculation.record(checked, len(new) - 1, predicted)

    def drafted(self, req: Request, draft: DraftProposal | None) -> None:
        """The drafts a step made for ``req``'s next step (None: none) become its pending draft."""
        if req.spec is None:
            return
        req.spec.draft = draft
        if draft is not None:
            req.spec.last_survival = draft.survival

    def pass_made(self, drafts: Sequence[DraftProposal]) -> None:
        """One draft pass's drafts: the policy's running estimate of their survival follows them."""
        if self.speculation is not None and drafts:
            self.speculation.record_drafts([d.survival for d in drafts])


@dataclass(frozen=True)
class Outcome:
    """One sampled request's result of a step, as the next step's chained record needs it."""

    #: drafts it verified and rejected
    rejected: int
    #: its last new token (the next step's anchor)
    last_token: int
    #: the drafts made after it (None: none)
    draft: DraftProposal | None


@dataclass
class StepOutcomes:
    """What the runner's previous step left each sampled request (device thread): chained records are
    resolved from it."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def record(self, step: Step, tokens: dict[str, list[SampledToken]], drafts: dict[str, DraftProposal]) -> None:
        """Keep what the resolved ``step`` left each sampled request, in place of the previous step's."""
        self.outcomes = {
            s.request_id: Outcome(rejected_drafts(s, tokens[s.request_id]), tokens[s.request_id][-1].token_id, drafts.get(s.request_id))
            for s in step.sampled
        }

    def resolve(self, step: Step) -> Step:
        """``step`` with its chained records made concrete from the previous step's outcome: each one's
        positions move back by its request's rejected drafts, its token is that step's last sample and its
        drafts are the ones drafted after it (fewer, or none, if it drafted less)."""
        if not any(s.chained for s in step.sequences):
            return step
        sequences = []
        for s in step.sequences:
            if s.chained:
                prev = self.outcomes[s.request_id]
                start = s.start - prev.rejected
                drafts = chained_drafts(prev.draft, start, len(s.draft_token_ids))
                s = dataclasses.replace(
                    s, start=start, token_ids=[prev.last_token], draft_token_ids=drafts,
                    logit_offsets=s.logit_offsets[: len(s.logit_offsets) - len(s.draft_token_ids) + len(drafts)], chained=False,
                )
            sequences.append(s)
        return dataclasses.replace(step, sequences=sequences)

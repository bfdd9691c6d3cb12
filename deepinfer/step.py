"""The records that cross between the scheduler and the device: one per scheduled sequence, and the step's results.

The scheduler emits a ``ScheduledSequence`` for every sequence it runs in a
step; the model runner builds the whole device batch from that list and
nothing else. Records hold plain data (no engine objects), so the runner
thread never touches engine state. A ``StepResult`` carries the sampled
tokens and log-probabilities back, keyed by request id.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .kv_store.step_ops import KVStoreOps

if TYPE_CHECKING:
    from .kv_transfer.sequence_state import SequenceInstall
    from .multimodal import ImageSpan

#: a token the previous step samples on the device and the host has not seen yet
PLACEHOLDER = -1


@dataclass(frozen=True)
class SampleSpec:
    """How to draw one token for a sequence (its ``SamplingParams`` as the sampler needs them)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    #: the sequence's own generator seed (None: the engine's shared generator)
    seed: int | None = None
    #: top log-probabilities wanted for the sampled token (None: none)
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class PromptLogprobSpec:
    """Prompt log-probabilities one chunk yields: its first ``len(targets)`` logits rows score ``targets``."""

    k: int
    #: prompt tokens at positions ``start + 1 …`` that those rows predict
    targets: tuple[int, ...]


@dataclass(frozen=True)
class ForkSpec:
    """This sequence starts as an exact copy of another one at the end of its prompt (parallel sampling).

    The runner copies the source slot's rings into this sequence's slot and each
    ``(source block, own block)`` pair's entries after the step's forward, and
    samples this sequence's first token from the source's last logits row.
    """

    source_id: str
    source_slot: int
    block_copies: tuple[tuple[int, int], ...] = ()


@dataclass
class ScheduledSequence:
    """One sequence in one step."""

    request_id: str
    #: the cache slot holding its ring state
    slot: int
    #: position of the first token computed in this step
    start: int
    #: tokens ``[start, start + len)``; ``PLACEHOLDER`` where the previous step's sample goes
    token_ids: list[int]
    #: its cache blocks, in order
    block_table: list[int]
    #: first position whose ring state it computed itself (the replay start after a prefix hit)
    state_floor: int = 0
    #: leading tokens whose compressed entries it shares with other sequences (never rewritten)
    shared_prefix_tokens: int = 0
    #: the token ids just before ``start`` when its state lacks them (its first chunk after a prefix hit):
    #: what the model's n-gram look-back reads
    history_ids: list[int] = field(default_factory=list)
    #: where the prefill this record belongs to ends when only that end's logits are wanted (0: unknown, or
    #: every position's logits wanted): layers past the last shared-state one compute only its tail
    prefill_end: int = 0
    #: offsets into ``token_ids`` whose logits the step needs (prompt log-probabilities, then the sample)
    logit_offsets: list[int] = field(default_factory=list)
    #: set when the step draws a token for this sequence (from its last logits row)
    sample: SampleSpec | None = None
    #: set when the step scores prompt tokens
    prompt_logprobs: PromptLogprobSpec | None = None
    #: set when the sequence starts as a copy of another (it then brings no tokens)
    fork: ForkSpec | None = None
    #: drafted tokens verified after ``token_ids`` (their logits rows follow the sample's)
    draft_token_ids: list[int] = field(default_factory=list)
    #: the request speculates: the positions this step commits join its draft context
    speculate: bool = False
    #: draft its next tokens after this step's sample (the admission policy chose it for this step)
    propose: bool = False
    #: it follows the request's step still in flight when it was scheduled (overlap scheduling with
    #: speculation): its token and its drafts are that step's last sample and new drafts, and its
    #: positions assume every draft that step verifies is accepted, so the runner, which knows the
    #: outcome, moves them back by the rejected ones (``token_ids`` and ``draft_token_ids`` are placeholders)
    chained: bool = False
    #: the prompt's images whose spans reach into ``[start, start + len(token_ids))`` (a chunk may hold part of
    #: a span): the runner splices their rows in; empty for decodes
    images: tuple[ImageSpan, ...] = ()

    @property
    def all_token_ids(self) -> list[int]:
        """What the forward computes: ``token_ids`` then the drafts."""
        return self.token_ids + self.draft_token_ids if self.draft_token_ids else self.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.draft_token_ids)

    @property
    def decodes(self) -> bool:
        """One known token (and maybe drafts) whose logits are sampled, no prompt scoring: what a captured
        decode or verify graph runs."""
        return len(self.token_ids) == 1 and self.sample is not None and self.prompt_logprobs is None

    @property
    def is_decode(self) -> bool:
        """A decode without drafts: what a captured decode graph runs."""
        return self.decodes and not self.draft_token_ids


@dataclass
class GrammarGate:
    """Bitmask rows the host fills once the previous step's tokens are known; the sampler waits for it."""

    bitmask: torch.Tensor
    #: per bitmask row: (index into the step's sampled sequences in record order, drafts before it) — a
    #: verifying sequence has one row per position it may draw at: after 0, 1, ... k of its drafts
    rows: list[tuple[int, int]]
    ready: threading.Event = field(default_factory=threading.Event)

    def rows_for(self, picked: dict[tuple[int, int], int]) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask rows and target rows for the (sampled index, drafts before) pairs in ``picked``
        (pair -> row of the logits the caller samples from), or None when none is constrained."""
        mask_rows = [r for r, key in enumerate(self.rows) if key in picked]
        if not mask_rows:
            return None
        return self.bitmask[mask_rows], [picked[self.rows[r]] for r in mask_rows]


@dataclass
class Step:
    """What the device runs: the scheduled sequences, the grammar masks, requests it may forget, and the
    cache state to move before the forward."""

    sequences: list[ScheduledSequence]
    grammar: GrammarGate | None = None
    #: requests finished since the last step (the sampler drops their generators)
    finished_request_ids: list[str] = field(default_factory=list)
    #: the KV store's blocks to copy off the device, then to install, before the forward
    kv_store: KVStoreOps = field(default_factory=KVStoreOps)
    #: other engines' sequence states to install before the forward, after the store's blocks
    installs: list[SequenceInstall] = field(default_factory=list)

    @property
    def sampled(self) -> list[ScheduledSequence]:
        return [s for s in self.sequences if s.sample is not None]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


#: per position: token id -> (logprob, rank)
LogprobRow = dict[int, tuple[float, int]]


@dataclass
class SampledToken:
    """One sequence's token from one step."""

    token_id: int
    logprobs: LogprobRow | None = None


@dataclass(frozen=True)
class DraftProposal:
    """A request's drafted tokens for its next step, with the survival probability of each prefix."""

    #: position of the anchor (the token just sampled) the drafts follow
    anchor_position: int
    tokens: tuple[int, ...]
    survival: tuple[float, ...]


@dataclass
class StepResult:
    """What one step produced, by request id."""

    #: each sampling sequence's new tokens in order: one, or under verification the accepted drafts and one more
    tokens: dict[str, list[SampledToken]]
    #: request id -> (first prompt position scored, rows)
    prompt_logprobs: dict[str, tuple[int, list[LogprobRow]]]
    forward_seconds: float
    #: whether the forward replayed a captured graph
    graph: bool = False
    #: the replayed graph's token count, padding included (0: eager)
    graph_tokens: int = 0
    #: drafts for the requests that speculate, for their next step
    drafts: dict[str, DraftProposal] = field(default_factory=dict)
    #: seconds the draft pass took (its share of the step; keeping the step's context is not in it)
    draft_seconds: float = 0.0
    #: drafted tokens each verifying sequence checked (fewer than scheduled where a chained record's
    #: previous step had no draft for it)
    verified: dict[str, int] = field(default_factory=dict)

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

import torch

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
    #: offsets into ``token_ids`` whose logits the step needs (prompt log-probabilities, then the sample)
    logit_offsets: list[int] = field(default_factory=list)
    #: set when the step draws a token for this sequence (from its last logits row)
    sample: SampleSpec | None = None
    #: set when the step scores prompt tokens
    prompt_logprobs: PromptLogprobSpec | None = None
    #: set when the sequence starts as a copy of another (it then brings no tokens)
    fork: ForkSpec | None = None
    #: speculative tokens to verify after ``token_ids`` (none yet)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One token whose logits are sampled, no prompt scoring: what a captured decode graph runs."""
        return self.num_tokens == 1 and self.sample is not None and self.prompt_logprobs is None


@dataclass
class GrammarGate:
    """Bitmask rows the host fills once the previous step's tokens are known; the sampler waits for it."""

    bitmask: torch.Tensor
    #: indices into the step's sampled sequences (in record order) that are constrained
    rows: list[int]
    ready: threading.Event = field(default_factory=threading.Event)


@dataclass
class Step:
    """What the device runs: the scheduled sequences, the grammar masks, and requests it may forget."""

    sequences: list[ScheduledSequence]
    grammar: GrammarGate | None = None
    #: requests finished since the last step (the sampler drops their generators)
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def sampled(self) -> list[ScheduledSequence]:
        return [s for s in self.sequences if s.sample is not None]


#: per position: token id -> (logprob, rank)
LogprobRow = dict[int, tuple[float, int]]


@dataclass
class SampledToken:
    """One sequence's token from one step."""

    token_id: int
    logprobs: LogprobRow | None = None


@dataclass
class StepResult:
    """What one step produced, by request id."""

    tokens: dict[str, SampledToken]
    #: request id -> (first prompt position scored, rows)
    prompt_logprobs: dict[str, tuple[int, list[LogprobRow]]]
    forward_seconds: float
    #: whether the forward replayed a captured graph
    graph: bool = False

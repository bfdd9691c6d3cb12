"""What every rank of an expert-parallel group agrees on before a step: its kind and its dispatch layout.

All ranks step in lockstep, so every rank makes the same collective calls in
the same order. Before each forward the ranks vote (the most sequences, tokens
and kind any rank brings) and ``agree`` turns the vote into the step's
layout: variable splits when any rank brings a prefill or mixed chunk; else a
fixed capacity, which needs no host sync and can be captured. With decode
graphs that capacity is the token count of one graph, the same on every rank:
the verify graph (``B · (1 + γ)`` tokens) when any rank verifies drafts, else
the decode graph (``B`` tokens), ``B`` the smallest capture size holding every
rank's sequences. Every rank replays that graph (one that only decodes, inside
the verify graph's layout; an idle one, over padding only), or, without a
graph of that size, runs eagerly at that capacity.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import IntEnum


class StepKind(IntEnum):
    """What one rank's step needs of the dispatch, in precedence order: the step's kind is the most any rank needs."""

    #: every sequence brings one token (fits a decode graph)
    DECODE = 0
    #: every sequence brings one token and maybe drafts (fits a verify graph)
    VERIFY = 1
    #: anything else: prefill or mixed chunks, prompt scoring (variable splits, eager)
    PREFILL = 2

    @classmethod
    def of(cls, decode: bool, verify: bool) -> "StepKind":
        """The kind of a step whose sequences all decode (``decode``) or all fit a verify graph (``verify``)."""
        return cls.DECODE if decode else cls.VERIFY if verify else cls.PREFILL


@dataclass(frozen=True)
class StepDispatch:
    """What every rank agreed on for one step."""

    #: rows per rank of the fixed-capacity dispatch (None: variable splits)
    capacity: int | None
    #: the graph every rank replays, as (sequences, tokens per sequence), of ``capacity`` tokens; a rank whose
    #: context bucket has none runs eagerly at that capacity (None: every rank runs eagerly)
    graph: tuple[int, int] | None = None


def agree(seqs: int, tokens: int, kind: StepKind, capture_sizes: list[int] | None, capture_drafts: int) -> StepDispatch:
    """The layout of a step from the vote (the most sequences, tokens and kind any rank brings), given the
    graphs' sizes (sorted; None: no graphs) and the drafts a verify graph's sequence brings."""
    if kind == StepKind.PREFILL:
        return StepDispatch(None)
    verify = kind == StepKind.VERIFY
    per = 1 + capture_drafts if verify else 1
    # without verify graphs (no drafts) a verifying step has no graph size to round up to
    sizes = (capture_sizes or []) if not verify or capture_drafts else []
    i = bisect.bisect_left(sizes, max(seqs, -(-tokens // per), 1))
    if i < len(sizes):
        return StepDispatch(sizes[i] * per, (sizes[i], per))
    return StepDispatch(max(tokens, 1))

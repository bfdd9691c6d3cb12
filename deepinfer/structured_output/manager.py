"""The engine's structured output: the grammar compiler, each constrained request's matcher, each step's masks."""

from __future__ import annotations

from typing import Callable

from tokenizers import Tokenizer

from ..sampling_params import StructuredOutputsParams
from ..step import GrammarGate, ScheduledSequence, Step
from .bitmask import allocate_bitmask
from .compiler import GrammarCompilerCache
from .matcher import RequestGrammar
from .thinking import ThinkingGate, ThinkingMarkers, thinking_markers


class StructuredOutputManager:
    """Compiles constraints, keeps one matcher per constrained completion (by request id), fills step masks.

    The compiler is built on the first constrained request (xgrammar loads
    slowly). A matcher has seen every token the host has taken into its
    request; masks for drafts step it over them and roll it back after. A
    request with a thinking budget, or whose constraint starts after its
    reasoning, gets a ``ThinkingGate`` around its grammar (or alone).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int | None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._compiler: GrammarCompilerCache | None = None
        self._matchers: dict[str, RequestGrammar | ThinkingGate] = {}
        self._markers: ThinkingMarkers | None = None

    @property
    def compiler(self) -> GrammarCompilerCache:
        """The grammar compiler, built on first use."""
        if self._compiler is None:
            self._compiler = GrammarCompilerCache(self._tokenizer, self._vocab_size, self._eos_token_id)
        return self._compiler

    @property
    def markers(self) -> ThinkingMarkers:
        """The reasoning markers of the tokenizer, read on first use."""
        if self._markers is None:
            self._markers = thinking_markers(self._tokenizer)
        return self._markers

    def add(
        self, request_id: str, params: StructuredOutputsParams | None, *, thinking_budget: int | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        """Constrain ``request_id`` by ``params`` and/or close its reasoning after ``thinking_budget`` tokens
        (``prompt_ids`` tell whether the prompt opened reasoning); ``InvalidRequestError`` (nothing kept) if
        the constraint cannot be compiled. Nothing to enforce: nothing is kept."""
        grammar = self.compiler.request_grammar(params) if params is not None else None
        if thinking_budget is None and (params is None or not params.after_reasoning):
            if grammar is not None:
                self._matchers[request_id] = grammar
            return
        self._matchers[request_id] = ThinkingGate(self.markers, list(prompt_ids or []), thinking_budget, grammar)

    def release(self, request_id: str) -> None:
        """Forget ``request_id``'s matcher (none: nothing to do)."""
        self._matchers.pop(request_id, None)

    def constrains(self, request_id: str) -> bool:
        return request_id in self._matchers

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance ``request_id``'s matcher by the token it sampled; ``False`` if its grammar refuses it.
        An unconstrained request accepts every token."""
        matcher = self._matchers.get(request_id)
        return matcher is None or matcher.accept(token_id)

    def is_complete(self, request_id: str) -> bool:
        """Whether ``request_id``'s grammar has accepted its stop token (its output is done)."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated

    def accepted_drafts(self, request_id: str, tokens: list[int]) -> int:
        """How many leading draft ``tokens`` the constrained ``request_id``'s grammar accepts in a row."""
        return self._matchers[request_id].validate_draft(tokens)

    def gate(self, sampled: list[ScheduledSequence]) -> GrammarGate | None:
        """The unfilled masks of a step's sampled sequences (in record order): one row per position a
        constrained sequence may draw at, after 0, 1, ... k of its drafts; None when none is constrained."""
        rows = [(i, j) for i, s in enumerate(sampled) if s.request_id in self._matchers
                for j in range(len(s.draft_token_ids) + 1)]
        if not rows:
            return None
        return GrammarGate(allocate_bitmask(len(rows), self._vocab_size), rows)

    def fill(self, step: Step, drafts: Callable[[ScheduledSequence], list[int]]) -> None:
        """Write ``step``'s masks and mark them ready; the matchers have seen every earlier token.

        ``drafts(s)``: the drafts sequence ``s`` verifies. A verifying sequence has a row before each of
        its drafts: the matcher steps over the drafts and is rolled back after (verification decides). A
        draft the grammar refuses (a chained record's drafts were not known when it was scheduled) is
        excluded by its own row, so verification rejects it there; the rows after it are never read and
        stay all-allowed."""
        gate = step.grammar
        if gate is None or gate.ready.is_set():
            return
        sampled = step.sampled
        stepped: dict[int, int] = {}
        refused: set[int] = set()
        for row, (i, j) in enumerate(gate.rows):
            if i in refused:
                continue
            s = sampled[i]
            matcher = self._matchers[s.request_id]
            matcher.fill_bitmask(gate.bitmask, row)
            ahead = drafts(s)
            if j < len(ahead):  # the next row is the position after this draft: step the matcher over it
                if matcher.accept(ahead[j]):
                    stepped[i] = stepped.get(i, 0) + 1
                else:
                    refused.add(i)
        for i, n in stepped.items():
            self._matchers[sampled[i].request_id].rollback(n)
        gate.ready.set()

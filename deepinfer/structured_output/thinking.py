"""Thinking control in the engine: a reasoning budget, and output grammars that start where reasoning ends.

The chat formats write reasoning as ``<think>`` ... ``</think>`` (the strings
``deepinfer.chat.deepseek_v4`` names; the output parsers split on them). A
completion is *in reasoning* from the start when its prompt text ends with
``<think>`` (the chat format opened it), or once its output begins, after
whitespace, with ``<think>``; it leaves reasoning at the first ``</think>``.
Markers are found in the decoded text, so they are seen whether the tokenizer
has them as single tokens (DeepSeek-V4) or spells them in pieces (the bundled
model).

``ThinkingGate`` is a matcher with ``RequestGrammar``'s interface, so the step's
bitmask, draft verification and rollback treat it as any grammar:

- with a ``budget`` of N, once N tokens of reasoning are out the only tokens
  allowed are those spelling the rest of ``</think>`` (the tokenizer's own
  encoding of it), one per position; the model then goes on with its answer.
  A draft past the budget is refused at its position like any token the grammar
  forbids, so the forced token is what is emitted.
- an ``inner`` grammar (e.g. forced tool calls) sees only the tokens after the
  reasoning; while reasoning it constrains nothing.

Every accepted token pushes the state it replaced, so ``rollback`` restores
drafts and recompute exactly; the state is small and immutable.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

import torch

from ..chat.deepseek_v4 import END_THINK, THINK
from .bitmask import allow_only
from .matcher import RequestGrammar, accepted_prefix

#: how many trailing prompt tokens are decoded to see whether the prompt opens reasoning
_PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True)
class ThinkingMarkers:
    """The reasoning markers as text, how a token decodes, and the token ids spelling a piece of text."""

    decode: Callable[[int], str]
    encode: Callable[[str], tuple[int, ...]]
    start: str = THINK
    end: str = END_THINK

    def prompt_opens_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt ends with the opening marker (the chat format put the reply in reasoning)."""
        tail = "".join(self.decode(t) for t in prompt_ids[-_PROMPT_TAIL_TOKENS:])
        return tail.rstrip().endswith(self.start)


def thinking_markers(tokenizer) -> ThinkingMarkers:
    """The markers of a ``tokenizers.Tokenizer`` (special tokens decoded as their text)."""

    @lru_cache(maxsize=None)
    def decode(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    @lru_cache(maxsize=64)
    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(text, add_special_tokens=False).ids)

    return ThinkingMarkers(decode, encode)


#: where a completion is: before anything (a leading ``<think>`` would open reasoning), reasoning, or answering
START, REASONING, ANSWER = "start", "reasoning", "answer"


@dataclass(frozen=True)
class _State:
    mode: str
    #: reasoning tokens the model chose (forced ones not counted)
    count: int = 0
    #: reasoning: the end of the text that may begin ``</think>``; start: the text so far
    tail: str = ""
    #: the tokens still to force to close reasoning
    forced: tuple[int, ...] = ()


def _partial(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ThinkingGate:
    """One completion's reasoning budget and, after its reasoning, its grammar (see the module docstring).

    ``budget``: reasoning tokens before ``</think>`` is forced (None: no limit);
    ``inner``: the grammar of the answer (None: unconstrained). With an inner
    grammar the answer must start in it, so a ``<think>`` the model writes
    itself is not looked for.
    """

    def __init__(self, markers: ThinkingMarkers, prompt_ids: list[int], budget: int | None, inner: RequestGrammar | None) -> None:
        self._markers, self._budget, self._inner = markers, budget, inner
        opened = markers.prompt_opens_reasoning(prompt_ids)
        self._state = self._due(_State(REASONING if opened else (ANSWER if inner is not None else START)))
        #: per accepted token: the state before it and whether the inner grammar took it
        self._history: list[tuple[_State, bool]] = []
        self.stop_token_ids: list[int] = list(inner.stop_token_ids) if inner is not None else []

    @property
    def num_tokens(self) -> int:
        return len(self._history)

    @property
    def in_reasoning(self) -> bool:
        return self._state.mode == REASONING

    @property
    def is_terminated(self) -> bool:
        return self._state.mode == ANSWER and self._inner is not None and self._inner.is_terminated

    def _due(self, state: _State) -> _State:
        """``state`` with the closing tokens to force, once the budget is spent."""
        if state.mode != REASONING or state.forced or self._budget is None or state.count < self._budget:
            return state
        rest = self._markers.end[len(state.tail) :]
        return replace(state, forced=self._markers.encode(rest))

    def accept(self, token_id: int) -> bool:
        """Advance by one token; ``False`` (state unchanged) if it is not allowed here."""
        token_id = int(token_id)
        s = self._state
        if s.mode == ANSWER:
            if self._inner is not None and not self._inner.accept(token_id):
                return False
            self._history.append((s, self._inner is not None))
            return True
        if s.forced and token_id != s.forced[0]:
            return False
        self._history.append((s, False))
        self._state = self._after(s, token_id)
        return True

    def _after(self, s: _State, token_id: int) -> _State:
        text = s.tail + self._markers.decode(token_id)
        m = self._markers
        if s.mode == START:
            lead = text.lstrip()
            if lead.startswith(m.start):
                return self._due(_State(REASONING, tail=lead[len(m.start) :][-(len(m.end) - 1) :]))
            if m.start.startswith(lead):
                return _State(START, tail=text)
            return _State(ANSWER)
        if s.forced:  # a forced token: the reasoning closes with the last of them
            if len(s.forced) == 1:
                return _State(ANSWER)
            return replace(s, forced=s.forced[1:])
        if m.end in text:
            return _State(ANSWER)
        keep = _partial(text, m.end)
        return self._due(_State(REASONING, s.count + 1, text[len(text) - keep :] if keep else ""))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``."""
        s = self._state
        if s.mode == ANSWER and self._inner is not None:
            self._inner.fill_bitmask(bitmask, row)
        elif s.forced:
            allow_only(bitmask, row, [s.forced[0]])
        else:
            bitmask[row].fill_(-1)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens."""
        if not 0 <= n <= len(self._history):
            raise ValueError(f"cannot roll back {n} tokens: the gate has accepted {len(self._history)}")
        inner = 0
        for _ in range(n):
            self._state, fed = self._history.pop()
            inner += fed
        if inner:
            assert self._inner is not None
            self._inner.rollback(inner)

    def validate_draft(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` are allowed in a row; the state is left as it was."""
        return accepted_prefix(self, tokens)

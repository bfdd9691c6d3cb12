"""Structured output: compiled grammars, one matcher per request, and the batch token bitmask.

A ``StructuredOutputsParams`` is compiled once per distinct grammar into an
xgrammar automaton over the model's vocabulary (``GrammarCompilerCache``). Each
constrained request owns a ``RequestGrammar`` that tracks the tokens it has
produced; every step the matchers of the constrained rows write their allowed
tokens into an int32 bitmask in xgrammar's layout (bit ``j`` of word ``i`` is
token ``32·i + j``), which the sampler applies with
``kernels.apply_token_bitmask``. Rows without a grammar are neither filled nor
masked. Bitmasks live on the CPU, where xgrammar writes them; copy the
constrained rows to the device before applying them.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from typing import Any

import torch
from tokenizers import Tokenizer

from .grammar import import_xgrammar
from .grammar.json_schema import prepare_json_schema
from .grammar.sources import check_regex, choice_ebnf, compiler_message, is_ebnf
from .grammar.vocab import build_tokenizer_info
from .sampling_params import InvalidRequestError, StructuredOutputsParams

#: what each kind of constraint is called in error messages
_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
}


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """``(kind, text)`` identifying the compiled grammar; equal keys compile to the same automaton.

    A JSON schema given as a dict or as JSON text yields the same key (key order
    is kept: it sets the order of the output's properties).
    """
    if params.json is not None:
        return "json", prepare_json_schema(params.json)
    if params.json_object:
        return "json_object", ""
    if params.regex is not None:
        check_regex(params.regex)
        return "regex", params.regex
    if params.grammar is not None:
        return "grammar", params.grammar
    return "choice", choice_ebnf(list(params.choice or []))


class GrammarCompilerCache:
    """Compiles structured-output constraints for one tokenizer and model vocabulary, each distinct one once.

    ``vocab_size`` is the model's (the logits' width), which may exceed the
    tokenizer's when the embedding is padded; padded ids are never allowed.
    ``eos_token_id`` is the token a grammar accepts once its text is complete.
    At most ``max_entries`` compiled grammars are kept, least recently used
    dropped first.
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, eos_token_id: int | None, max_entries: int = 512
    ) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary of {vocab_size} tokens")
        self._xgr = import_xgrammar()
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, eos_token_id)
        self._compiler = self._xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._max_entries = max_entries
        self._lock = threading.Lock()

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens that end a grammar's output."""
        return list(self.tokenizer_info.stop_token_ids)

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The ``xgrammar.CompiledGrammar`` for ``params``; ``InvalidRequestError`` if it cannot be compiled."""
        key = grammar_key(params)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(*key)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str) -> Any:
        c = self._compiler
        try:
            # compact JSON: a weak model left free to emit whitespace can pad forever
            if kind == "json":
                return c.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "grammar" and not is_ebnf(text):
                return c.compile_lark(text)
            return c.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {_KIND_NAMES[kind]}: {compiler_message(exc)}") from None

    def request_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one request constrained by ``params``."""
        return RequestGrammar(self.compile(params))


class RequestGrammar:
    """One request's position in its grammar: which tokens may come next, and undo for drafts and recompute.

    xgrammar 0.2.9 keeps the whole token history, so ``rollback`` can undo every
    accepted token (its ``max_rollback_tokens`` setting is gone).
    """

    def __init__(self, compiled: Any) -> None:
        xgr = import_xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)
        self.stop_token_ids: list[int] = list(self._matcher.stop_token_ids)
        #: tokens accepted and not rolled back (the most ``rollback`` can undo)
        self.num_tokens = 0

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar has accepted its stop token; nothing more can follow."""
        return self._matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        """Advance by one token; ``False`` (state unchanged) if the grammar does not allow it here."""
        if self._matcher.is_terminated():
            return False
        if not self._matcher.accept_token(int(token_id)):
            return False
        self.num_tokens += 1
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (CPU int32); once terminated, only the stop tokens."""
        if self._matcher.is_terminated():
            bitmask[row].zero_()
            for t in self.stop_token_ids:
                bitmask[row, t // 32] |= _bit(t % 32)
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (rejected draft tokens, preempted output to recompute)."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"cannot roll back {n} tokens: the grammar has accepted {self.num_tokens}")
        if n:
            self._matcher.rollback(n)
            self.num_tokens -= n

    def validate_draft(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts in a row; the state is left as it was."""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n

    def reset(self) -> None:
        """Back to the start of the grammar, as for a request recomputed from its prompt."""
        self._matcher.reset()
        self.num_tokens = 0


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word as a Python int in int32 range (bit 31 is the sign bit)."""
    return -(1 << 31) if j == 31 else 1 << j


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 ``[batch, ceil(vocab_size / 32)]`` bitmask with every token allowed."""
    return torch.full((batch, math.ceil(vocab_size / 32)), -1, dtype=torch.int32)


def fill_batch_bitmask(grammars: list[RequestGrammar | None], bitmask: torch.Tensor) -> list[int]:
    """Fill the rows of requests that have a grammar; return those rows, in order.

    Rows whose entry is ``None`` are not touched: apply the mask only to the
    returned rows, e.g. ``apply_token_bitmask(logits[rows], bitmask[rows])``.
    """
    if len(grammars) > bitmask.shape[0]:
        raise ValueError(f"{len(grammars)} requests but the bitmask has {bitmask.shape[0]} rows")
    rows = []
    for row, g in enumerate(grammars):
        if g is not None:
            g.fill_bitmask(bitmask, row)
            rows.append(row)
    return rows

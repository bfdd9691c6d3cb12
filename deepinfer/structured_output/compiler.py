"""Structured-output constraints compiled into xgrammar automata over the model's vocabulary, each distinct one once."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

from tokenizers import Tokenizer

from ..sampling_params import InvalidRequestError, StructuredOutputsParams
from .matcher import RequestGrammar
from .sources import GrammarSource, compiler_message, grammar_source, is_ebnf
from .vocab import build_tokenizer_info
from .xgrammar_import import import_xgrammar


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
        self._cache: OrderedDict[GrammarSource, Any] = OrderedDict()
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
        source = grammar_source(params)
        with self._lock:
            hit = self._cache.get(source)
            if hit is not None:
                self._cache.move_to_end(source)
                return hit
        compiled = self._compile(source)
        with self._lock:
            compiled = self._cache.setdefault(source, compiled)
            self._cache.move_to_end(source)
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, source: GrammarSource) -> Any:
        c, kind, text = self._compiler, source.kind, source.text
        try:
            # compact JSON: a weak model left free to emit whitespace can pad forever
            if kind == "json":
                return c.compile_json_schema(text, any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "structural_tag":
                return c.compile_structural_tag(text)
            if kind == "grammar" and not is_ebnf(text):
                return c.compile_lark(text)
            return c.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {source.kind_name}: {compiler_message(exc)}") from None

    def request_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one request constrained by ``params``."""
        return RequestGrammar(self.compile(params))

"""Incremental detokenization that never emits half of a multi-byte character, and stop strings."""

from __future__ import annotations

from tokenizers import Tokenizer

#: tokens of context decoded before the new ones, so merges and spaces come out right
_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window of previous tokens together with the new ones and
    emits only the text that is new and complete: a delta ending in U+FFFD (an
    unfinished UTF-8 sequence split across byte-level tokens) is held back until
    the next token completes it. It keeps only that window, not every id (the
    request holds those).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            del self.ids[: self.read_offset]  # never decoded again: only the window from here on is kept
            self.prefix_offset, self.read_offset = 0, len(self.ids)
            return delta
        return ""


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last ``new_len`` characters: ``(cut_index, stop)``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best

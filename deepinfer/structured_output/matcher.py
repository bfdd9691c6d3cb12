"""One request's matcher over its compiled grammar, and a batch's bitmask filled from the matchers."""

from __future__ import annotations

from typing import Any

import torch

from .bitmask import allow_only
from .xgrammar_import import import_xgrammar


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
            allow_only(bitmask, row, self.stop_token_ids)
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
        return accepted_prefix(self, tokens)

    def reset(self) -> None:
        """Back to the start of the grammar, as for a request recomputed from its prompt."""
        self._matcher.reset()
        self.num_tokens = 0


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


def accepted_prefix(grammar: "RequestGrammar", tokens: list[int]) -> int:
    """How many leading ``tokens`` ``grammar`` (anything with ``accept`` and ``rollback``) accepts in a row,
    its state left as it was."""
    n = 0
    for t in tokens:
        if not grammar.accept(t):
            break
        n += 1
    grammar.rollback(n)
    return n

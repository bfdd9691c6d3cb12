"""What is new in a completion since the last chunk sent, and log-probabilities in OpenAI's two shapes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..outputs import CompletionOutput, PositionLogprobs


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    #: log-probabilities of ``token_ids`` (None: not asked for)
    logprobs: list[PositionLogprobs] | None
    #: the completion's finish reason when this delta ends it
    finish_reason: str | None


class CompletionCursor:
    """How much of one completion has been sent. While it runs, text that could be the start of a stop
    string is held back (the engine cuts a stop string off the text when it matches)."""

    def __init__(self, stop: list[str]) -> None:
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.chars = 0
        self.tokens = 0
        self.done = False

    def advance(self, c: CompletionOutput) -> Delta | None:
        """The part of ``c`` not sent yet (None when there is nothing new)."""
        if self.done:
            return None
        finished = c.finish_reason is not None
        end = len(c.text) if finished else max(self.chars, len(c.text) - self.hold)
        text = c.text[self.chars : end]
        token_ids = c.token_ids[self.tokens :]
        if not text and not token_ids and not finished:
            return None
        logprobs = c.logprobs[self.tokens : len(c.token_ids)] if c.logprobs is not None else None
        self.chars, self.tokens, self.done = end, len(c.token_ids), finished
        return Delta(text, token_ids, logprobs, c.finish_reason)


def top_entries(position: PositionLogprobs, k: int) -> list[tuple[int, Any]]:
    """The ``k`` most likely tokens at a position, most likely first."""
    return sorted(((t, lp) for t, lp in position.items() if lp.rank <= k), key=lambda e: e[1].rank)[:k]


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], k: int, decode) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` entries: each token, its log-probability and the top ``k``."""
    out = []
    for tok, pos in zip(token_ids, positions):
        chosen = pos.get(tok)
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(tok)
        out.append({
            "token": text, "logprob": chosen.logprob if chosen is not None else None,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": _text(t, lp, decode), "logprob": lp.logprob, "bytes": list(_text(t, lp, decode).encode("utf-8"))}
                for t, lp in top_entries(pos, k)
            ],
        })
    return out


def completion_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs | None], k: int, decode, text_offset: int
) -> dict[str, Any]:
    """``choices[].logprobs`` of the completions API: parallel lists over the tokens (a prompt's first
    position, which has no log-probability, gives None)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for tok, pos in zip(token_ids, positions):
        chosen = pos.get(tok) if pos is not None else None
        text = chosen.decoded_token if chosen is not None and chosen.decoded_token is not None else decode(tok)
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        tops.append({_text(t, lp, decode): lp.logprob for t, lp in top_entries(pos, k)} if pos is not None else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _text(token_id: int, lp: Any, decode) -> str:
    return lp.decoded_token if lp.decoded_token is not None else decode(token_id)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def decoder(tokenizer):
    """One token id to its text, special tokens spelled out (what log-probabilities show)."""
    return lambda tok: tokenizer.decode([tok], skip_special_tokens=False)

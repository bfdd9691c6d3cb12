"""Token streams and training windows built from corpus records."""

from __future__ import annotations

import torch

from .tokenizer import BOS_TOKEN, EOS_TOKEN


def token_stream(tok, records: list[str], bos_id: int, eos_id: int) -> torch.Tensor:
    """All records encoded and joined as ``BOS record EOS`` into one int64 stream."""
    ids: list[int] = []
    for enc in tok.encode_batch(records, add_special_tokens=False):
        ids.append(bos_id)
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def corpus_streams(tok, corpus) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's training and held-out records as the two token streams the model trains and is measured on."""
    bos, eos = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    return token_stream(tok, corpus.train, bos, eos), token_stream(tok, corpus.heldout, bos, eos)


def random_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` windows of ``length`` tokens at seeded random offsets of ``stream``."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def fixed_windows(stream: torch.Tensor, length: int, limit: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``length`` tokens (the tail shorter than one is dropped)."""
    n = stream.numel() // length
    if limit is not None:
        n = min(n, limit)
    return stream[: n * length].view(n, length)

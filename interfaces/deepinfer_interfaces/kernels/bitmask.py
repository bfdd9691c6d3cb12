"""Grammar token-bitmask application."""

from __future__ import annotations

import torch

from .base import op


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, ceil(V/32)]`` int32 words to a ``[B, V]`` bool mask (bit j of word i is token 32i+j)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.to(torch.int32)[..., None] >> shifts) & 1
    return bits.flatten(-2)[..., :vocab].bool()


class BitmaskOps:
    @op(rows=("logits", "bitmask"))
    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Set ``logits[b, v] = -inf`` where bit ``v`` of row ``b`` is 0; in place, returns ``logits``.

        The layout is xgrammar's: int32 words, token ``32·i + j`` is bit ``j`` of
        word ``i``, least significant first. Tokens beyond ``32·words`` are masked.
        """
        vocab = logits.shape[-1]
        allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        covered = min(vocab, bitmask.shape[-1] * 32)
        allowed[:, :covered] = unpack_bitmask(bitmask, covered)
        logits.masked_fill_(~allowed, float("-inf"))
        return logits

"""Token bitmasks in xgrammar's layout: int32 words, bit ``j`` of word ``i`` is token ``32·i + j``.

Bitmasks live on the CPU, where xgrammar writes them; copy the constrained rows
to the device before applying them with ``kernels.apply_token_bitmask``.
"""

from __future__ import annotations

import math

import torch


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 ``[batch, ceil(vocab_size / 32)]`` bitmask with every token allowed."""
    return torch.full((batch, math.ceil(vocab_size / 32)), -1, dtype=torch.int32)


def allow_only(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
    """Write ``bitmask[row]`` so that exactly ``token_ids`` are allowed."""
    bitmask[row].zero_()
    for t in token_ids:
        bitmask[row, t // 32] |= _bit(t % 32)


def _bit(j: int) -> int:
    """Bit ``j`` of an int32 word as a Python int in int32 range (bit 31 is the sign bit)."""
    return -(1 << 31) if j == 31 else 1 << j

"""Token-bitmask cases: partial words, fully masked rows, all allowed, single bits at word edges (bit order),
a bitmask shorter than the vocabulary (the tail is masked), one row, V4-Flash's vocabulary, empty batch.
The returned logits and the logits passed in are both compared: the op works in place."""

import torch

from .shapes import VOCAB
from .spec import Case, OpSpec, randn, register, seeded


def _single_bits(tokens: list[int], v: int) -> torch.Tensor:
    """One row per token allowing only that token."""
    words = torch.zeros(len(tokens), (v + 31) // 32, dtype=torch.int64)
    for row, tok in enumerate(tokens):
        words[row, tok // 32] = 1 << (tok % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _mask(g: torch.Generator, b: int, v: int, fill: str = "random") -> torch.Tensor:
    words = (v + 31) // 32
    if fill == "none":
        return torch.zeros(b, words, dtype=torch.int32)
    if fill == "all":
        return torch.full((b, words), -1, dtype=torch.int32)
    return torch.randint(-(2**31), 2**31 - 1, (b, words), generator=g, dtype=torch.int64).to(torch.int32)


def _cases() -> list[Case]:
    g = seeded(3)
    return [
        Case("b4_v96", dict(logits=randn(4, 96, gen=g), bitmask=_mask(g, 4, 96))),
        Case("b3_v77_partial_word", dict(logits=randn(3, 77, gen=g), bitmask=_mask(g, 3, 77))),
        Case("fully_masked_rows", dict(logits=randn(2, 40, gen=g), bitmask=_mask(g, 2, 40, "none"))),
        Case("all_allowed", dict(logits=randn(2, 64, gen=g), bitmask=_mask(g, 2, 64, "all"))),
        Case("empty_batch", dict(logits=torch.empty(0, 32), bitmask=_mask(g, 0, 32))),
        Case("single_bits_at_word_edges", dict(logits=randn(5, 70, gen=g), bitmask=_single_bits([0, 31, 32, 63, 69], 70))),
        Case("short_bitmask_masks_the_tail", dict(logits=randn(2, 100, gen=g), bitmask=_mask(g, 2, 64, "all"))),
        Case("one_row", dict(logits=randn(1, 50, gen=g), bitmask=_mask(g, 1, 50))),
        Case("one_row_vocab_129280", dict(logits=randn(1, VOCAB, gen=g), bitmask=_mask(g, 1, VOCAB))),
    ]


register(OpSpec(
    op="apply_token_bitmask", cases=_cases, cast=("logits",), exact=True,
    output=lambda kwargs, result: (result, kwargs["logits"]),
))

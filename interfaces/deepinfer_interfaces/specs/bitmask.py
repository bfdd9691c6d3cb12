"""Token-bitmask cases: partial words, fully masked rows, all allowed, empty batch."""

import torch

from .spec import Case, OpSpec, randn, register, seeded


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
    ]


register(OpSpec(op="apply_token_bitmask", cases=_cases, cast=("logits",), exact=True))

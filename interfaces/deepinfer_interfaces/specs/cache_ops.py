"""Cache-write cases: distinct slots, -1 padded slots (never written, not even to the pool's last row),
multi-dim rows, all skipped, one row, V4-Flash's K=V rows of 512 into a pool of a window of 128, empty batch."""

import torch

from .shapes import HEAD_DIM, WINDOW
from .spec import Case, OpSpec, randn, register, seeded


def _case(g: torch.Generator, pool_shape: tuple[int, ...], slots: list[int]) -> dict:
    return dict(pool=randn(*pool_shape, gen=g), slots=torch.tensor(slots, dtype=torch.int64), values=randn(len(slots), *pool_shape[1:], gen=g))


def _cases() -> list[Case]:
    g = seeded(10)
    return [
        Case("n12_d8_three_rows", _case(g, (12, 8), [3, 0, 11])),
        Case("minus_one_padding_skipped", _case(g, (10, 6), [-1, 4, -1, 9, 2])),
        Case("rows_are_matrices", _case(g, (6, 2, 4), [5, 1])),
        Case("all_slots_minus_one", _case(g, (5, 4), [-1, -1])),
        Case("empty_batch", _case(g, (5, 4), [])),
        Case("minus_one_leaves_last_row", _case(g, (8, 4), [-1, 2, -1])),
        Case("one_row", _case(g, (6, 4), [5])),
        Case("one_row_minus_one", _case(g, (6, 4), [-1])),
        Case("window128_d512_decode_rows", _case(g, (WINDOW, HEAD_DIM), [127, -1, 0, 64])),
    ]


register(
    OpSpec(
        op="cache_write",
        cases=_cases,
        cast=("pool", "values"),
        exact=True,
        output=lambda kwargs, result: kwargs["pool"],
    )
)

"""Cache-write cases: distinct slots, -1 padded slots (never written, not even to the pool's last row),
multi-dim rows, all skipped, one row, V4-Flash's K=V rows of 512 into a pool of a window of 128, empty batch;
and writes into packed pools, compared as the regions' bytes: V4's one FP8 region (ue8m0 and fp32 scales), V4.1's
FP4 entries and FP8 window rows in one pool (a write spanning both), narrow rows, an all-zero row, -1 slots."""

import torch

from ..kv_format import KVFormat
from .kv_formats import SMALL_ENTRY, SMALL_KV, SMALL_WINDOW, V4_KV, V4_KV_FP32, V41_ENTRY, V41_WINDOW, packed_pool, pool_contents
from .shapes import HEAD_DIM, WINDOW
from .spec import Case, OpSpec, randn, register, seeded


def _case(g: torch.Generator, pool_shape: tuple[int, ...], slots: list[int]) -> dict:
    return dict(pool=randn(*pool_shape, gen=g), slots=torch.tensor(slots, dtype=torch.int64), values=randn(len(slots), *pool_shape[1:], gen=g))


def _packed(g: torch.Generator, parts: list[tuple[int, KVFormat]], slots: list[int], zero_row: int | None = None) -> dict:
    """A write of random rows (row ``zero_row`` all zeros) into a packed pool of random records."""
    values = randn(len(slots), parts[0][1].dim, gen=g)
    if zero_row is not None:
        values[zero_row] = 0.0
    return dict(pool=packed_pool(g, parts), slots=torch.tensor(slots, dtype=torch.int64), values=values)


def _packed_cases(g: torch.Generator) -> list[Case]:
    v41 = [(6, V41_ENTRY), (8, V41_WINDOW)]
    return [
        Case("packed_v4_kv_d512_one_region", _packed(g, [(10, V4_KV)], [3, -1, 9, 0], zero_row=2)),
        Case("packed_v4_kv_d512_fp32_scales", _packed(g, [(6, V4_KV_FP32)], [5, 1, -1])),
        Case("packed_v41_d512_entries_and_window", _packed(g, v41, [7, -1, 2, 13, 5, 6], zero_row=3)),
        Case("packed_small_two_regions", _packed(g, [(4, SMALL_ENTRY), (5, SMALL_WINDOW)], [8, 0, -1, 4, 3], zero_row=1)),
        Case("packed_small_kv_rotary", _packed(g, [(7, SMALL_KV)], [6, 2])),
        Case("packed_all_slots_minus_one", _packed(g, v41, [-1, -1])),
        Case("packed_one_row_v41_window", _packed(g, v41, [9])),
        Case("packed_empty_batch", _packed(g, v41, [])),
    ]


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
        *_packed_cases(g),
    ]


register(
    OpSpec(
        op="cache_write",
        cases=_cases,
        cast=("pool", "values"),
        exact=True,
        output=lambda kwargs, result: pool_contents(kwargs["pool"]),
    )
)

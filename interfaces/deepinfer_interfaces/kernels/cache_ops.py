"""Writing rows of per-layer state into a cache pool through slot indices."""

from __future__ import annotations

import torch

from ..packed_pool import PackedPool
from .base import op


class CacheOps:
    @op
    def cache_write(self, pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values[i]`` into row ``slots[i]`` of ``pool``, in place.

        ``pool`` is ``[N, ...]``, ``slots`` ``[n]`` int64 and ``values`` ``[n, ...]``
        with the pool's trailing shape; values are cast to the pool's dtype. Rows
        whose slot is ``-1`` are skipped (a token whose state needs no storage, or
        a row of a fixed-size batch that emits nothing). Slots other than ``-1``
        are distinct; what a repeated slot holds afterwards is unspecified.
        Nothing here waits for the device (the call can be captured in a graph).

        A ``PackedPool`` takes each row as its region's records (``kv_pack``):
        the write quantizes.
        """
        if slots.numel() == 0 or pool.shape[0] == 0:
            return
        if isinstance(pool, PackedPool):
            for region in pool.regions:
                local = torch.where((slots >= region.start) & (slots < region.end), slots - region.start, -1)
                scatter_rows(region.data, local, self.kv_pack(values, region.format))
            return
        scatter_rows(pool, slots, values)


def scatter_rows(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """``cache_write`` into a plain tensor: ``pool[slots[i]] = values[i]`` for every ``slots[i] != -1``."""
    if slots.numel() == 0 or pool.shape[0] == 0:
        return
    keep = slots >= 0
    # Skipped rows are redirected to the first kept row, carrying that row's value, so every write
    # to a row agrees and no boolean indexing (a data-dependent shape) is needed. With nothing
    # kept they rewrite row 0 with its own content.
    first = keep.to(torch.int8).argmax().view(1)
    target = slots.index_select(0, first).clamp(min=0)
    fill = torch.where(
        keep.index_select(0, first).view(1, *([1] * (values.dim() - 1))),
        values.index_select(0, first).to(pool.dtype),
        pool.index_select(0, target),
    )
    rows = torch.where(keep, slots, target)
    kept = keep.view(-1, *([1] * (values.dim() - 1)))
    pool.index_copy_(0, rows, torch.where(kept, values.to(pool.dtype), fill))

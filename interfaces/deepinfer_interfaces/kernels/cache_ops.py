"""Writing rows of per-layer state into a cache pool through slot indices."""

from __future__ import annotations

import torch

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
        """
        keep = slots >= 0
        if not bool(keep.any()):
            return
        pool[slots[keep]] = values[keep].to(pool.dtype)

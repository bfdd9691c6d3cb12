"""A cache pool whose rows are packed records (``kv_format.py``), in one or more regions of formats.

Ops address a pool by row number whatever it holds. A ``PackedPool`` keeps the
row numbering of the plain ``[N, dim]`` pool it replaces and stores each range
of rows (a *region*) as uint8 records of that region's format: DeepSeek V4.1
keeps a layer's compressed entries as FP4 records and the sliding-window rows
after them as FP8 records, both addressed by one row number. Reading rows
decodes only the rows read; writing quantizes in the write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .kv_format import KVFormat, unpack_rows


@dataclass(frozen=True)
class PackedRegion:
    """Rows ``[start, start + data.shape[0])`` of a pool, stored as ``data`` ``[rows, record_bytes]`` uint8."""

    start: int
    data: torch.Tensor
    format: KVFormat

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def end(self) -> int:
        return self.start + self.rows


@dataclass(frozen=True)
class PackedPool:
    """Rows of ``dim`` channels, read back in ``dtype``, stored as the regions' records (ascending, contiguous
    from row 0)."""

    regions: tuple[PackedRegion, ...]
    dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        start = 0
        for r in self.regions:
            if r.start != start or r.format.dim != self.dim or r.data.dtype != torch.uint8 or r.data.shape[1] != r.format.record_bytes:
                raise ValueError(f"packed pool regions must tile rows from 0 with {self.dim}-channel records (region at row {r.start})")
            start = r.end

    @classmethod
    def allocate(cls, parts: list[tuple[int, KVFormat]], dim: int, dtype: torch.dtype, device: torch.device | str) -> "PackedPool":
        """A zero pool of ``(rows, format)`` regions in order."""
        regions, start = [], 0
        for rows, fmt in parts:
            regions.append(PackedRegion(start, torch.zeros(rows, fmt.record_bytes, dtype=torch.uint8, device=device), fmt))
            start += rows
        return cls(tuple(regions), dim, dtype)

    @property
    def shape(self) -> tuple[int, int]:
        """The logical shape ``[rows, dim]``."""
        return (self.regions[-1].end if self.regions else 0, self.dim)

    @property
    def device(self) -> torch.device:
        return self.regions[0].data.device

    def nbytes(self) -> int:
        return sum(r.data.numel() for r in self.regions)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype | None = None) -> "PackedPool":
        """The same pool with ``fn`` applied to each region's records (a copy or a device move, never a cast:
        records are bytes), its rows read back in ``dtype`` (default: this pool's)."""
        regions = tuple(PackedRegion(r.start, fn(r.data), r.format) for r in self.regions)
        return PackedPool(regions, self.dim, dtype or self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        """The regions' storage."""
        return [r.data for r in self.regions]

    def region_of(self, row: int) -> PackedRegion:
        """The region holding ``row``."""
        return next(r for r in self.regions if r.start <= row < r.end)

    def take(self, indices: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[*indices.shape, dim]`` the rows named by ``indices`` decoded in ``dtype`` (default: the pool's);
        ``-1`` reads as a finite row (callers give it zero weight)."""
        dtype = dtype or self.dtype
        flat = indices.reshape(-1).clamp(min=0)
        out = torch.zeros(flat.shape[0], self.dim, dtype=dtype, device=flat.device)
        for r in self.regions:
            if not r.rows:
                continue
            local = (flat - r.start).clamp(0, r.rows - 1)
            rows = unpack_rows(r.data.index_select(0, local), r.format, dtype)
            mine = ((flat >= r.start) & (flat < r.end))[:, None]
            out = torch.where(mine, rows, out) if len(self.regions) > 1 else rows
        return out.view(*indices.shape, self.dim)

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Copy ``n`` rows from ``src`` to ``dst`` (both runs inside one region)."""
        if not n or src == dst:
            return
        a, b = self.region_of(src), self.region_of(dst)
        b.data[dst - b.start : dst - b.start + n].copy_(a.data[src - a.start : src - a.start + n])

"""A cache pool as the row-reading kernels take it: plain rows, or the packed records of one or two regions.

The attention and indexer kernels read pool rows by logical row number. A
plain pool is one ``[N, D]`` tensor. A ``PackedPool`` (``deepinfer_interfaces``)
is one or two regions of uint8 records (V4: one per layer pool; V4.1: its FP4
compressed entries, then its FP8 window rows); the kernels take both regions'
base pointers and the first row of the second, and decode each row with its
region's format. A format reaches a kernel as a tuple of compile-time integers
(``format_constants``), so each format is its own specialisation.

This module never imports Triton (``kernels.py`` asks it whether a pool is
readable before any Triton module is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_interfaces import KVFormat, PackedPool

#: code and scale formats as the kernels number them
CODE_IDS = {"e4m3": 0, "e2m1": 1}
SCALE_IDS = {"ue8m0": 0, "e4m3": 1, "fp32": 2}

#: the format constants of a plain pool (never read)
NO_FORMAT = (0, 0, 1, 0, 0, 0, 0, 1, 4)

#: how many regions the kernels take
MAX_REGIONS = 2


def format_constants(fmt: KVFormat) -> tuple[int, ...]:
    """``fmt`` as the kernels' constexpr tuple: ``(code, scale, block, quantized, rope, code_bytes,
    scale_offset, num_scales, record_bytes)`` (``CODE_IDS`` / ``SCALE_IDS`` numbering)."""
    return (
        CODE_IDS[fmt.code], SCALE_IDS[fmt.scale], fmt.block, fmt.quantized, fmt.rope, fmt.code_bytes, fmt.scale_offset,
        fmt.num_scales, fmt.record_bytes,
    )


def _unit_inner(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@dataclass(frozen=True)
class PoolOperand:
    """What a row-reading kernel is given for one pool.

    ``first`` holds rows ``[0, split)`` and ``second`` rows ``[split, rows)``
    of a two-region pool; a plain or one-region pool is all ``first``
    (``second`` is ``first`` again and ``split`` 0, never read, so every such
    launch is one specialisation). ``regions`` is 0 for plain rows.
    """

    first: torch.Tensor
    second: torch.Tensor
    split: int
    rows: int
    dim: int
    #: the dtype rows are read in (a packed pool's decoded rows are rounded to it, as the reference's are)
    dtype: torch.dtype
    regions: int
    formats: tuple[tuple[int, ...], tuple[int, ...]] = (NO_FORMAT, NO_FORMAT)

    @classmethod
    def of(cls, pool: "torch.Tensor | PackedPool") -> "PoolOperand | None":
        """The operand of ``pool``, or None for a packed pool the kernels do not read (more than two
        non-empty regions, or none)."""
        if not isinstance(pool, PackedPool):
            if pool.dim() != 2:
                return None
            data = _unit_inner(pool)
            return cls(data, data, 0, pool.shape[0], pool.shape[1], pool.dtype, 0)
        regions = [r for r in pool.regions if r.rows]
        if not 1 <= len(regions) <= MAX_REGIONS:
            return None
        first = _unit_inner(regions[0].data)
        second = _unit_inner(regions[-1].data)
        formats = tuple(format_constants(r.format) for r in regions)
        rows = pool.shape[0]
        split = regions[1].start if len(regions) == 2 else 0
        return cls(first, second, split, rows, pool.dim, pool.dtype, len(regions), (formats[0], formats[-1]))

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.dim)

    def tensors(self) -> list[torch.Tensor]:
        """The storage the kernel reads (for device checks)."""
        return [self.first, self.second]

    def args(self) -> tuple:
        """The runtime arguments ``(kv_ptr, kv2_ptr, stride_kv, stride_kv2, SPLIT_ROW)``."""
        return (self.first, self.second, self.first.stride(0), self.second.stride(0), self.split)

    def constants(self) -> dict[str, object]:
        """The constexprs ``REGIONS``, ``F0``, ``F1``."""
        return {"REGIONS": self.regions, "F0": self.formats[0], "F1": self.formats[1]}


def readable_pool(pool: "torch.Tensor | PackedPool") -> bool:
    """True when the row-reading kernels take ``pool``: a plain tensor (whose shape the launchers check), or a
    packed pool of one or two non-empty regions."""
    if isinstance(pool, PackedPool):
        return 1 <= sum(1 for r in pool.regions if r.rows) <= MAX_REGIONS
    return True


def kernel_pool(op: str, q: torch.Tensor, pool: "torch.Tensor | PackedPool") -> PoolOperand:
    """``pool`` as ``op``'s kernel reads it; a packed pool must decode to ``q``'s dtype (its rows are rounded to
    it, as the reference's are)."""
    operand = PoolOperand.of(pool)
    if operand is None or (operand.regions and operand.dtype != q.dtype):
        got = (f"{sum(1 for r in pool.regions if r.rows)} non-empty regions decoding to {pool.dtype}"
               if isinstance(pool, PackedPool) else f"a {pool.dim()}-d tensor")
        raise ValueError(f"{op}: need a [N, D] pool, or a packed pool of one or two non-empty regions decoding to q's dtype "
                         f"{q.dtype}; got {got}")
    return operand

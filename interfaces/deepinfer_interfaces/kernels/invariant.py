"""The building blocks of batch-invariant mode: products and elementwise maths whose result for a row
does not depend on how many rows are computed with it.

Two things make a CPU result depend on its neighbours. A BLAS picks its kernel,
and so its reduction order, from the product's shape (a one-row product takes a
matrix-vector path whose sums differ in the last bits). And a vectorised
elementwise loop computes whole SIMD vectors and finishes the tail of the
tensor (and of each thread's share of it) with scalar code whose
transcendentals (``silu``, ``sigmoid``, ``softplus``) round differently, so an
element's path depends on where it lands in the flattened tensor. Row tiles of
a fixed shape settle the first; rows padded to a whole number of lanes per
thread settle the second.
"""

from __future__ import annotations

from typing import Callable

import torch

#: rows per tile of the batch-invariant matmul: every product has this many rows, the batch padded to whole tiles
INVARIANT_TILE_ROWS = 16
#: (token, expert) pairs per tile of the grouped experts in batch-invariant mode: larger than a matmul's row
#: tile, since each tile copies its expert's weights
INVARIANT_EXPERT_TILE = 64
#: entries per tile when an op walks each sequence's compressed entries in batch-invariant mode
INVARIANT_ENTRY_TILE = 128
#: elements of the widest SIMD step (two AVX-512 vectors of bf16); rows are padded to a multiple of it per thread
LANE = 64


def row_tiled_matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``x @ w_t`` (``x`` ``[..., K]``, ``w_t`` ``[K, N]``) computed in tiles of a fixed row count.

    Every tile is its own ``[INVARIANT_TILE_ROWS, K] @ [K, N]`` product (the last
    one padded with zero rows), so the BLAS makes the same choice of kernel and
    of how to split the work across threads for every tile whatever the batch:
    one batched call would let it split a lone tile's long reduction across
    threads but not a batch's. A row's result depends on neither the other rows
    nor its place in its tile (checked by the conformance suite's batch-invariance cases).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    m, n = flat.shape[0], w_t.shape[1]
    if m == 0:
        return x.new_zeros(*lead, n)
    pad = -m % INVARIANT_TILE_ROWS
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, k)])
    tiles = [flat[r : r + INVARIANT_TILE_ROWS] @ w_t for r in range(0, flat.shape[0], INVARIANT_TILE_ROWS)]
    return torch.cat(tiles)[:m].view(*lead, n)


def matmul_rows(x: torch.Tensor, w_t: torch.Tensor, invariant: bool) -> torch.Tensor:
    """``x @ w_t``: the plain product, or the row-tiled one when ``invariant``."""
    return row_tiled_matmul(x, w_t) if invariant else x @ w_t


def lanewise(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)`` (elementwise, ``xs`` of one shape ``[..., D]``) with every element on the same SIMD path.

    Each row is padded with zeros to a multiple of ``LANE`` elements times the
    thread count, so the vectorised loop never meets a scalar tail inside a row,
    whatever the number of rows.
    """
    shape = xs[0].shape
    if xs[0].numel() == 0:
        return fn(*xs)
    d = shape[-1]
    width = LANE * max(1, torch.get_num_threads())
    padded = -(-d // width) * width
    flats = []
    for x in xs:
        flat = x.reshape(-1, d)
        if padded != d:
            flat = torch.nn.functional.pad(flat, (0, padded - d))
        flats.append(flat.contiguous())
    return fn(*flats)[:, :d].reshape(shape)


def elementwise(fn: Callable[..., torch.Tensor], invariant: bool, *xs: torch.Tensor) -> torch.Tensor:
    """``fn(*xs)``, through ``lanewise`` when ``invariant``."""
    return lanewise(fn, *xs) if invariant else fn(*xs)

"""Tiles over tokens and over each sequence's compressed entries, so that an op's working memory has a
fixed bound whatever the context length.

The ops reading every entry a token sees (the indexer's top-k, attention over all
compressed entries) take per-sequence tables ``[B, N]`` of pool rows, each
token's sequence ``token_seq [T]`` and its ``visible [T]`` count, and walk them
in tiles of ``TILE_TOKENS`` tokens by ``entry_tile(...)`` entries, never building
a ``[T, N]`` tensor. Tile sizes depend only on tensor shapes, so a captured graph
unrolls the same loop every replay and nothing is read back from the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from math import prod

import torch

from ..packed_pool import PackedPool
from .invariant import INVARIANT_ENTRY_TILE


def take_rows(pool: "torch.Tensor | PackedPool", indices: torch.Tensor) -> torch.Tensor:
    """``pool[indices]`` with ``-1`` rows read as some finite row: for callers that give those rows
    zero weight themselves (a masked score), which saves a pass over the gathered rows. A packed pool's
    rows are decoded as they are read (only those rows)."""
    if pool.shape[0] == 0 or indices.numel() == 0:
        return torch.zeros((*indices.shape, *pool.shape[1:]), dtype=pool.dtype, device=indices.device)
    if isinstance(pool, PackedPool):
        return pool.take(indices)
    return pool[indices.clamp(min=0)]


#: the elements one tile's largest intermediate may hold (4 MiB in fp32)
TILE_ELEMENTS = 1 << 20
#: tokens per tile
TILE_TOKENS = 256
#: with this many sequences or fewer a tile's keys are read once per sequence and met by a matmul of
#: every token against every sequence's keys (a prefill chunk); beyond it each token reads its own rows
SHARED_KEY_SEQS = 4


def entry_tile(tokens: int, seqs: int, heads: int, dim: int, entries: int) -> int:
    """Entries per tile for ``tokens`` tokens of ``seqs`` sequences, ``heads`` scores per token-entry
    pair over rows ``dim`` wide: the tile's intermediates hold at most ``TILE_ELEMENTS``, at most ``entries``."""
    if seqs <= SHARED_KEY_SEQS:
        per_entry = tokens * seqs * heads + seqs * dim  # every token's scores against every sequence, and the rows
    else:
        per_entry = tokens * (heads + dim)  # each token's scores and its own rows
    return max(1, min(entries, TILE_ELEMENTS // max(per_entry, 1)))


@dataclass
class TileScratch:
    """Buffers for the largest intermediates of one op's walk over entry tiles, made once per call and reused
    by every tile, so the walk allocates nothing large per tile. Each buffer's size is rounded up to a power
    of two: from one step to the next the walk asks for the same few sizes, and memory one step frees is
    whole for the next (a context that grows by a chunk per step does not leave ever larger holes behind)."""

    device: torch.device
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``shape`` tensor of ``dtype`` over buffer ``name`` (its contents are left as they were)."""
        numel = prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(1 << max(numel - 1, 0).bit_length(), dtype=dtype, device=self.device)
            self.buffers[name] = buf
        return buf[:numel].view(shape)


@dataclass
class EntryTile:
    """One tile of entries ``[start, end)`` for one tile of tokens."""

    start: int
    end: int
    #: ``[tt, n]`` bool: not a candidate (beyond what the token sees, or a table row naming no pool row)
    invalid: torch.Tensor
    #: ``[B, n, D]`` rows of each sequence (shared keys) or ``[tt, n, D]`` rows of each token
    rows: torch.Tensor
    #: ``[tt]`` each token's sequence, or None when ``rows`` are per token
    seq: torch.Tensor | None

    def dots(self, q: torch.Tensor, scratch: TileScratch | None = None) -> torch.Tensor:
        """``[tt, H, n]``: ``q [tt, H, D]`` against each token's rows of the tile (in ``scratch``'s
        ``"dots"`` buffer when given, except with several sequences' shared keys)."""
        tt, h, d = q.shape
        n = self.end - self.start
        if self.seq is None:
            out = scratch.take("dots", (tt, h, n), q.dtype) if scratch is not None else None
            return torch.bmm(q, self.rows.transpose(1, 2), out=out)
        if self.rows.shape[0] == 1:  # one sequence (a prefill chunk): one matmul
            out = scratch.take("dots", (tt * h, n), q.dtype) if scratch is not None else None
            return torch.mm(q.reshape(tt * h, d), self.rows[0].T, out=out).view(tt, h, n)
        every = torch.einsum("thd,bnd->tbhn", q, self.rows)
        pick = self.seq[:, None, None, None].expand(-1, 1, every.shape[2], every.shape[3])
        return every.gather(1, pick).squeeze(1)

    def weighted_rows(self, p: torch.Tensor) -> torch.Tensor:
        """``[tt, H, D]``: ``Σ_n p[t, h, n] · row[t, n]`` for weights ``p [tt, H, n]``."""
        tt, h, n = p.shape
        if self.seq is None:
            return torch.bmm(p, self.rows)
        if self.rows.shape[0] == 1:
            return (p.reshape(tt * h, n) @ self.rows[0]).view(tt, h, -1)
        spread = p.new_zeros(tt, self.rows.shape[0], h, n)
        spread.scatter_(1, self.seq[:, None, None, None].expand(-1, 1, h, n), p[:, None])
        return torch.einsum("tbhn,bnd->thd", spread, self.rows)


def token_tiles(tokens: int) -> Iterator[tuple[int, int]]:
    """``[start, end)`` of each tile of tokens."""
    for t0 in range(0, tokens, TILE_TOKENS):
        yield t0, min(tokens, t0 + TILE_TOKENS)


def entry_tiles(
    pool: torch.Tensor, table: torch.Tensor, seq: torch.Tensor, visible: torch.Tensor, heads: int, dtype: torch.dtype,
    align: int = 1, scratch: TileScratch | None = None, invariant: bool = False,
) -> Iterator[EntryTile]:
    """The tiles of entries of ``table [B, N]`` seen by a tile of tokens (``seq``, ``visible``: ``[tt]``),
    their rows of ``pool`` read in ``dtype``; ``heads``: scores per token-entry pair; every tile but the
    last starts and ends on a multiple of ``align`` (whole blocks of entries). With ``scratch`` each tile's
    ``invalid`` mask is its ``"invalid"`` buffer, valid until the next tile. ``invariant`` (batch-invariant
    mode): every tile exactly ``INVARIANT_ENTRY_TILE`` entries wide (whole blocks; the last padded with
    entries naming no row) and each token's own rows, so a token's products have one shape whatever the
    other tokens and the table's width; the extra fully masked tiles a longer neighbour adds leave a
    running softmax or top-k bit for bit as it was."""
    b, n = table.shape
    tt = seq.shape[0]
    if invariant:
        step = -(-INVARIANT_ENTRY_TILE // align) * align
    else:
        step = max(align, entry_tile(tt, b, heads, pool.shape[-1], n) // align * align)
    shared = b <= SHARED_KEY_SEQS and not invariant
    for n0 in range(0, n, step):
        n1 = n0 + step if invariant else min(n, n0 + step)
        part = table[:, n0:n1]
        if part.shape[1] < n1 - n0:
            part = torch.nn.functional.pad(part, (0, n1 - n0 - part.shape[1]), value=-1)
        cols = torch.arange(n0, n1, device=table.device)[None, :]
        invalid = scratch.take("invalid", (tt, n1 - n0), torch.bool) if scratch is not None else None
        invalid = torch.ge(cols, visible[:, None], out=invalid)
        if shared:
            missing = part < 0
            invalid.logical_or_(missing if b == 1 else missing.index_select(0, seq))
            rows = take_rows(pool, part)
        else:
            mine = part.index_select(0, seq)
            invalid.logical_or_(mine < 0)
            rows = take_rows(pool, mine)
        yield EntryTile(n0, n1, invalid, rows.to(dtype), seq if shared else None)

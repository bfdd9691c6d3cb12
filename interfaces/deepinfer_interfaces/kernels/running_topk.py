"""The running top-k of the tiled indexer ops: the ``k`` best entries per token seen so far, merged tile
by tile, with the tie rule of ``topk_select`` (equal scores: the lower entry number first).

Both forms allocate their state once for up to ``tokens`` rows and update it in place, tile after tile:
nothing they keep is born between two tiles' large intermediates, so the memory those free stays whole
for the next tile (a long context's many tiles do not fragment the heap). Their ``[tokens, n]``
intermediates are buffers of the walk's ``TileScratch``.
"""

from __future__ import annotations

import struct

import torch

from .tiles import TileScratch

#: the low half of a packed key: this minus the entry number (entry numbers stay below 2^31)
_LOW = (1 << 31) - 1


def running_topk(tokens: int, k: int, dtype: torch.dtype, device, scratch: TileScratch) -> "KeyedTopk | SortedTopk":
    """The running top-k for scores of ``dtype``: packed keys for fp32 (one selection per tile), the exact
    sort-based merge for fp64 (the conformance oracle's scores, too wide to pack with an entry number)."""
    if dtype == torch.float32:
        return KeyedTopk(tokens, k, device, scratch)
    return SortedTopk(tokens, k, dtype, device, scratch)


def _ordered_bits(scores: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """int32 (in ``out``) whose signed order is the fp32 ``scores``' order (-0.0 ranks with
    +0.0; ``scores`` are overwritten)."""
    bits = scores.add_(0.0).view(torch.int32)  # -0.0 + 0.0 is +0.0
    flip = torch.bitwise_right_shift(bits, 31, out=out)
    flip &= 0x7FFFFFFF
    flip ^= bits
    return flip


def _ordered_int(score: float) -> int:
    """``_ordered_bits`` of one fp32 score, on the host."""
    bits = struct.unpack("<i", struct.pack("<f", score))[0]
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


#: the ordered bits of ``-inf``: a key at or below it names no candidate
_NONE = _ordered_int(float("-inf"))


class KeyedTopk:
    """fp32 scores: each candidate is one int64 key, the score's order-preserving bits over ``_LOW`` minus
    its entry number, so one ``topk`` of keys takes the best scores and, among equal ones, the lowest
    entries (the CUDA kernel's packing). ``-inf`` scores are never picked as entries."""

    def __init__(self, tokens: int, k: int, device, scratch: TileScratch) -> None:
        self.k = k
        self.scratch = scratch
        self._keys = torch.empty((tokens, k), dtype=torch.int64, device=device)
        self.start(tokens)

    def start(self, tokens: int) -> None:
        """Begin a new tile of ``tokens`` rows (at most the ``tokens`` it was made for), with no entry yet."""
        self.keys = self._keys[:tokens]
        self.keys.fill_(torch.iinfo(torch.int64).min)

    def merge(self, scores: torch.Tensor, first: int) -> None:
        """Take in ``scores`` ``[tokens, n]`` of the entries ``first …`` (``-inf``: not a candidate); they
        are overwritten."""
        n = scores.shape[1]
        keys = self.scratch.take("keys", scores.shape, torch.int64)
        keys.copy_(_ordered_bits(scores, self.scratch.take("ordered", scores.shape, torch.int32)))
        keys <<= 32
        keys += _LOW - first - torch.arange(n, device=scores.device)
        best = keys.topk(min(self.k, n), dim=1, sorted=False).values
        self.keys.copy_(torch.cat([self.keys, best], dim=1).topk(self.k, dim=1).values)

    def entries(self) -> torch.Tensor:
        """``[tokens, k]`` entry numbers, best first, -1 where no candidate is left."""
        ids = _LOW - (self.keys & 0xFFFFFFFF)
        return torch.where((self.keys >> 32) > _NONE, ids, -1)


class SortedTopk:
    """Any float scores: a tile is cut to its own best ``k`` by selection (``torch.topk``), whose order
    among equal scores is unspecified; the scores tied at the cut are then re-chosen as the lowest-numbered
    entries with that score (a second selection, over their negated numbers), so the result keeps the tie
    rule exactly. The small merge with the running best is a stable sort by entry, then by score."""

    def __init__(self, tokens: int, k: int, dtype: torch.dtype, device, scratch: TileScratch) -> None:
        self.k = k
        self.scratch = scratch
        self._scores = torch.empty((tokens, k), dtype=dtype, device=device)
        self._ids = torch.empty((tokens, k), dtype=torch.int64, device=device)
        self.start(tokens)

    def start(self, tokens: int) -> None:
        """Begin a new tile of ``tokens`` rows (at most the ``tokens`` it was made for), with no entry yet."""
        self.scores, self.ids = self._scores[:tokens], self._ids[:tokens]
        self.scores.fill_(float("-inf"))
        self.ids.fill_(-1)

    def merge(self, scores: torch.Tensor, first: int) -> None:
        """Take in ``scores`` ``[tokens, n]`` of the entries ``first …`` (``-inf``: not a candidate)."""
        n = scores.shape[1]
        take = min(self.k, n)
        best, cols = scores.topk(take, dim=1)
        cut = best[:, -1:]
        above = best > cut
        negated = -torch.arange(n, device=scores.device, dtype=scores.dtype)[None, :]
        at = torch.eq(scores, cut, out=self.scratch.take("at_cut", scores.shape, torch.bool))
        none = scores.new_full((), float("-inf"))
        numbers = self.scratch.take("tied", scores.shape, scores.dtype)
        tied = torch.where(at, negated, none, out=numbers).topk(take, dim=1).values  # lowest numbers first
        room = take - above.sum(1, keepdim=True)
        slot = torch.arange(take, device=scores.device)[None, :]
        tie_ok = (slot < room) & (tied > float("-inf"))
        strict = best.masked_fill(~above, float("-inf"))  # the tile's picks above the cut
        at_cut = cut.expand(-1, take).masked_fill(~tie_ok, float("-inf"))  # and the lowest-numbered ones at it
        cand_scores = torch.cat([self.scores, strict, at_cut], dim=1)
        cand_ids = torch.cat([self.ids, cols + first, (-tied).clamp(min=0).to(torch.int64) + first], dim=1)
        # equal scores in entry order: sort by entry, then stably by score
        by_id = torch.sort(torch.where(cand_scores > float("-inf"), cand_ids, torch.iinfo(torch.int64).max), dim=1).indices
        cand_scores, cand_ids = cand_scores.gather(1, by_id), cand_ids.gather(1, by_id)
        order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, : self.k]
        self.scores.copy_(cand_scores.gather(1, order))
        self.ids.copy_(cand_ids.gather(1, order))

    def entries(self) -> torch.Tensor:
        """``[tokens, k]`` entry numbers, best first, -1 where no candidate is left."""
        return torch.where(self.scores > float("-inf"), self.ids, -1)

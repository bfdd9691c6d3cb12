"""Fixed-size token blocks with reference counts, prefix hashing and LRU eviction.

A block holds the content-addressed state of ``block_size`` consecutive tokens
(the compressed KV, indexer keys and HCA entries they produce). Full blocks are
named by a chained hash of their token ids (plus a salt), so a later request
with the same prefix reuses them. Freed blocks stay cached, in least-recently
used order, until a new allocation evicts them.

The hash is a 128-bit BLAKE2b digest, the same in every process and on every
machine, so it also names a block in the on-disk store (``deepinfer/kv_store``).
A block that an image's span reaches into also hashes that image's digest and
the position its span starts at: the placeholder ids alone do not say what the
image was, so the same ids with another image name other blocks.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .multimodal import ImageSpan


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None


def chain_hashes(
    token_ids: Sequence[int], block_size: int, salt: object = None, start: int = 0, parent: int | None = None,
    images: Sequence[ImageSpan] = (), first_position: int = 0,
) -> list[int]:
    """Hashes of the full blocks of ``token_ids`` (a list or a ``token_array``) from block ``start``, each
    chained to its predecessor (``parent``: the hash before block ``start``), as 128-bit integers stable
    across processes. Each block's ids are hashed as 64-bit little-endian integers, read one block at a time,
    then the digest and start position of every span of ``images`` reaching into it (``first_position``: the
    sequence position of ``token_ids[0]``)."""
    end = len(token_ids) // block_size
    key = hashlib.blake2b(repr(salt).encode(), digest_size=32).digest() if salt is not None else b""
    out = []
    for b in range(start, end):
        h = hashlib.blake2b(digest_size=16, key=key)
        h.update((parent or 0).to_bytes(16, "little"))
        h.update(np.asarray(token_ids[b * block_size : (b + 1) * block_size], dtype="<i8").tobytes())
        lo = first_position + b * block_size
        for span in images:
            if span.overlaps(lo, lo + block_size):
                h.update(span.digest)
                h.update(span.offset.to_bytes(8, "little"))
        parent = int.from_bytes(h.digest(), "little")
        out.append(parent)
    return out


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        #: blocks with no user, least recently freed first; cached ones keep their hash until evicted
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def lookup(self, hashes: list[int]) -> list[int]:
        """Block ids of the longest run of ``hashes`` that is cached."""
        found = []
        if not self.enable_prefix_caching:
            return found
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def acquire(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for i in block_ids:
            block = self.blocks[i]
            if block.ref_count == 0:
                self.free_queue.pop(i, None)
            block.ref_count += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting the least recently used cached ones; None if too few are free."""
        if n > len(self.free_queue):
            return None
        out = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block_id)
        return out

    def release(self, block_ids: list[int]) -> None:
        """Drop a reference; unused blocks join the free queue (most recently used last)."""
        for i in block_ids:
            block = self.blocks[i]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue[i] = None
                    self.free_queue.move_to_end(i, last=False)  # uncached: reuse first
                else:
                    self.free_queue[i] = None

    def register(self, block_id: int, block_hash: int) -> bool:
        """Name a block that now holds a full block of tokens, so later prefixes can reuse it; whether it
        is newly named (False: already named, or another block holds that content)."""
        if not self.enable_prefix_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id
            return True
        return False

    def forget_unused(self) -> int:
        """Drop the names of cached blocks nobody uses (a cache flush); how many were dropped."""
        dropped = 0
        for block_id in self.free_queue:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.cached.get(block.block_hash) == block_id:
                    del self.cached[block.block_hash]
                block.block_hash = None
                dropped += 1
        return dropped

"""Which cache storage each request owns: token blocks (with prefix reuse) and a per-sequence slot.

DeepSeek-V4 keeps two kinds of state. Token-indexed state (compressed KV,
indexer keys, HCA entries) grows with the sequence and is content-addressed:
it lives in blocks from the ``BlockPool``. Per-sequence state (the sliding-window
ring and the compressors' partial windows) has a fixed size and depends on
everything before it: each running request holds one slot for it.
"""

from __future__ import annotations

from .block_pool import BlockPool, chain_hashes
from .request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, enable_prefix_caching: bool = True, salt: object = None) -> None:
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.salt = salt
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}
        self._hashes: dict[str, list[int]] = {}
        self._shared: dict[str, int] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def prefix_hit(self, req: Request) -> list[int]:
        """Cached blocks covering the longest cached prefix, leaving at least one token to compute.

        Requests that want prompt log-probabilities get none: every prompt position must be computed.
        """
        if req.params.prompt_logprobs is not None:
            return []
        hashes = chain_hashes(req.all_token_ids[: req.num_known_tokens - 1], self.block_size, self.salt)
        return self.pool.lookup(hashes)

    def allocate(self, req: Request, num_tokens: int, hit: list[int] | None = None) -> bool:
        """Make room for the first ``num_tokens`` tokens of ``req``; False (nothing changed) if it cannot."""
        table = self.tables.get(req.request_id)
        if table is None and not self._free_slots:
            return False
        current = len(table) if table is not None else len(hit or [])
        need = self.blocks_for(num_tokens) - current
        fresh: list[int] = []
        if need > 0:
            # a hit's blocks sitting in the free queue are not free for this request
            reusable_free = sum(1 for b in (hit or []) if self.pool.blocks[b].ref_count == 0) if table is None else 0
            if need > self.pool.num_free - reusable_free:
                return False
        if table is None:
            self.pool.acquire(hit or [])
            table = list(hit or [])
            self.tables[req.request_id] = table
            self.slots[req.request_id] = self._free_slots.pop()
            self._hashes[req.request_id] = []
        if need > 0:
            fresh = self.pool.allocate(need) or []
            table.extend(fresh)
        return True

    def fork(self, source: Request, child: Request, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``child`` its own slot holding ``source``'s first ``num_tokens`` tokens: their full
        blocks shared, a partly filled last block as a fresh block to copy into. Returns the
        ``(source block, child block)`` copies to make, or None (nothing changed) without room."""
        table = self.tables[source.request_id]
        full, partial = divmod(num_tokens, self.block_size)
        if not self._free_slots or (partial and self.pool.num_free < 1):
            return None
        shared = table[:full]
        self.pool.acquire(shared)
        fresh = self.pool.allocate(1) if partial else []
        self.tables[child.request_id] = list(shared) + list(fresh or [])
        self.slots[child.request_id] = self._free_slots.pop()
        self._hashes[child.request_id] = []
        self._shared[child.request_id] = full * self.block_size
        return [(table[full], fresh[0])] if partial else []

    def shared_tokens(self, req: Request) -> int:
        """Leading tokens whose blocks ``req`` got from another sequence by ``fork``."""
        return self._shared.get(req.request_id, 0)

    def commit(self, req: Request) -> None:
        """Register the blocks that are now full of computed tokens for prefix reuse."""
        hashes = self._hashes.get(req.request_id)
        if hashes is None:
            return
        full = min(req.num_computed_tokens, req.num_known_tokens) // self.block_size
        if full > len(hashes):
            start = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.extend(chain_hashes(req.all_token_ids[: full * self.block_size], self.block_size, self.salt, start, parent))
            table = self.tables[req.request_id]
            for i in range(start, full):
                self.pool.register(table[i], hashes[i])

    def free(self, req: Request) -> None:
        """Give back the request's blocks (they stay cached) and its slot."""
        table = self.tables.pop(req.request_id, None)
        if table is None:
            return
        self.pool.release(table)
        self._free_slots.append(self.slots.pop(req.request_id))
        self._hashes.pop(req.request_id, None)
        self._shared.pop(req.request_id, None)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Drop blocks past ``num_tokens`` (rejected speculative tokens)."""
        table = self.tables.get(req.request_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        if keep < len(table):
            self.pool.release(table[keep:])
            del table[keep:]
        hashes = self._hashes[req.request_id]
        del hashes[num_tokens // self.block_size :]

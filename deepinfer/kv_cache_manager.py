"""Which cache storage each request owns: token blocks (with prefix reuse) and a per-sequence slot.

DeepSeek-V4 keeps two kinds of state. Token-indexed state (compressed KV,
indexer keys, HCA entries) grows with the sequence and is content-addressed:
it lives in blocks from the ``BlockPool``. Per-sequence state (the sliding-window
ring and the compressors' partial windows) has a fixed size and depends on
everything before it: each running request holds one slot for it.

With a KV store (``deepinfer/kv_store``) below the in-memory cache, a prefix
that misses in memory continues in the store: its stored blocks get fresh
blocks here, named by their hashes like committed ones, and their contents
wait in ``loads``; newly committed blocks wait in ``saves``. Both leave in the
``KVStoreOps`` of the next step the engine builds, which the model runner applies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .block_pool import BlockPool, chain_hashes
from .kv_store.step_ops import BlockLoad, BlockSave, KVStoreOps
from .request import Request

if TYPE_CHECKING:
    from .kv_store import KVStore


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, num_slots: int, enable_prefix_caching: bool = True, salt: object = None,
        store: "KVStore | None" = None,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.salt = salt
        self.store = store if enable_prefix_caching else None
        self.loads: list[BlockLoad] = []
        self.saves: list[BlockSave] = []
        #: request id -> how many of its block hashes the store was asked for (a waiting request asks once)
        self._probed: dict[str, int] = {}
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.tables: dict[str, list[int]] = {}
        self.slots: dict[str, int] = {}
        self._hashes: dict[str, list[int]] = {}
        self._shared: dict[str, int] = {}
        #: finished requests whose state another engine will copy: request id -> (slot, block table)
        self.held: dict[str, tuple[int, list[int]]] = {}

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
        hashes = chain_hashes(req.known_tokens(0, req.num_known_tokens - 1), self.block_size, self.salt, images=req.images)
        hit = self.pool.lookup(hashes)
        if self.store is not None and len(hit) < len(hashes) and self._probed.get(req.request_id, 0) < len(hashes):
            self._probed[req.request_id] = len(hashes)
            hit = hit + self._load(req, hashes[len(hit) :], hit)
        return hit

    def _load(self, req: Request, hashes: list[int], hit: list[int]) -> list[int]:
        """Blocks for the stored run of ``hashes`` after an in-memory ``hit``: named and queued in ``loads``.
        Only when the whole request then fits without evicting the hit (a store hit never preempts)."""
        free = self.pool.num_free - sum(1 for b in hit if self.pool.blocks[b].ref_count == 0)
        if self.blocks_for(req.num_tokens) - len(hit) > free:
            return []
        data = self.store.read(hashes, self.cache_class(req))
        if not data:
            return []
        self.pool.acquire(hit)  # not evicted for the fresh blocks
        fresh = self.pool.allocate(len(data)) or []
        for block_id, h in zip(fresh, hashes):
            self.pool.register(block_id, h)
        self.pool.release(hit + fresh)
        self.loads.extend(BlockLoad(block_id, blocks) for block_id, blocks in zip(fresh, data))
        return fresh

    def cache_class(self, req: Request) -> str:
        """The store's retention class of ``req``'s blocks."""
        return self.store.policy.class_for(req.params.cache_class) if self.store is not None else ""

    def take_store_ops(self) -> KVStoreOps:
        """The saves and loads since the last call, for the step being built (a block loaded twice, evicted in
        between, keeps its last contents)."""
        latest = {load.block_id: load for load in self.loads}
        ops = KVStoreOps(self.saves, list(latest.values()))
        self.saves, self.loads = [], []
        return ops

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
            self._probed.pop(req.request_id, None)
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
            new = req.known_tokens(start * self.block_size, full * self.block_size)  # the newly full blocks alone
            hashes.extend(chain_hashes(new, self.block_size, self.salt, parent=parent, images=req.images,
                                       first_position=start * self.block_size))
            table = self.tables[req.request_id]
            for i in range(start, full):
                named = self.pool.register(table[i], hashes[i])
                if named and self.store is not None and not self.store.known(hashes[i]):
                    self.saves.append(BlockSave(table[i], hashes[i], self.cache_class(req)))

    def hold(self, req: Request) -> None:
        """Keep a finished request's slot and blocks out of reuse until ``release_held`` (another engine
        copies its state first)."""
        self._probed.pop(req.request_id, None)
        table = self.tables.pop(req.request_id, None)
        if table is None:
            return
        self.held[req.request_id] = (self.slots.pop(req.request_id), table)
        self._hashes.pop(req.request_id, None)
        self._shared.pop(req.request_id, None)

    def release_held(self, request_id: str) -> None:
        """Give back a held request's slot and blocks (they stay cached)."""
        held = self.held.pop(request_id, None)
        if held is not None:
            slot, table = held
            self.pool.release(table)
            self._free_slots.append(slot)

    def free(self, req: Request) -> None:
        """Give back the request's blocks (they stay cached) and its slot."""
        self._probed.pop(req.request_id, None)
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

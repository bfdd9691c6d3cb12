"""The KV store: committed token blocks on disk, shared by every engine that opens the same directory.

Below the in-memory prefix cache: a committed block is written through (on a
writer thread, after the device thread copied it to the host), and a prefix
that misses in memory is looked up here block by block, stopping at the first
block that is absent or unusable. A file is used only when its checksum,
fingerprint, hash and layout all match and a packed cache's records hold
valid scales; anything else is ignored (and deleted, so a writer replaces
it), and the request recomputes that part. A directory that cannot be
written leaves the store reading only, one that cannot be read leaves no
store; either says so once.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .block_file import BadBlockFile, PartShape, decode, encode, write_atomic
from .layout import block_path, class_names
from .maintenance import prune
from .policy import StorePolicy

log = logging.getLogger("deepinfer")

#: blocks waiting for the writer beyond this are dropped (a slow filesystem must not hold host memory)
MAX_PENDING_BLOCKS = 4096
#: the writer prunes at least this often, and whenever a class grew by a tenth of its capacity
PRUNE_INTERVAL_S = 3600.0


@dataclass
class StoreStats:
    """Counters of one engine's store; reads are counted by the engine thread, writes by the writer."""

    kv_store_lookups: int = 0
    #: lookups that loaded at least one block / none
    kv_store_hits: int = 0
    kv_store_misses: int = 0
    kv_store_hit_blocks: int = 0
    kv_store_hit_tokens: int = 0
    kv_store_bytes_read: int = 0
    #: stored files found unusable (checksum, fingerprint, layout) and ignored
    kv_store_bad_files: int = 0
    kv_store_blocks_written: int = 0
    kv_store_bytes_written: int = 0
    #: blocks not written: the writer was too far behind, or writing failed
    kv_store_blocks_dropped: int = 0
    kv_store_pruned_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def store_line(metrics: dict[str, Any]) -> str:
    """The store's part of ``--stats`` from an engine's metrics ("" when no store was used)."""
    m = metrics
    if not (m.get("kv_store_lookups") or m.get("kv_store_blocks_written")):
        return ""
    return (f" | kv store: {m['kv_store_hits']} hits / {m['kv_store_lookups']} lookups, {m['kv_store_hit_tokens']} tokens loaded,"
            f" {m['kv_store_bytes_read']:,} B read, {m['kv_store_bytes_written']:,} B written")


@dataclass(frozen=True)
class BlockWrite:
    """One committed block to store: its hash and the class of the request that committed it."""

    block_hash: int
    cache_class: str


class KVStore:
    def __init__(
        self, root: Path, fingerprint: str, policy: StorePolicy, parts: list[PartShape], block_size: int, writable: bool = True,
    ) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.policy = policy
        self.parts = parts
        self.block_size = block_size
        self.writable = writable
        self.stats = StoreStats()
        #: hashes this process knows are stored (it wrote or read them): not copied off the device again
        self._known: set[int] = set()
        self._queue: queue.Queue[tuple[list[BlockWrite], Future] | None] = queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._warned = False
        self._grown: dict[str, int] = {}
        self._last_prune = 0.0
        self._writer: threading.Thread | None = None
        #: payload bytes of one block (a file adds its header and checksum)
        self.block_bytes = sum(p.nbytes for p in parts)
        if writable:
            self._writer = threading.Thread(target=self._write_loop, name="deepinfer-kv-store", daemon=True)
            self._writer.start()
            atexit.register(self.close)

    @classmethod
    def open(
        cls, root: str | Path, fingerprint: str, policy: StorePolicy, parts: list[PartShape], block_size: int
    ) -> "KVStore | None":
        """The store at ``root``: read-write, reading only (one warning) when it cannot be written, or None
        (one warning) when it can be neither created nor read."""
        root = Path(root).expanduser()
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("kv_store %s cannot be created (%s); running without the store", root, exc.strerror or exc)
            return None
        if not os.access(root, os.R_OK | os.X_OK):
            log.warning("kv_store %s cannot be read; running without the store", root)
            return None
        try:
            policy.save(root)
            writable = True
        except OSError as exc:
            log.warning("kv_store %s cannot be written (%s); reading stored blocks only", root, exc.strerror or exc)
            writable = False
        return cls(root, fingerprint, policy, parts, block_size, writable)

    # ----- reads (engine thread) -----

    def read(self, hashes: list[int], cache_class: str) -> list[list[torch.Tensor]]:
        """The stored state of the longest run of ``hashes`` whose every block is stored and usable."""
        self.stats.kv_store_lookups += 1
        order = [cache_class] + [c for c in class_names(self.root) if c != cache_class]
        out: list[list[torch.Tensor]] = []
        for h in hashes:
            data = self._read_one(h, order)
            if data is None:
                break
            out.append(data)
            self._known.add(h)
        s = self.stats
        if out:
            s.kv_store_hits += 1
            s.kv_store_hit_blocks += len(out)
            s.kv_store_hit_tokens += len(out) * self.block_size
        else:
            s.kv_store_misses += 1
        return out

    def _read_one(self, block_hash: int, classes: list[str]) -> list[torch.Tensor] | None:
        for c in classes:
            path = block_path(self.root, c, self.fingerprint, block_hash)
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            try:
                tensors = decode(raw, self.fingerprint, block_hash, self.parts)
            except BadBlockFile as exc:
                self.stats.kv_store_bad_files += 1
                log.debug("kv_store: ignoring %s: %s", path, exc)
                if self.writable:
                    try:
                        path.unlink()
                    except OSError:
                        pass
                return None
            self.stats.kv_store_bytes_read += len(raw)
            if self.writable:
                try:
                    os.utime(path)  # its last use: retention and LRU go by it
                except OSError:
                    pass
            return tensors
        return None

    def known(self, block_hash: int) -> bool:
        """Whether this process already knows the block is stored."""
        return block_hash in self._known

    # ----- writes (writer thread) -----

    def write(self, blocks: list[BlockWrite], data: Future) -> None:
        """Store ``blocks`` once ``data`` (their host copies, in order) resolves; returns at once."""
        if not self.writable or not blocks:
            return
        with self._lock:
            if self._pending + len(blocks) > MAX_PENDING_BLOCKS:
                self.stats.kv_store_blocks_dropped += len(blocks)
                return
            self._pending += len(blocks)
        for b in blocks:
            self._known.add(b.block_hash)
        self._queue.put((blocks, data))

    def flush(self) -> None:
        """Wait until every block handed to ``write`` is on disk (or dropped)."""
        if self._writer is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is pending and stop the writer."""
        writer, self._writer = self._writer, None
        if writer is not None:
            self._queue.put(None)
            writer.join(timeout=60.0)

    def _write_loop(self) -> None:
        self._prune()
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                blocks, data = job
                try:
                    tensors = data.result()
                except Exception as exc:  # the copy failed with the step: nothing to write
                    log.debug("kv_store: block copy failed: %s", exc)
                    tensors = None
                for b, t in zip(blocks, tensors or []):
                    if self.writable:
                        self._write_one(b, t)
                    else:
                        self.stats.kv_store_blocks_dropped += 1
                with self._lock:
                    self._pending -= len(blocks)
                if time.monotonic() - self._last_prune > PRUNE_INTERVAL_S:
                    self._prune()
            finally:
                self._queue.task_done()

    def _write_one(self, block: BlockWrite, tensors: list[torch.Tensor]) -> None:
        path = block_path(self.root, block.cache_class, self.fingerprint, block.block_hash)
        if path.exists():
            return  # another engine stored it first
        data = encode(self.fingerprint, block.block_hash, self.parts, tensors)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)
        except OSError as exc:
            self.writable = False
            self.stats.kv_store_blocks_dropped += 1
            if not self._warned:
                self._warned = True
                log.warning("kv_store %s: writing failed (%s); no more blocks are stored, stored ones are still read", self.root, exc.strerror or exc)
            return
        s = self.stats
        s.kv_store_blocks_written += 1
        s.kv_store_bytes_written += len(data)
        grown = self._grown[block.cache_class] = self._grown.get(block.cache_class, 0) + len(data)
        capacity = self.policy.classes[block.cache_class].capacity_bytes
        if capacity is not None and grown > capacity // 10:
            self._prune(block.cache_class)

    def _prune(self, only: str | None = None) -> None:
        """Apply the retention rules (all classes, or the class that grew)."""
        try:
            report = prune(self.root, self.policy, only=only)
        except OSError as exc:
            log.debug("kv_store: pruning failed: %s", exc)
            return
        self.stats.kv_store_pruned_bytes += report.deleted_bytes
        if only is None:
            self._last_prune = time.monotonic()
            self._grown.clear()
        else:
            self._grown[only] = 0

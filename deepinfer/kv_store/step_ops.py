"""A step's KV-store work: the record its ``Step`` carries and the model runner applies on the device thread.

The KV cache manager fills it as the engine builds the step: blocks committed
since the previous step, to copy off the device for the store's writer, and
blocks found in the store, to install before the forward. The runner copies the
saves first, so nothing the step loads or computes overwrites a block before it
is copied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .store import BlockWrite


@dataclass(frozen=True)
class BlockLoad:
    """A stored block to install: cache block ``block_id`` takes ``data`` (one tensor per
    ``ModelCache.block_parts()`` entry, as ``read_blocks`` gives them)."""

    block_id: int
    data: list[torch.Tensor]


@dataclass(frozen=True)
class BlockSave:
    """A newly committed block to write through: where it is, its hash, its retention class."""

    block_id: int
    block_hash: int
    cache_class: str

    @property
    def write(self) -> BlockWrite:
        """What the store's writer names the block by."""
        return BlockWrite(self.block_hash, self.cache_class)


@dataclass
class KVStoreOps:
    """One step's store work: blocks to copy off the device for the store, then blocks to install."""

    saves: list[BlockSave] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.saves or self.loads)

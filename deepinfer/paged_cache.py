"""The engine's implementation of the model's cache interface: sequence rings plus paged entry pools.

Two storage kinds per layer, as ``ModelCache`` describes:

- per sequence slot, fixed-size rings for the sliding-window K=V rows and the
  compressors' partial-window projections (state that depends on everything
  before it, so it is never shared);
- token blocks, shared through the ``BlockPool`` and its prefix cache, for the
  compressed entries and indexer keys: a block of ``block_size`` tokens holds
  ``block_size / ratio`` entries of each compressing layer. Each sequence's
  block table maps its entry numbers to blocks.

Ring capacities allow ``max_step_tokens`` tokens per sequence per step beyond
the window, which also bounds how far a sequence can be rolled back.
"""

from __future__ import annotations

import math

import torch

from .model.batch import Batch
from .model.cache import COMPRESSOR, INDEXER, ModelCache
from .model.config import CSA, SLIDING, ModelConfig


def block_size_for(config: ModelConfig, requested: int) -> int:
    """The smallest multiple of ``requested`` that every compress ratio divides."""
    ratios = [config.compress_ratio(t) for t in set(config.layer_types) if t != SLIDING]
    lcm = math.lcm(*ratios) if ratios else 1
    return lcm * math.ceil(requested / lcm) if requested % lcm else requested


class PagedModelCache(ModelCache):
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        num_blocks: int,
        block_size: int,
        max_blocks_per_seq: int,
        max_step_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window_capacity = config.sliding_window - 1 + max_step_tokens
        self._epb: dict[str, int] = {}
        self._state_cap: dict[str, int] = {}
        for lt in set(config.layer_types):
            m = config.compress_ratio(lt)
            self._epb[lt] = block_size // m if m else 0
            self._state_cap[lt] = ((2 if lt == CSA else 1) * m - 1 + max_step_tokens) if m else 0
        hd = config.head_dim
        self._kv, self._state, self._index = [], [], []
        for lt in config.layer_types:
            rows = num_slots * self.window_capacity + num_blocks * self._epb[lt]
            self._kv.append(torch.zeros(rows, hd, dtype=dtype, device=device))
            states: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            index = torch.zeros(0, config.index_head_dim, dtype=dtype, device=device)
            if lt != SLIDING:
                srows = num_slots * self._state_cap[lt]
                width = hd * (2 if lt == CSA else 1)
                states[COMPRESSOR] = (torch.zeros(srows, width, dtype=dtype, device=device), torch.zeros(srows, width, dtype=dtype, device=device))
                if lt == CSA:
                    iw = 2 * config.index_head_dim
                    states[INDEXER] = (torch.zeros(srows, iw, dtype=dtype, device=device), torch.zeros(srows, iw, dtype=dtype, device=device))
                    index = torch.zeros(num_blocks * self._epb[lt], config.index_head_dim, dtype=dtype, device=device)
            self._state.append(states)
            self._index.append(index)
        self._host_tables = torch.full((num_slots, max_blocks_per_seq), -1, dtype=torch.int64)
        self.block_tables = self._host_tables.to(device)
        # per slot: first position whose window / compressor state this sequence wrote itself
        # (replay after a prefix hit starts late), and how many leading tokens' entries are shared
        self._host_floor = torch.zeros(num_slots, dtype=torch.int64)
        self._host_frozen = torch.zeros(num_slots, dtype=torch.int64)
        self.floor = self._host_floor.to(device)
        self.frozen = self._host_frozen.to(device)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Cache bytes one token block costs across all layers."""
        item = torch.empty((), dtype=dtype).element_size()
        total = 0
        for lt in config.layer_types:
            m = config.compress_ratio(lt)
            if m:
                epb = block_size // m
                total += epb * config.head_dim + (epb * config.index_head_dim if lt == CSA else 0)
        return total * item

    @staticmethod
    def bytes_per_slot(config: ModelConfig, max_step_tokens: int, dtype: torch.dtype) -> int:
        """Cache bytes one sequence slot's rings cost across all layers."""
        item = torch.empty((), dtype=dtype).element_size()
        total = 0
        for lt in config.layer_types:
            total += (config.sliding_window - 1 + max_step_tokens) * config.head_dim
            m = config.compress_ratio(lt)
            if m:
                cap = (2 if lt == CSA else 1) * m - 1 + max_step_tokens
                total += 2 * cap * config.head_dim * (2 if lt == CSA else 1)
                if lt == CSA:
                    total += 2 * cap * 2 * config.index_head_dim
        return total * item

    def set_sequences(self, tables: dict[int, list[int]], floors: dict[int, int], frozen: dict[int, int]) -> None:
        """Install, for the sequences of the next step (by slot): block tables, the first
        position of state they computed themselves, and the tokens whose entries are shared."""
        for slot, blocks in tables.items():
            row = self._host_tables[slot]
            row[: len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
            row[len(blocks) :] = -1
            self._host_floor[slot] = floors.get(slot, 0)
            self._host_frozen[slot] = frozen.get(slot, 0)
        self.block_tables.copy_(self._host_tables, non_blocking=True)
        self.floor.copy_(self._host_floor, non_blocking=True)
        self.frozen.copy_(self._host_frozen, non_blocking=True)

    def kv_pool(self, layer: int) -> torch.Tensor:
        return self._kv[layer]

    def state_pool(self, layer: int, branch: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._state[layer][branch]

    def index_pool(self, layer: int) -> torch.Tensor:
        return self._index[layer]

    def _own(self, seqs: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Ring rows for positions this sequence computed itself; -1 elsewhere."""
        floor = self.floor[seqs.clamp(min=0)]
        return torch.where((positions >= floor) & (positions >= 0) & (seqs >= 0), rows, torch.full_like(rows, -1))

    def window_slots(self, layer_type: str, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cap = self.window_capacity
        return self._own(seqs, positions, seqs * cap + positions % cap)

    def _paged(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor, base: int) -> torch.Tensor:
        epb = self._epb[layer_type]
        safe_seq = seqs.clamp(min=0)
        block = (entries.clamp(min=0) // epb).clamp(max=self.block_tables.shape[1] - 1)
        phys = self.block_tables[safe_seq, block]
        rows = base + phys * epb + entries.clamp(min=0) % epb
        return torch.where((entries >= 0) & (seqs >= 0) & (phys >= 0), rows, torch.full_like(rows, -1))

    def entry_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        return self._paged(layer_type, seqs, entries, self.num_slots * self.window_capacity)

    def index_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        return self._paged(layer_type, seqs, entries, 0)

    def state_slots(self, layer_type: str, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cap = self._state_cap[layer_type]
        return self._own(seqs, positions, seqs * cap + positions % cap)

    def _unshared(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        shared = self.frozen[seqs.clamp(min=0)] // self.config.compress_ratio(layer_type)
        return torch.where(entries >= shared, rows, torch.full_like(rows, -1))

    def entry_write_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        return self._unshared(layer_type, seqs, entries, self.entry_slots(layer_type, seqs, entries))

    def index_write_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        return self._unshared(layer_type, seqs, entries, self.index_slots(layer_type, seqs, entries))

    def begin_forward(self, batch: Batch) -> None:
        """Every sequence's block table must already cover the tokens it brings."""

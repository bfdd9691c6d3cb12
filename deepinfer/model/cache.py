"""The state the model keeps between steps, reached only through slot indices.

Every layer owns pools of rows; the model asks the cache which row holds what
(``*_slots``) and reads and writes the rows itself through ``Kernels`` ops. Rows
are addressed by (sequence slot, absolute position) or (sequence slot, entry
number), never by "the last n tokens", so an implementation may page its pools
with block tables, and rolling a sequence back only moves its length: rows past
the new length are rewritten before anything reads them again.

What one forward step with a sequence at positions ``[s, e)`` touches, per layer
type with compress ratio ``m`` (the rows an implementation must keep live and
distinct):

- window rows (raw K=V) for positions ``[s − W + 1, e)``, ``W`` the sliding window;
- compressor state rows for positions ``[m·⌊s/m⌋ − m·o, e)``, ``o`` = 1 for the
  overlapping compressor of compressed sparse attention, 0 for heavy compression;
- compressed-entry rows (and indexer-key rows) ``0 … ⌊e/m⌋ − 1``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..errors import DeepInferError
from .batch import Batch
from .config import CSA, SLIDING, ModelConfig

COMPRESSOR = "compressor"
INDEXER = "indexer"


class ModelCache(ABC):
    """Per-layer state pools and the slot mapping into them.

    Slot methods take same-shaped int64 tensors of sequence slots and
    positions (or entry numbers) and return int64 rows of the same shape;
    negative positions or entries, and negative sequence slots, map to ``-1``.
    All layers of one layer type share one slot layout, so the model computes
    slots once per layer type and step.
    """

    def begin_forward(self, batch: Batch) -> None:
        """Called once at the start of every forward with the step's batch."""

    @abstractmethod
    def kv_pool(self, layer: int) -> torch.Tensor:
        """``[N, head_dim]``: K=V rows of window tokens and of compressed entries."""

    @abstractmethod
    def state_pool(self, layer: int, branch: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv, gate)`` ``[N, width]`` per-token compressor projections.

        ``branch`` is ``"compressor"`` (width ``head_dim``, twice that for
        compressed sparse attention) or ``"indexer"`` (``2·index_head_dim``,
        compressed sparse attention only). Both branches share ``state_slots``.
        """

    @abstractmethod
    def index_pool(self, layer: int) -> torch.Tensor:
        """``[N, index_head_dim]`` indexer keys of compressed entries (compressed sparse attention)."""

    @abstractmethod
    def window_slots(self, layer_type: str, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of ``kv_pool`` holding the raw K=V of the tokens at ``positions``."""

    @abstractmethod
    def entry_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Rows of ``kv_pool`` holding compressed entries ``entries``."""

    @abstractmethod
    def index_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Rows of ``index_pool`` holding the indexer keys of ``entries``."""

    @abstractmethod
    def state_slots(self, layer_type: str, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows of ``state_pool`` holding the compressor projections of the tokens at ``positions``."""

    def entry_write_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Rows of ``kv_pool`` that newly emitted ``entries`` are written to; -1 keeps an entry as it is.

        A cache that shares entries between sequences (prefix caching) returns -1
        for entries it already holds, so recomputing tokens never overwrites them.
        """
        return self.entry_slots(layer_type, seqs, entries)

    def index_write_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Rows of ``index_pool`` that new indexer keys are written to; -1 keeps a key as it is."""
        return self.index_slots(layer_type, seqs, entries)


class ContiguousCache(ModelCache):
    """Each sequence slot owns fixed contiguous regions of every pool.

    Window and compressor-state regions are rings: a position lives in row
    ``position mod capacity``. Capacities are sized for steps of at most
    ``max_step_tokens`` tokens per sequence (all of ``max_len`` when None), so
    a sequence can be rolled back by up to ``max_step_tokens`` tokens
    (rejected speculative tokens) with ``truncate``.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_seqs: int,
        max_len: int,
        *,
        max_step_tokens: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_seqs <= 0 or max_len <= 0:
            raise DeepInferError(f"ContiguousCache needs max_seqs > 0 and max_len > 0 (got {max_seqs}, {max_len})")
        self.config = config
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.max_step_tokens = min(max_step_tokens or max_len, max_len)
        step = self.max_step_tokens
        self.window_capacity = min(config.sliding_window - 1 + step, max_len)
        self._entries: dict[str, int] = {}
        self._state_capacity: dict[str, int] = {}
        for lt in set(config.layer_types):
            m = config.compress_ratio(lt)
            self._entries[lt] = max_len // m if m else 0
            overlap = 2 if lt == CSA else 1
            self._state_capacity[lt] = min(overlap * m - 1 + step, max_len) if m else 0
        self._kv: list[torch.Tensor] = []
        self._state: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        self._index: list[torch.Tensor] = []
        hd = config.head_dim
        for lt in config.layer_types:
            rows = max_seqs * (self.window_capacity + self._entries[lt])
            self._kv.append(torch.zeros(rows, hd, dtype=dtype, device=device))
            states: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            index = torch.zeros(0, config.index_head_dim, dtype=dtype, device=device)
            if lt != SLIDING:
                srows = max_seqs * self._state_capacity[lt]
                width = hd * (2 if lt == CSA else 1)
                states[COMPRESSOR] = tuple(torch.zeros(srows, width, dtype=dtype, device=device) for _ in range(2))
                if lt == CSA:
                    iw = 2 * config.index_head_dim
                    states[INDEXER] = tuple(torch.zeros(srows, iw, dtype=dtype, device=device) for _ in range(2))
                    index = torch.zeros(max_seqs * self._entries[lt], config.index_head_dim, dtype=dtype, device=device)
            self._state.append(states)
            self._index.append(index)
        self.lengths = [0] * max_seqs
        self._in_use = [False] * max_seqs

    # ----- sequence bookkeeping -----

    def allocate(self) -> int:
        """Claim a free sequence slot (length 0)."""
        for slot, used in enumerate(self._in_use):
            if not used:
                self._in_use[slot] = True
                self.lengths[slot] = 0
                return slot
        raise DeepInferError(f"all {self.max_seqs} sequence slots of the cache are in use; free one or build a larger cache")

    def free(self, slot: int) -> None:
        """Release ``slot``; its rows are reused by the next ``allocate``."""
        self._check_slot(slot)
        self._in_use[slot] = False
        self.lengths[slot] = 0

    def truncate(self, slot: int, new_len: int) -> None:
        """Drop the tokens at positions ``>= new_len`` (e.g. rejected speculative tokens)."""
        self._check_slot(slot)
        length = self.lengths[slot]
        if not 0 <= new_len <= length:
            raise DeepInferError(f"cannot truncate sequence slot {slot} of length {length} to {new_len}; give 0 <= new_len <= {length}")
        if new_len < length - self.max_step_tokens and new_len != 0:
            raise DeepInferError(
                f"cannot roll sequence slot {slot} back from {length} to {new_len}: the rings keep only "
                f"{self.max_step_tokens} tokens of history beyond the window; truncate to 0 and prefill again"
            )
        self.lengths[slot] = new_len

    def begin_forward(self, batch: Batch) -> None:
        """Check each sequence continues where its cached state ends, then extend its length."""
        for slot, start, n in zip(batch.seq_slots, batch.start_positions, batch.query_lens):
            self._check_slot(slot)
            if start != self.lengths[slot]:
                raise DeepInferError(
                    f"sequence slot {slot} holds {self.lengths[slot]} tokens but the batch continues it at position {start}; "
                    f"call truncate({slot}, {start}) first to roll it back"
                )
            if n > self.max_step_tokens:
                raise DeepInferError(f"sequence slot {slot} brings {n} tokens in one step; this cache takes at most {self.max_step_tokens} (max_step_tokens)")
            if start + n > self.max_len:
                raise DeepInferError(f"sequence slot {slot} would reach {start + n} tokens; this cache holds at most {self.max_len} (max_len)")
        for slot, start, n in zip(batch.seq_slots, batch.start_positions, batch.query_lens):
            self.lengths[slot] = start + n

    def _check_slot(self, slot: int) -> None:
        if not (0 <= slot < self.max_seqs and self._in_use[slot]):
            raise DeepInferError(f"sequence slot {slot} is not allocated in this cache; call allocate() first")

    # ----- pools -----

    def kv_pool(self, layer: int) -> torch.Tensor:
        return self._kv[layer]

    def state_pool(self, layer: int, branch: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._state[layer][branch]

    def index_pool(self, layer: int) -> torch.Tensor:
        return self._index[layer]

    # ----- slot mapping -----

    @staticmethod
    def _rows(seqs: torch.Tensor, where: torch.Tensor, stride: int, offset: int, capacity: int | None) -> torch.Tensor:
        local = where % capacity if capacity else where
        rows = seqs * stride + offset + local
        return torch.where((where >= 0) & (seqs >= 0), rows, torch.full_like(rows, -1))

    def window_slots(self, layer_type: str, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        stride = self.window_capacity + self._entries[layer_type]
        return self._rows(seqs, positions, stride, 0, self.window_capacity)

    def entry_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        stride = self.window_capacity + self._entries[layer_type]
        return self._rows(seqs, entries, stride, self.window_capacity, None)

    def index_slots(self, layer_type: str, seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        return self._rows(seqs, entries, self._entries[layer_type], 0, None)

    def state_slots(self, layer_type: str, seqs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cap = self._state_capacity[layer_type]
        return self._rows(seqs, positions, cap, 0, cap)

"""The flattened variable-length batch one forward step runs on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from ..errors import DeepInferError


@dataclass(frozen=True)
class Batch:
    """Tokens of several sequences concatenated, with where each one sits.

    Sequence ``i`` contributes ``query_lens[i]`` consecutive tokens at positions
    ``start_positions[i] ...``; its state lives in cache slot ``seq_slots[i]``.
    Device tensors feed the kernels; the host tuples serve shape decisions and
    cache bookkeeping without a device sync.
    """

    #: ``[T]`` int64 token ids
    input_ids: torch.Tensor
    #: ``[T]`` int64 absolute position of each token in its sequence
    positions: torch.Tensor
    #: ``[T]`` int64 cache slot of each token's sequence
    token_slots: torch.Tensor
    #: ``[B + 1]`` int64 offsets of each sequence's first token (cumulative query lengths)
    query_start_loc: torch.Tensor
    #: ``[L]`` int64 rows of the batch whose logits ``forward`` returns
    logits_indices: torch.Tensor
    seq_slots: tuple[int, ...]
    start_positions: tuple[int, ...]
    query_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_slots)

    @property
    def max_context_len(self) -> int:
        """The longest sequence length once this step's tokens are in (0 for an empty batch)."""
        return max((s + n for s, n in zip(self.start_positions, self.query_lens)), default=0)

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        seq_slots: Sequence[int],
        start_positions: Sequence[int],
        logits: Literal["last", "all"] | Sequence[Sequence[int]] = "last",
        device: torch.device | str = "cpu",
    ) -> "Batch":
        """A batch from per-sequence token lists.

        ``logits`` selects the rows returned: ``"last"`` (each sequence's last
        token), ``"all"``, or per sequence a list of offsets into its tokens.
        """
        if not (len(token_ids) == len(seq_slots) == len(start_positions)):
            raise DeepInferError(
                f"Batch.build got {len(token_ids)} token lists, {len(seq_slots)} slots and {len(start_positions)} "
                "start positions; give one of each per sequence"
            )
        if len(set(seq_slots)) != len(seq_slots):
            raise DeepInferError(f"Batch.build got repeated cache slots {list(seq_slots)}; each sequence needs its own slot")
        lens = [len(t) for t in token_ids]
        if any(n == 0 for n in lens) or any(s < 0 for s in start_positions):
            raise DeepInferError("every sequence in a batch needs at least one token and a start position >= 0")
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        if logits == "last":
            rows = [offsets[i + 1] - 1 for i in range(len(lens))]
        elif logits == "all":
            rows = list(range(offsets[-1]))
        else:
            rows = [offsets[i] + j for i, js in enumerate(logits) for j in js if 0 <= j < lens[i]]
        flat = [t for seq in token_ids for t in seq]
        positions = [s + j for s, n in zip(start_positions, lens) for j in range(n)]
        slots = [slot for slot, n in zip(seq_slots, lens) for _ in range(n)]
        as_long = dict(dtype=torch.int64, device=device)
        return cls(
            input_ids=torch.tensor(flat, **as_long),
            positions=torch.tensor(positions, **as_long),
            token_slots=torch.tensor(slots, **as_long),
            query_start_loc=torch.tensor(offsets, **as_long),
            logits_indices=torch.tensor(rows, **as_long),
            seq_slots=tuple(int(s) for s in seq_slots),
            start_positions=tuple(int(s) for s in start_positions),
            query_lens=tuple(lens),
        )

"""The host-side description of one forward step: which tokens of which sequences, and which logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from ...errors import DeepInferError


@dataclass(frozen=True)
class Batch:
    """Tokens of several sequences concatenated, with where each one sits.

    Sequence ``i`` contributes ``query_lens[i]`` consecutive tokens at positions
    ``start_positions[i] ...``; its state lives in cache slot ``seq_slots[i]``.
    Everything is host data: ``inputs.build_step_inputs`` turns it into the
    index tensors the forward reads, in one host-to-device copy.
    """

    #: per sequence, its token ids (negative: a placeholder filled on the device)
    token_ids: tuple[tuple[int, ...], ...]
    seq_slots: tuple[int, ...]
    start_positions: tuple[int, ...]
    #: rows of the flattened batch whose logits the step returns
    logits_indices: tuple[int, ...]
    #: per sequence, the token ids just before its start that its state lacks (its first chunk after a
    #: prefix hit: the Engram n-grams look back over them); empty, or one empty tuple per sequence, when none
    history: tuple[tuple[int, ...], ...] = ()
    #: per sequence, where the prefill it belongs to ends when only that end's logits are wanted (its
    #: prompt's length): the layers after the last shared-state one then compute only the tail before it;
    #: 0 (or empty) computes every position
    prefill_end: tuple[int, ...] = ()

    @property
    def query_lens(self) -> tuple[int, ...]:
        return tuple(len(t) for t in self.token_ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_slots)

    @property
    def max_context_len(self) -> int:
        """The longest sequence length once this step's tokens are in (0 for an empty batch)."""
        return max((s + n for s, n in zip(self.start_positions, self.query_lens)), default=0)

    @property
    def query_start_loc(self) -> tuple[int, ...]:
        """Offsets of each sequence's first token, and the total, in the flattened batch."""
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return tuple(out)

    @classmethod
    def build(
        cls,
        token_ids: Sequence[Sequence[int]],
        seq_slots: Sequence[int],
        start_positions: Sequence[int],
        logits: Literal["last", "all"] | Sequence[Sequence[int]] = "last",
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
        return cls(
            token_ids=tuple(tuple(int(t) for t in seq) for seq in token_ids),
            seq_slots=tuple(int(s) for s in seq_slots),
            start_positions=tuple(int(s) for s in start_positions),
            logits_indices=tuple(rows),
        )

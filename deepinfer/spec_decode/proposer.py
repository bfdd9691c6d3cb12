"""The DSpark proposer: the draft network plus each sequence's draft context, on the device.

A speculating sequence's context is the ring of its last ``dspark_context_window``
committed positions (``DSparkRing``): after every step the verify forward's
hidden states at the draft's target layers, for the positions the step
committed (a prefill chunk's tokens; a decode's anchor and the drafts
verification accepted), become context vectors, whether or not the sequence
drafts this step. Rejected positions never reach the ring. A sequence starting
from scratch (or replaying after a prefix hit) clears its slot's ring first, so
the context is recomputed from what it runs.

One batched pass then drafts ``γ`` tokens for every sequence the scheduler
asked to draft (``ScheduledSequence.propose``), anchored on the token just
sampled; before it, the K=V rows of the context positions those sequences'
rings have not converted yet (a sequence that paused drafting under load and
resumes) are made in one batch. The distributions the drafts were drawn from
stay on the device, keyed by request, until the next step verifies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.common.dspark import DSparkDraft, DSparkRing
from ..sampler import Sampler
from ..step import DraftProposal, SampledToken, ScheduledSequence, Step


#: steps whose committed hidden states are kept before they are projected into context vectors together,
#: and the most rows kept so (a bound on the staged copies' memory)
KEEP_BATCH = 8
KEEP_ROWS = 2048


@dataclass
class Observed:
    """Positions a step committed, one entry per speculating sequence (arrays of equal length)."""

    slot: np.ndarray
    #: first committed position (they are consecutive)
    start: np.ndarray
    #: row of the forward's flat tokens holding it
    first_row: np.ndarray
    count: np.ndarray

    @classmethod
    def of(cls, spans: list[tuple[int, int, int, int]]) -> "Observed":
        """From ``(slot, start, first_row, count)`` per sequence."""
        cols = np.asarray(spans, dtype=np.int64).reshape(-1, 4)
        return cls(cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3])


@dataclass
class Anchor:
    """One sequence to draft for: its slot, the row of its sampled token, and that token's position."""

    request_id: str
    slot: int
    position: int
    temperature: float


class DSparkProposer:
    def __init__(self, draft: DSparkDraft, num_slots: int) -> None:
        self.draft = draft
        self.ring = DSparkRing(draft, num_slots)
        self.gamma = draft.config.dspark_block_size
        self.target_layers = tuple(draft.config.dspark_target_layer_ids)
        #: (ring rows, positions, ``[T, L, D]`` target states) kept since the last flush
        self._pending: list[tuple[np.ndarray, np.ndarray, torch.Tensor]] = []
        self._pending_rows = 0
        #: request id -> ``[γ, V]`` distributions its pending draft was drawn from (greedy: its ``[γ]`` tokens)
        self._probs: dict[str, torch.Tensor] = {}

    def clear(self, slot: int) -> None:
        self.flush()
        self.ring.clear(slot)

    def fork(self, source_slot: int, slot: int) -> None:
        self.flush()
        self.ring.copy(source_slot, slot)

    def forget(self, request_id: str) -> None:
        self._probs.pop(request_id, None)

    def observe(self, hidden: dict[int, torch.Tensor], spans: Observed) -> None:
        """Keep the committed positions ``spans`` of this forward for their rings (``hidden``: the forward's
        ``[T, D]`` states per target layer): copied now, projected into context vectors with those of up to
        ``KEEP_BATCH`` steps (``KEEP_ROWS`` rows) at once, or before anything reads or resets a ring."""
        window = self.ring.window
        if (spans.count == 1).all():  # a decode step: one position per sequence
            rows, pos, slot = spans.first_row, spans.start, spans.slot
        else:
            skip = np.maximum(0, spans.count - window)  # only each span's last `window` positions can stay in the ring
            kept = np.maximum(spans.count - skip, 0)
            total = int(kept.sum())
            if not total:
                return
            offset = np.arange(total) - np.repeat(np.cumsum(kept) - kept, kept)
            rows = np.repeat(spans.first_row + skip, kept) + offset
            pos = np.repeat(spans.start + skip, kept) + offset
            slot = np.repeat(spans.slot, kept)
        states = torch.stack([hidden[i] for i in self.target_layers], dim=1)  # a copy: graph outputs are reused
        if len(rows) != states.shape[0] or (rows != np.arange(len(rows))).any():  # not every row of the forward
            states = states[torch.from_numpy(rows).to(states.device)]
        self._pending.append((slot * window + pos % window, pos, states))
        self._pending_rows += len(rows)
        if len(self._pending) >= KEEP_BATCH or self._pending_rows >= KEEP_ROWS:
            self.flush()

    def flush(self) -> None:
        """Project the hidden states kept since the last flush into context vectors, in one batch (a ring row
        written twice keeps its later position)."""
        if not self._pending:
            return
        rows = np.concatenate([r for r, _, _ in self._pending])
        pos = np.concatenate([q for _, q, _ in self._pending])
        states = torch.cat([t for _, _, t in self._pending]) if len(self._pending) > 1 else self._pending[0][2]
        self._pending.clear()
        self._pending_rows = 0
        _, last = np.unique(rows[::-1], return_index=True)
        if len(last) < len(rows):
            keep = np.sort(len(rows) - 1 - last)
            rows, pos, states = rows[keep], pos[keep], states[torch.from_numpy(keep).to(states.device)]
        self.ring.keep(rows, pos, self.draft.context(states))

    def _convert(self, slots: list[int], anchor_pos: np.ndarray) -> None:
        """Make the K=V rows the anchors' windows lack from their kept context vectors, in one batch."""
        self.flush()
        rows = self.ring.stale(slots, anchor_pos)
        if not len(rows):
            return
        dev = self.ring.kv.device
        pos = torch.from_numpy(self.ring.ctx_pos[rows]).to(dev)
        self.ring.convert(rows, self.draft.context_kv(self.ring.ctx[torch.from_numpy(rows).to(dev)], pos))

    def propose(self, anchors: list[Anchor], anchor_ids: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft for ``anchors`` (their sampled tokens ``anchor_ids`` ``[N]`` on the device):
        ``(tokens [N, γ], survival [N, γ])``. ``noise`` ``[N, γ, V]``: each sampled row's Exp(1) draws."""
        dev = self.ring.kv.device
        slots = [a.slot for a in anchors]
        positions = np.asarray([a.position for a in anchors], dtype=np.int64)
        self._convert(slots, positions)
        pos = torch.from_numpy(positions).to(dev)
        temps = torch.tensor([a.temperature for a in anchors], dtype=torch.float32, device=dev)
        sampled = any(a.temperature > 0 for a in anchors)
        out = self.draft.draft(
            anchor_ids, pos, self.ring.kv, self.ring.rows(slots, pos),
            temperature=temps, noise=noise, keep_probs=sampled,
        )
        for i, a in enumerate(anchors):
            # a greedy draft's distribution is one-hot at its token: keep the tokens, not [γ, V] floats
            # (a sampled row is copied out, so the batch's tensor is not held by it)
            self._probs[a.request_id] = out.probs[i].clone() if a.temperature > 0 else out.tokens[i]
        return out.tokens, out.confidence

    def draft_probs(self, request_ids: list[str], k: int) -> torch.Tensor:
        """``[N, k, V]``: the distributions of each request's first ``k`` pending drafted tokens (one-hot
        at the token for a greedy draft)."""
        vocab = self.draft.model_config.vocab_size
        rows = [self._probs[r][:k] for r in request_ids]
        return torch.stack([
            q.float() if q.is_floating_point() else torch.nn.functional.one_hot(q, vocab).float() for q in rows
        ])

    def observe_step(self, step: Step, hidden: dict[int, torch.Tensor], tokens: dict[str, list[SampledToken]]) -> None:
        """Take the positions ``step`` committed into its speculating sequences' draft contexts (its forward's
        ``hidden`` states; a verifying sequence commits its anchor and the accepted drafts), and start each
        forked sequence's context as a copy of its source's."""
        spans: list[tuple[int, int, int, int]] = []
        forks: list[ScheduledSequence] = []
        flat = 0
        for s in step.sequences:
            n = s.num_tokens
            if s.speculate and n:
                spans.append((s.slot, s.start, flat, len(tokens[s.request_id]) if s.draft_token_ids else n))
            flat += n
            if s.speculate and s.fork is not None:
                forks.append(s)
        if spans:
            self.observe(hidden, Observed.of(spans))
        for s in forks:
            self.fork(s.fork.source_slot, s.slot)

    def draft_step(
        self, step: Step, tokens: dict[str, list[SampledToken]], last: torch.Tensor | None, sampler: Sampler, max_positions: int,
    ) -> dict[str, DraftProposal]:
        """Draft for every sequence of ``step`` that sampled and was asked to draft (``propose``), anchored on its
        last new token (``last``, in sampled order on the device; sampled rows take the noise of the positions
        their drafts will occupy, ``Sampler.noise``). Nothing runs when none was asked."""
        anchors, picked = [], []
        for i, s in enumerate(step.sampled):
            if not (s.speculate and s.propose):
                continue
            position = s.start + (len(tokens[s.request_id]) if s.draft_token_ids else s.num_tokens)
            if position + self.gamma <= max_positions:  # the block's positions stay inside the rotary table
                anchors.append(Anchor(s.request_id, s.slot, position, s.sample.temperature))
                picked.append(i)
        if not anchors:
            return {}
        dev = last.device
        noise = None
        if any(a.temperature > 0 for a in anchors):
            # a seeded sequence drafts with the noise the target will draw each position with: what verification compares
            specs = [step.sampled[i].sample for i in picked for _ in range(self.gamma)]
            positions = [a.position + 1 + j for a in anchors for j in range(self.gamma)]
            vocab = self.draft.model_config.vocab_size
            noise = sampler.noise(specs, positions, vocab, dev).view(len(anchors), self.gamma, vocab)
        draft_tokens, survival = self.propose(anchors, last[torch.tensor(picked, device=dev)], noise)
        toks, surv = draft_tokens.tolist(), survival.float().tolist()
        return {a.request_id: DraftProposal(a.position, tuple(t), tuple(v)) for a, t, v in zip(anchors, toks, surv)}

"""The DSpark proposer: the draft network plus each sequence's draft context, on the device.

A speculating sequence's context is the ring of its last ``dspark_context_window``
committed positions (``DSparkRing``): after every step the verify forward's
hidden states at the draft's target layers, for the positions the step
committed (a prefill chunk's tokens; a decode's anchor and the drafts
verification accepted), become context rows. Rejected positions never reach
the ring. A sequence starting from scratch (or replaying after a prefix hit)
clears its slot's ring first, so the context is recomputed from what it runs.

One batched pass then drafts ``γ`` tokens for every sequence that sampled and
speculates, anchored on the token just sampled. The distributions the drafts
were drawn from stay on the device, keyed by request, until the next step
verifies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model.dspark import DSparkDraft, DSparkRing
from ..sampler import Sampler
from ..step import DraftProposal, SampledToken, Step


@dataclass
class Observed:
    """Positions of one sequence the step committed, and where their rows sit in the forward's tokens."""

    slot: int
    #: first committed position (they are consecutive)
    start: int
    #: rows of the forward's flat tokens holding them
    first_row: int
    count: int


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
        #: request id -> ``[γ, V]`` distributions its pending draft was drawn from (greedy: its ``[γ]`` tokens)
        self._probs: dict[str, torch.Tensor] = {}

    def clear(self, slot: int) -> None:
        self.ring.clear(slot)

    def fork(self, source_slot: int, slot: int) -> None:
        self.ring.copy(source_slot, slot)

    def forget(self, request_id: str) -> None:
        self._probs.pop(request_id, None)

    def observe(self, hidden: dict[int, torch.Tensor], spans: list[Observed]) -> None:
        """Write the committed positions ``spans`` of this forward into their rings (``hidden``: the
        forward's ``[T, D]`` states per target layer)."""
        spans = [s for s in spans if s.count > 0]
        if not spans:
            return
        dev = self.ring.kv.device
        window = self.ring.window
        # only each span's last `window` positions can stay in the ring
        kept = [(s, max(0, s.count - window)) for s in spans]
        rows = np.concatenate([np.arange(s.first_row + skip, s.first_row + s.count) for s, skip in kept])
        pos = np.concatenate([np.arange(s.start + skip, s.start + s.count) for s, skip in kept])
        rows_t = torch.from_numpy(rows).to(dev)
        pos_t = torch.from_numpy(pos).to(dev)
        states = torch.stack([hidden[i] for i in self.target_layers], dim=1)[rows_t]
        ctx = self.draft.context(states)
        kv = self.draft.context_kv(ctx, pos_t)
        at = 0
        for s, skip in kept:
            n = s.count - skip
            self.ring.write(s.slot, pos_t[at : at + n], kv[:, at : at + n])
            at += n

    def propose(self, anchors: list[Anchor], anchor_ids: torch.Tensor, noise: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft for ``anchors`` (their sampled tokens ``anchor_ids`` ``[N]`` on the device):
        ``(tokens [N, γ], survival [N, γ])``. ``noise`` ``[N, γ, V]``: each sampled row's Exp(1) draws."""
        dev = self.ring.kv.device
        slots = [a.slot for a in anchors]
        pos = torch.tensor([a.position for a in anchors], dtype=torch.int64, device=dev)
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

    def after_step(
        self, step: Step, hidden: dict[int, torch.Tensor], tokens: dict[str, list[SampledToken]],
        last: torch.Tensor | None, sampler: Sampler, max_positions: int,
    ) -> dict[str, DraftProposal]:
        """Take the positions ``step`` committed into the draft's context (its forward's ``hidden`` states;
        a verifying sequence commits its anchor and the accepted drafts), then draft for every sequence that
        sampled and speculates, anchored on its last new token (``last``, in sampled order on the device;
        sampled rows draw their noise from their own generators)."""
        spans: list[Observed] = []
        flat = 0
        for s in step.sequences:
            if not s.num_tokens:
                continue
            if s.speculate:
                committed = len(tokens[s.request_id]) if s.draft_token_ids else s.num_tokens
                spans.append(Observed(s.slot, s.start, flat, committed))
            flat += s.num_tokens
        self.observe(hidden, spans)
        anchors, picked = [], []
        for i, s in enumerate(step.sampled):
            if not s.speculate:
                continue
            if s.fork is not None:
                self.fork(s.fork.source_slot, s.slot)
            position = s.start + (len(tokens[s.request_id]) if s.draft_token_ids else s.num_tokens)
            if position + self.gamma <= max_positions:  # the block's positions stay inside the rotary table
                anchors.append(Anchor(s.request_id, s.slot, position, s.sample.temperature))
                picked.append(i)
        if not anchors:
            return {}
        dev = last.device
        noise = None
        if any(a.temperature > 0 for a in anchors):
            noise = torch.ones(len(anchors), self.gamma, self.draft.model_config.vocab_size, device=dev)
            for j, (a, i) in enumerate(zip(anchors, picked)):
                if a.temperature > 0:
                    noise[j].exponential_(generator=sampler.generator_for(a.request_id, step.sampled[i].sample))
        draft_tokens, survival = self.propose(anchors, last[torch.tensor(picked, device=dev)], noise)
        toks, surv = draft_tokens.tolist(), survival.float().tolist()
        return {a.request_id: DraftProposal(a.position, tuple(t), tuple(v)) for a, t, v in zip(anchors, toks, surv)}

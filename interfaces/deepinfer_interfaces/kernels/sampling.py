"""Token sampling: temperature, top-k, top-p, min-p, by the exponential race."""

from __future__ import annotations

import torch

from .base import op


class SamplingOps:
    @op
    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """One token id per row of ``logits`` ``[B, V]``.

        Rows with ``temperature == 0`` take the argmax of the logits. Other rows
        divide by their temperature, keep the ``top_k`` most likely tokens
        (``top_k <= 0`` keeps all), then the smallest set whose renormalised mass
        reaches ``top_p`` (the most likely token always stays), then tokens whose
        probability is at least ``min_p`` times the largest; among survivors the
        token maximising ``p / noise`` wins. ``noise`` is ``[B, V]`` of Exp(1)
        draws that the caller makes with each request's own generator, which makes
        sampling reproducible per request whatever the batch holds, and identical
        across backends given the same noise.
        """
        if logits.shape[0] == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        lf = logits.float()
        greedy = temperature <= 0
        if bool(greedy.all()):
            return lf.argmax(-1)
        t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
        probs = torch.softmax(lf / t[:, None], dim=-1)
        keep = probs >= (min_p.float() * probs.amax(-1))[:, None]
        if bool(((top_k > 0) | (top_p < 1)).any()):
            # top-k and top-p need the tokens in order of probability
            vocab = probs.shape[-1]
            sorted_p, order = probs.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=logits.device)[None, :]
            k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
            keep_sorted = ranks < k[:, None]
            kept = sorted_p * keep_sorted
            mass = kept / kept.sum(-1, keepdim=True)
            before = mass.cumsum(-1) - mass  # mass of strictly more likely survivors
            keep_sorted &= before < top_p.float()[:, None]
            keep_sorted[:, 0] = True
            keep &= torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        race = torch.where(keep, probs / noise.float(), torch.full_like(probs, -1.0))
        return torch.where(greedy, lf.argmax(-1), race.argmax(-1))

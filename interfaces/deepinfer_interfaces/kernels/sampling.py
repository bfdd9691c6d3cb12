"""Token sampling: temperature, top-k, top-p, min-p, by the exponential race; the filtered distribution
itself; and lossless verification of drafted tokens by rejection sampling."""

from __future__ import annotations

import torch

from .base import op


class SamplingOps:
    @op(rows=("logits", "temperature", "top_k", "top_p", "min_p", "noise"))
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

        Rows with ``temperature == 0`` take the argmax of the logits (the lowest
        token id among equal maxima). Other rows
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
        probs, keep = _filtered(lf, temperature, top_k, top_p, min_p)
        race = torch.where(keep, probs / noise.float(), torch.full_like(probs, -1.0))
        return torch.where(greedy, lf.argmax(-1), race.argmax(-1))

    @op(rows=("logits", "temperature", "top_k", "top_p", "min_p"))
    def sampling_probs(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
    ) -> torch.Tensor:
        """``[B, V]`` fp32: the distribution ``sample`` draws each row from — the temperature-scaled
        softmax restricted to the tokens top-k, top-p and min-p keep, renormalised; a one-hot argmax
        for ``temperature == 0`` (at the lowest token id among equal maxima). What rejection sampling
        compares drafted tokens against."""
        lf = logits.float()
        if lf.shape[0] == 0:
            return torch.empty_like(lf)
        probs, keep = _filtered(lf, temperature, top_k, top_p, min_p)
        kept = torch.where(keep, probs, torch.zeros_like(probs))
        kept = kept / kept.sum(-1, keepdim=True)
        onehot = torch.zeros_like(lf).scatter_(-1, lf.argmax(-1, keepdim=True), 1.0)
        return torch.where((temperature <= 0)[:, None], onehot, kept)

    @op
    def rejection_sample(
        self,
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor,
        draft_tokens: torch.Tensor,
        num_drafts: torch.Tensor,
        uniform: torch.Tensor,
        noise: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify drafted tokens losslessly: ``(accepted [N], tokens [N, K + 1])``.

        Row ``n`` drafted ``num_drafts[n] <= K`` tokens ``draft_tokens[n, :num_drafts[n]]``, token ``j``
        drawn from ``draft_probs[n, j]`` ``[V]``; ``target_probs[n, j]`` is the target's distribution
        at the position of draft ``j`` (``j = num_drafts[n]``: after the last one). Draft ``j`` is
        accepted when ``uniform[n, j] < p(d) / q(d)`` and every earlier one was; the first rejected
        position draws from ``max(p − q, 0)`` renormalised, and when every draft is accepted a bonus
        token is drawn from ``p`` at ``num_drafts[n]``; both draws take the token maximising
        ``probability / noise[n, j]`` (``noise`` ``[N, K + 1, V]`` of Exp(1), as ``sample`` does). So
        the emitted tokens follow the target's distribution whatever the draft's. One-hot ``p`` and
        ``q`` (greedy target and draft) accept while the draft equals the target's argmax and then
        emit the argmax. ``tokens[n, :accepted[n]]`` are the accepted drafts, ``tokens[n, accepted[n]]``
        the drawn token, the rest ``-1``. No host sync.
        """
        n, k = draft_tokens.shape
        dev = target_probs.device
        if n == 0:
            return torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, k + 1, dtype=torch.int64, device=dev)
        p, q = target_probs.float(), draft_probs.float()
        cols = torch.arange(k, device=dev)[None, :]
        safe = draft_tokens.clamp(min=0)
        p_d = p[:, :k].gather(-1, safe[..., None])[..., 0]
        q_d = q.gather(-1, safe[..., None])[..., 0]
        ok = (uniform.float() * q_d < p_d) & (cols < num_drafts[:, None])
        accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(1)
        at = accepted[:, None, None]
        p_at = p.gather(1, at.expand(n, 1, p.shape[-1]))[:, 0]
        q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # no draft after the last one: plain p
        q_at = q_pad.gather(1, at.expand(n, 1, q.shape[-1]))[:, 0]
        residual = (p_at - q_at).clamp(min=0)
        rejected = accepted < num_drafts
        dist = torch.where(rejected[:, None], residual, p_at)
        dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, p_at)  # p == q exactly: nothing left to correct
        noise_at = noise.float().gather(1, at.expand(n, 1, noise.shape[-1]))[:, 0]
        drawn = torch.where(dist > 0, dist / noise_at, torch.full_like(dist, -1.0)).argmax(-1)
        out_cols = torch.arange(k + 1, device=dev)[None, :]
        padded = torch.cat([draft_tokens, torch.full_like(draft_tokens[:, :1], -1)], dim=1)
        tokens = torch.where(out_cols < accepted[:, None], padded, torch.full_like(padded, -1))
        tokens = torch.where(out_cols == accepted[:, None], drawn[:, None], tokens)
        return accepted, tokens


def _filtered(
    lf: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The temperature-scaled softmax ``[B, V]`` and which tokens top-k, top-p and min-p keep."""
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    probs = torch.softmax(lf / t[:, None], dim=-1)
    keep = probs >= (min_p.float() * probs.amax(-1))[:, None]
    if bool(((top_k > 0) | (top_p < 1)).any()):
        # top-k and top-p need the tokens in order of probability
        vocab = probs.shape[-1]
        sorted_p, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=lf.device)[None, :]
        k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
        keep_sorted = ranks < k[:, None]
        kept = sorted_p * keep_sorted
        mass = kept / kept.sum(-1, keepdim=True)
        before = mass.cumsum(-1) - mass  # mass of strictly more likely survivors
        keep_sorted &= before < top_p.float()[:, None]
        keep_sorted[:, 0] = True
        keep &= torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return probs, keep

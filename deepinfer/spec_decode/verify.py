"""Lossless verification of drafted tokens: rejection sampling, or coupled verification for seeded requests.

An unseeded sampled sequence keeps a draft with probability ``min(1, p / q)`` (rejection sampling: the
higher acceptance). A seeded one is verified *coupled*: at each drafted position the target draws its
own token with the request's counter-based noise for that position, exactly as plain sampling would,
and a draft is kept while it equals that token. The emitted tokens are then the ones non-speculative
sampling with the same seed gives, whatever was drafted, how much, or when. Greedy sequences keep
drafts while they equal the argmax (both rules agree there).
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from ..sampler import Sampler, sampling_params_tensors
from ..step import ScheduledSequence
from .proposer import DSparkProposer


def verify_drafts(
    kernels: Kernels, sampler: Sampler, proposer: DSparkProposer, seqs: list[ScheduledSequence], logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [N], tokens [N, K + 1])`` for sequences whose drafts ``K`` wide (fewer for some) were
    computed: ``logits`` ``[N, K + 1, V]`` holds the target's logits (grammar masks applied) at each
    sequence's anchor and after each of its drafts. ``tokens[n, :accepted[n]]`` are the kept drafts,
    ``tokens[n, accepted[n]]`` the token drawn after them, the rest ``-1``."""
    n, width, vocab = logits.shape
    k = width - 1
    dev = logits.device
    specs = [s.sample for s in seqs]
    # the position each row of a sequence draws for: its sample's, then one further per draft
    positions = [[s.start + len(s.token_ids) + j for j in range(width)] for s in seqs]
    flat_specs = [spec for spec in specs for _ in range(width)]
    temperature, top_k, top_p, min_p = sampling_params_tensors(flat_specs, dev)
    drafts = torch.tensor([s.draft_token_ids + [-1] * (k - len(s.draft_token_ids)) for s in seqs], dtype=torch.int64, device=dev)
    num = torch.tensor([len(s.draft_token_ids) for s in seqs], dtype=torch.int64, device=dev)
    if all(spec.greedy for spec in specs):  # one-hot distributions ignore the noise: a broadcast view of ones
        noise = torch.ones((), device=dev).expand(n, width, vocab)
    else:
        noise = sampler.noise(flat_specs, [p for row in positions for p in row], vocab, dev).view(n, width, vocab)
    params = (temperature, top_k, top_p, min_p)
    accepted = torch.zeros(n, dtype=torch.int64, device=dev)
    tokens = torch.full((n, width), -1, dtype=torch.int64, device=dev)
    coupled = [i for i, spec in enumerate(specs) if not spec.greedy and spec.seed is not None]
    rest = sorted(set(range(n)) - set(coupled))
    if rest:  # greedy and unseeded sequences: rejection sampling against the target's distributions
        rows = torch.tensor(rest, dtype=torch.int64, device=dev)
        whole = len(rest) == n  # keep the broadcast noise of an all-greedy batch a view
        target = kernels.sampling_probs(logits[rows].reshape(-1, vocab), *_rows(rows, width, *params)).view(len(rest), width, vocab)
        q = proposer.draft_probs([seqs[i].request_id for i in rest], k)
        uniform = sampler.uniforms([specs[i] for i in rest], [positions[i][:k] for i in rest], dev)
        accepted[rows], tokens[rows] = kernels.rejection_sample(target, q, drafts[rows], num[rows], uniform,
                                                                noise if whole else noise[rows])
    if coupled:  # seeded sequences: a draft is kept while it equals the target's own draw at its position
        rows = torch.tensor(coupled, dtype=torch.int64, device=dev)
        own = kernels.sample(logits[rows].reshape(-1, vocab), *_rows(rows, width, *params),
                             noise[rows].reshape(-1, vocab)).view(len(coupled), width)
        kept = (own[:, :k] == drafts[rows]) & (torch.arange(k, device=dev)[None, :] < num[rows][:, None])
        agreed = kept.to(torch.int64).cumprod(-1).sum(-1)
        upto = torch.arange(width, device=dev)[None, :] <= agreed[:, None]
        accepted[rows] = agreed
        tokens[rows] = torch.where(upto, own, torch.full_like(own, -1))
    return accepted, tokens


def _rows(rows: torch.Tensor, width: int, *params: torch.Tensor) -> list[torch.Tensor]:
    """Each per-(sequence, slot) parameter ``[N * width]`` restricted to the sequences ``rows``."""
    return [p.view(-1, width)[rows].reshape(-1) for p in params]

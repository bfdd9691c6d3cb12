"""Lossless verification of drafted tokens: the target's sampling distributions against the draft's."""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from ..sampler import Sampler
from ..step import ScheduledSequence
from .proposer import DSparkProposer


def verify_drafts(
    kernels: Kernels, sampler: Sampler, proposer: DSparkProposer, seqs: list[ScheduledSequence], logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [N], tokens [N, K + 1])`` for sequences whose drafts ``K`` wide (fewer for some) were
    computed: ``logits`` ``[N, K + 1, V]`` holds the target's logits (grammar masks applied) at each
    sequence's anchor and after each of its drafts. Greedy sequences keep drafts while they equal the
    argmax; sampled ones go through rejection sampling (``Kernels.rejection_sample``) with draws from
    their own generators: uniforms for acceptance, Exp(1) noise for the token drawn at the end."""
    n, width, vocab = logits.shape
    k = width - 1
    dev = logits.device
    params = torch.tensor([[s.sample.temperature, s.sample.top_k, s.sample.top_p, s.sample.min_p] for s in seqs], dtype=torch.float64)
    rep = params.to(dev).repeat_interleave(width, dim=0)
    target = kernels.sampling_probs(
        logits.reshape(n * width, vocab), rep[:, 0].float(), rep[:, 1].to(torch.int64), rep[:, 2].float(), rep[:, 3].float()
    ).view(n, width, vocab)
    drafts = torch.tensor([s.draft_token_ids + [-1] * (k - len(s.draft_token_ids)) for s in seqs], dtype=torch.int64, device=dev)
    num = torch.tensor([len(s.draft_token_ids) for s in seqs], dtype=torch.int64, device=dev)
    q = proposer.draft_probs([s.request_id for s in seqs], k)
    uniform = torch.zeros(n, k, device=dev)
    if all(s.sample.greedy for s in seqs):  # one-hot distributions ignore the noise: a broadcast view of ones
        noise = torch.ones((), device=dev).expand(n, width, vocab)
    else:
        noise = torch.ones(n, width, vocab, device=dev)
    for i, s in enumerate(seqs):
        if not s.sample.greedy:
            gen = sampler.generator_for(s.request_id, s.sample)
            uniform[i] = torch.rand(k, generator=gen, device=dev)
            noise[i].exponential_(generator=gen)
    return kernels.rejection_sample(target, q, drafts, num, uniform, noise)

"""From logits to tokens: log-probabilities, grammar masks, and the backend's sampling kernel.

Log-probabilities come from the full-precision logits before any constraint.
A sequence with a seed takes its exponential noise from ``sampling_noise``: a
pure function of its seed and the position of the token drawn, so its tokens
depend neither on what else is in the batch nor on what was drafted, verified
or preempted before. Unseeded sequences share the engine's generator.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Device, Kernels

from .outputs import Logprob, PositionLogprobs
from .sampling_noise import noise_key, position_exponentials
from .step import LogprobRow, SampleSpec


def top_logprobs(logits: torch.Tensor, k: int, chosen: torch.Tensor) -> list[LogprobRow]:
    """Per row: the ``k`` most likely tokens and the chosen one, as id -> (logprob, rank); rank 1 is the argmax."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logp.gather(-1, chosen[:, None])
    ranks = (logp > chosen_lp).sum(-1) + 1
    top_v, top_i = logp.topk(min(k, logp.shape[-1]), dim=-1)
    top_v, top_i, chosen_l, chosen_lp_l, ranks_l = top_v.tolist(), top_i.tolist(), chosen.tolist(), chosen_lp[:, 0].tolist(), ranks.tolist()
    out = []
    for r in range(logits.shape[0]):
        row = {int(i): (float(v), j + 1) for j, (v, i) in enumerate(zip(top_v[r], top_i[r]))}
        row[int(chosen_l[r])] = (float(chosen_lp_l[r]), int(ranks_l[r]))
        out.append(row)
    return out


def to_logprobs(rows: list[LogprobRow], decode) -> list[PositionLogprobs]:
    return [{tid: Logprob(lp, rank, decode(tid)) for tid, (lp, rank) in row.items()} for row in rows]


class Sampler:
    """Draws tokens with the backend's sampling kernel, and the noise every draw (plain, drafted, verified) uses."""

    def __init__(self, kernels: Kernels, device: Device, seed: int) -> None:
        self.kernels = kernels
        self.device = device
        #: unseeded requests' draws, in the order the engine makes them
        self.generator = device.generator(seed)

    def noise(self, specs: list[SampleSpec], positions: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        """Exp(1) noise ``[len(specs), vocab]``, row ``i`` for the token at ``positions[i]`` drawn by ``specs[i]``:
        a seeded spec's is its counter-based noise at that position (``sampling_noise``), an unseeded one's
        the shared generator's next draws, a greedy one's ones (ignored)."""
        out = torch.ones(len(specs), vocab, dtype=torch.float32, device=device)
        seeded = [i for i, s in enumerate(specs) if not s.greedy and s.seed is not None]
        if seeded:
            keys = torch.tensor([noise_key(specs[i].seed) for i in seeded], dtype=torch.int64)
            at = torch.tensor([positions[i] for i in seeded], dtype=torch.int64)
            out[torch.tensor(seeded, device=device)] = position_exponentials(keys.to(device), at.to(device), vocab)
        for i, s in enumerate(specs):
            if not s.greedy and s.seed is None:
                out[i].exponential_(generator=self.generator)
        return out

    def uniforms(self, specs: list[SampleSpec], positions: list[list[int]], device: torch.device) -> torch.Tensor:
        """Uniforms ``[len(specs), k]`` for rejection sampling (``k`` = the longest ``positions`` row): the
        shared generator's for unseeded specs, zeros for the rest (greedy and seeded rows do not use them)."""
        k = max((len(p) for p in positions), default=0)
        out = torch.zeros(len(specs), k, device=device)
        for i, s in enumerate(specs):
            if not s.greedy and s.seed is None:
                out[i] = torch.rand(k, generator=self.generator, device=device)
        return out

    def sample(
        self,
        logits: torch.Tensor,
        specs: list[SampleSpec],
        positions: list[int],
        bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> torch.Tensor:
        """One token per row of ``logits`` (``[B, V]``, row ``i`` drawn by ``specs[i]`` for position ``positions[i]``).

        ``bitmask`` = (``[len(rows), words]`` grammar masks, the rows they constrain);
        unconstrained rows are not touched.
        """
        dev = logits.device
        b, vocab = logits.shape
        if b == 0:
            return torch.empty(0, dtype=torch.int64, device=dev)
        if bitmask is not None and bitmask[1]:
            mask, rows = bitmask
            idx = torch.tensor(rows, dtype=torch.int64, device=dev)
            logits = logits.clone()
            logits[idx] = self.kernels.apply_token_bitmask(logits[idx], mask)
        temperature, top_k, top_p, min_p = sampling_params_tensors(specs, dev)
        if all(s.greedy for s in specs):
            # greedy rows ignore the noise: a broadcast view, no [B, V] allocation per step
            noise = torch.ones((), dtype=torch.float32, device=dev).expand(b, vocab)
        else:
            noise = self.noise(specs, positions, vocab, dev)
        return self.kernels.sample(logits, temperature, top_k, top_p, min_p, noise)


def sampling_params_tensors(specs: list[SampleSpec], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(temperature, top_k, top_p, min_p)`` ``[B]`` tensors of ``specs`` on ``device`` (one copy)."""
    params = torch.tensor([[s.temperature, s.top_k, s.top_p, s.min_p] for s in specs], dtype=torch.float64).to(device)
    return params[:, 0].float(), params[:, 1].to(torch.int64), params[:, 2].float(), params[:, 3].float()

"""From logits to tokens: log-probabilities, grammar masks, and the backend's sampling kernel.

Log-probabilities come from the full-precision logits before any constraint.
A sequence with a seed draws its exponential noise from its own generator,
which the sampler owns (created on its first draw, dropped when its request
finishes), so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Device, Kernels

from .outputs import Logprob, PositionLogprobs
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
    def __init__(self, kernels: Kernels, device: Device, seed: int) -> None:
        self.kernels = kernels
        self.device = device
        self.generator = device.generator(seed)
        self._generators: dict[str, torch.Generator] = {}

    def generator_for(self, request_id: str, spec: SampleSpec) -> torch.Generator:
        """The generator ``request_id``'s draws use: its own when it has a seed, else the shared one."""
        if spec.seed is None:
            return self.generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = self.device.generator(spec.seed)
        return gen

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._generators.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,
        specs: list[SampleSpec],
        request_ids: list[str],
        bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> torch.Tensor:
        """One token per row of ``logits`` (``[B, V]``, row ``i`` drawn for ``request_ids[i]`` by ``specs[i]``).

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
        params = torch.tensor([[s.temperature, s.top_k, s.top_p, s.min_p] for s in specs], dtype=torch.float64).to(dev)
        temperature, top_p, min_p = params[:, 0].float(), params[:, 2].float(), params[:, 3].float()
        top_k = params[:, 1].to(torch.int64)
        if all(s.greedy for s in specs):
            # greedy rows ignore the noise: a broadcast view, no [B, V] allocation per step
            noise = torch.ones((), dtype=torch.float32, device=dev).expand(b, vocab)
        else:
            noise = torch.ones(b, vocab, dtype=torch.float32, device=dev)
            for i, (rid, s) in enumerate(zip(request_ids, specs)):
                if not s.greedy:
                    noise[i].exponential_(generator=self.generator_for(rid, s))
        return self.kernels.sample(logits, temperature, top_k, top_p, min_p, noise)

"""From logits to tokens: log-probabilities, grammar masks, and the backend's sampling kernel.

Log-probabilities come from the full-precision logits before any constraint.
Each request draws its exponential noise from its own generator when it has a
seed, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Device, Kernels

from .outputs import Logprob, PositionLogprobs
from .request import Request


def top_logprobs(logits: torch.Tensor, k: int, chosen: torch.Tensor) -> list[dict[int, tuple[float, int]]]:
    """Per row: the ``k`` most likely tokens and the chosen one, as id -> (logprob, rank); rank 1 is the argmax."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logp.gather(-1, chosen[:, None])
    ranks = (logp > chosen_lp).sum(-1) + 1
    top_v, top_i = logp.topk(min(k, logp.shape[-1]), dim=-1)
    out = []
    for r in range(logits.shape[0]):
        row = {int(i): (float(v), j + 1) for j, (v, i) in enumerate(zip(top_v[r].tolist(), top_i[r].tolist()))}
        row[int(chosen[r])] = (float(chosen_lp[r]), int(ranks[r]))
        out.append(row)
    return out


def to_logprobs(rows: list[dict[int, tuple[float, int]]], decode) -> list[PositionLogprobs]:
    return [{tid: Logprob(lp, rank, decode(tid)) for tid, (lp, rank) in row.items()} for row in rows]


class Sampler:
    def __init__(self, kernels: Kernels, device: Device, seed: int) -> None:
        self.kernels = kernels
        self.device = device
        self.generator = device.generator(seed)

    def _generator(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        gen = req.state.get("generator")
        if gen is None:
            gen = req.state["generator"] = self.device.generator(req.params.seed)
        return gen

    def sample(
        self, logits: torch.Tensor, reqs: list[Request], bitmask: tuple[torch.Tensor, list[int]] | None = None
    ) -> torch.Tensor:
        """One token per row of ``logits`` (``[B, V]``, one row per request in ``reqs``).

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
        p = [r.params for r in reqs]
        temperature = torch.tensor([x.temperature for x in p], dtype=torch.float32, device=dev)
        top_k = torch.tensor([x.top_k for x in p], dtype=torch.int64, device=dev)
        top_p = torch.tensor([x.top_p for x in p], dtype=torch.float32, device=dev)
        min_p = torch.tensor([x.min_p for x in p], dtype=torch.float32, device=dev)
        if all(r.params.greedy for r in reqs):
            # greedy rows ignore the noise: a broadcast view, no [B, V] allocation per step
            noise = torch.ones((), dtype=torch.float32, device=dev).expand(b, vocab)
        else:
            noise = torch.ones(b, vocab, dtype=torch.float32, device=dev)
            for i, r in enumerate(reqs):
                if not r.params.greedy:
                    noise[i].exponential_(generator=self._generator(r))
        return self.kernels.sample(logits, temperature, top_k, top_p, min_p, noise)

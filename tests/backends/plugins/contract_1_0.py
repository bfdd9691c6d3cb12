"""A backend plugin written for contract 1.0, the oldest minor version the engine honours.

Its kernels are what a vendor wrote before packed KV pools existed: plain-tensor
code that indexes the pools it is handed (``index_copy_``, ``pool[rows]``). The
engine must never hand it a ``PackedPool`` nor a call from a later feature; the
bundle's device (the CPU's) must not be asked for ``map_host`` (1.6) either.
The tests install this module as a plugin; it imports nothing from the tests.
``CALLS`` counts the calls that reached this set's own code, by op and by the
type of pool it was handed.
"""

from __future__ import annotations

from collections import Counter

import torch

from deepinfer_interfaces import Backend, Kernels


#: (op, type name of its pool argument) -> calls that reached this set's own code
CALLS: Counter = Counter()


class Contract10Kernels(Kernels):
    """Plain-tensor overrides of 1.0 ops: the cache write, sparse attention, the indexer's scores, RMSNorm."""

    name = "contract-1-0"
    interface_version = "1.0"

    def cache_write(self, pool, slots, values):
        CALLS["cache_write", type(pool).__name__] += 1
        kept = (slots >= 0).nonzero().squeeze(1)
        pool.index_copy_(0, slots[kept], values[kept].to(pool.dtype))

    def sparse_attention(self, q, kv, indices, sinks, scale):
        CALLS["sparse_attention", type(kv).__name__] += 1
        t, h, d = q.shape
        if t == 0 or indices.shape[1] == 0:
            return q.new_zeros(t, h, d)
        rows = kv[indices.clamp(min=0)].float()  # [T, K, D]
        scores = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
        scores = scores.masked_fill((indices < 0)[:, None, :], float("-inf"))
        sink = sinks.float()[None, :, None].expand(t, h, 1)
        top = torch.maximum(scores.amax(-1, keepdim=True), sink)
        weights = torch.exp(scores - top)
        denom = weights.sum(-1, keepdim=True) + torch.exp(sink - top)
        return (torch.einsum("thk,tkd->thd", weights, rows) / denom).to(q.dtype)

    def indexer_scores(self, q, weights, keys, indices, scale):
        CALLS["indexer_scores", type(keys).__name__] += 1
        t, k = indices.shape
        if t == 0 or k == 0:
            return torch.empty(t, k, dtype=torch.float32, device=q.device)
        rows = keys[indices.clamp(min=0)].float()
        dots = torch.relu(torch.einsum("thd,tkd->thk", q.float(), rows))
        scores = torch.einsum("thk,th->tk", dots, weights.float()) * scale
        return scores.masked_fill(indices < 0, float("-inf"))

    def rms_norm(self, x, weight, eps):
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        return (y if weight is None else y * weight.float()).to(x.dtype)


class Contract10Backend(Backend):
    """The CPU device and torch.distributed with the 1.0 kernel set."""

    name = "contract-1-0"
    interface_version = "1.0"
    device = "cpu"
    communicator = "torch-distributed"
    kernels = "contract-1-0"
    priority = -100

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        return True, None

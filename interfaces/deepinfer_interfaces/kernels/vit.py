"""Attention of a vision transformer: bidirectional within each image of a batch packed into one sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import acc_dtype, op


class VitOps:
    @op
    def vit_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Multi-head attention within segments of a packed sequence (no mask inside a segment).

        ``q``, ``k``, ``v`` ``[T, H, D]`` hold the tokens of ``n`` segments (the
        patches of ``n`` images) one after another; ``cu_seqlens`` ``[n + 1]``
        (int32 or int64) are their boundaries, ``0 = cu[0] ≤ cu[1] ≤ … ≤ cu[n] = T``.
        For a token ``t`` of segment ``i`` (``cu[i] ≤ t < cu[i+1]``) and head ``h``::

            s_j = scale · q[t,h] · k[j,h]          for every j with cu[i] ≤ j < cu[i+1]
            out[t,h] = Σ_j softmax(s)_j · v[j,h]

        No token sees another segment's; an empty segment is allowed and holds no
        token. Computed in fp32 (fp64 for fp64 inputs); returned ``[T, H, D]`` in
        ``q.dtype``.

        Each segment runs through ``scaled_dot_product_attention`` in the
        accumulation dtype (its CPU and GPU kernels walk the keys in blocks, so no
        score matrix of a whole image is held). The segment lengths are read on the
        host (a backend's kernel reads them where they live).
        """
        t, h, d = q.shape
        out = torch.empty(t, h, v.shape[-1], dtype=q.dtype, device=q.device)
        if t == 0:
            return out
        acc = acc_dtype(q)
        bounds = [int(b) for b in cu_seqlens.tolist()]
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            qs, ks, vs = (x[start:end].to(acc).transpose(0, 1) for x in (q, k, v))  # [H, L, D]
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1).to(q.dtype)
        return out

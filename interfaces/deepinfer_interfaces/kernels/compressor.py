"""The KV compressor: gated softmax pooling of a window of per-token projections."""

from __future__ import annotations

import torch

from .tiles import take_rows
from .base import acc_dtype, op


class CompressorOps:
    @op(rows=("indices", "prev_indices"))
    def compress_kv(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        position_bias: torch.Tensor,
        indices: torch.Tensor,
        prev_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pool one window of ``m`` source tokens into one compressed entry per row.

        ``kv`` and ``gate`` are ``[N, C]`` pools of per-token projections,
        ``position_bias`` ``[m, C]`` a learned bias per slot of the window, and
        ``indices`` ``[E, m]`` the pool rows of each entry's window (``-1`` =
        absent token). Per channel ``c``, with ``z_j = gate[i_j, c] + bias[j, c]``::

            out[e, c] = Σ_j softmax_j(z_j) · kv[i_j, c]        (valid j only)

        With ``prev_indices`` ``[E, m]`` (overlapping windows, compressed sparse
        attention) each token carries two series in ``C = 2d`` channels and the
        softmax runs over ``2m`` slots per output channel ``c < d``: the previous
        window's rows contribute channel ``c`` with ``bias[j, c]``, the current
        window's rows channel ``d + c`` with ``bias[j, d + c]``. Output is ``[E, d]``.

        A row with no valid slot is zeros. Computed in fp32 (fp64 for fp64
        inputs), returned in ``kv.dtype``.
        """
        acc = acc_dtype(kv)
        c = kv.shape[-1]
        bias = position_bias.to(acc)
        # absent slots get zero weight below, so their (finite) gathered rows never count
        cur_kv = take_rows(kv, indices).to(acc)  # [E, m, C]
        cur_gate = take_rows(gate, indices).to(acc) + bias
        cur_valid = (indices >= 0)[..., None]
        if prev_indices is None:
            vals, logits, valid = cur_kv, cur_gate, cur_valid.expand_as(cur_kv)
        else:
            d = c // 2
            prev_kv = take_rows(kv, prev_indices).to(acc)[..., :d]
            prev_gate = take_rows(gate, prev_indices).to(acc)[..., :d] + bias[:, :d]
            vals = torch.cat([prev_kv, cur_kv[..., d:]], dim=1)
            logits = torch.cat([prev_gate, cur_gate[..., d:]], dim=1)
            valid = torch.cat([(prev_indices >= 0)[..., None].expand_as(prev_kv), cur_valid.expand_as(prev_kv)], dim=1)
        if vals.shape[0] == 0:
            return kv.new_zeros(0, vals.shape[-1])
        logits = logits.masked_fill(~valid, float("-inf"))
        top = logits.amax(dim=1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = torch.exp(logits - top)
        denom = w.sum(dim=1)
        pooled = (w * vals).sum(dim=1) / torch.where(denom > 0, denom, torch.ones_like(denom))
        return pooled.to(kv.dtype)

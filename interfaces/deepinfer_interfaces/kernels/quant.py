"""Linears and experts over block-scaled quantized weights (FP8 e4m3, FP4 e2m1), as checkpoints store them.

The references dequantize a bounded slice of the weight at a time (a tile of
output rows, a chunk of experts), so memory stays near one slice whatever the
model size; a backend decodes inside its GEMM instead.
"""

from __future__ import annotations

import torch

from ..quant import QuantizedWeight
from .base import acc_dtype, op
from .invariant import matmul_rows
from .moe import expert_mlp

#: elements of weight one reference step dequantizes at most
_TILE_ELEMENTS = 1 << 24


class QuantOps:
    @op(rows=("x",))
    def fp8_linear(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """``x @ Wᵀ`` for a block-scaled weight ``W`` ``[N, K]`` (see ``QuantizedWeight``).

        ``x`` is ``[T, K]``. The product is that of ``x`` with the dequantized
        weight, accumulated in fp32 (fp64 for fp64 x) and returned ``[T, N]`` in
        ``x.dtype``. A backend may quantize ``x`` on the fly (per token, in
        groups of the weight's block columns, as FP8 GEMMs do); the op spec's
        tolerance allows for that.
        """
        acc = acc_dtype(x)
        n, k = weight.shape
        if x.shape[0] == 0 or n == 0:
            return x.new_zeros(x.shape[0], n)
        xf = x.to(acc)
        bn = weight.block[0]
        step = max(bn, (_TILE_ELEMENTS // max(k, 1)) // bn * bn)
        parts = [matmul_rows(xf, weight.rows(r, min(r + step, n)).dequantize(acc).t(), self.batch_invariant)
                 for r in range(0, n, step)]
        return torch.cat(parts, dim=-1).to(x.dtype) if len(parts) > 1 else parts[0].to(x.dtype)

    @op(rows=("x", "topk_ids", "topk_weights"))
    def moe_experts_quantized(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: QuantizedWeight,
        w2: QuantizedWeight,
        limit: float | None,
    ) -> torch.Tensor:
        """``moe_experts`` over quantized expert weights.

        ``w13`` is a stacked ``[E, 2I, D]`` weight (each expert's gate rows, then
        its up rows) and ``w2`` ``[E, D, I]``, FP4 (e2m1, 1 × 32 blocks in
        DeepSeek-V4) or FP8 (e4m3); everything else, including the skipped ids,
        as in ``moe_experts``. Computed in fp32 (fp64 for fp64 x) with the
        dequantized weights, returned in ``x.dtype``.
        """
        acc = acc_dtype(x)
        fetch = lambda w, index: w.map(lambda t: t[index]).dequantize(acc)  # noqa: E731
        return expert_mlp(x, topk_ids, topk_weights, w13, w2, limit, fetch, self.batch_invariant)

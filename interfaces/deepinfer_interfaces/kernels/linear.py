"""Dense linear maps: the op every dense matmul of a model goes through, so batch-invariant mode reaches them."""

from __future__ import annotations

import torch

from .base import op
from .invariant import matmul_rows


class LinearOps:
    batch_invariant: bool

    @op(rows=("x",))
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weightᵀ`` for ``x`` ``[..., K]`` and a dense ``weight`` ``[N, K]``, in ``x.dtype``.

        The product torch computes for the operands' dtype (its usual
        accumulation); in batch-invariant mode the rows run in fixed-shape
        tiles (``invariant.row_tiled_matmul``). A model's projections and LM
        heads go through here.
        """
        return matmul_rows(x, weight.t(), self.batch_invariant)

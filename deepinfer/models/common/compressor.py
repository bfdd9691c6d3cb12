"""The KV compressor of CSA / HCA layers (and of the lightning indexer)."""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from .linear import ProjectionPart, QuantPlan
from .metadata import LayerMeta
from .params import ParamTree


class Compressor(ParamTree):
    """Pools every window of ``ratio`` tokens into one normalised, rotated entry.

    Each token's projections (``wkv``, ``wgate``) are stored in the cache's
    state pool; for each window the step completes, the window is pooled
    (``compress_kv``, with the learned per-slot bias ``ape``), then the entry
    is RMS-normed and rotated at its window's first position and written into
    the output pool. With ``overlap`` each entry also pools the previous window
    (width 2·ratio). ``wkv`` and ``wgate`` read the layer's input: they are
    rows of the owner's fused input projection (``projection_parts``).
    """

    def __init__(
        self, head_dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype, device, plan: QuantPlan, role: str
    ) -> None:
        super().__init__(device)
        self.plan, self.role = plan, role
        self.width = head_dim * (2 if overlap else 1)
        self.overlap = overlap
        self.eps = eps
        self.ape = self.param("ape", (ratio, self.width), torch.float32)
        self.norm = self.param("norm.weight", (head_dim,), torch.float32)

    def projection_parts(self) -> list[ProjectionPart]:
        """The two input projections, for the owner's ``FusedProjection``."""
        return [
            ProjectionPart(self, "wkv", self.width, self.plan.storage(f"{self.role}.wkv")),
            ProjectionPart(self, "wgate", self.width, self.plan.storage(f"{self.role}.wgate")),
        ]

    def __call__(
        self,
        k: Kernels,
        kv: torch.Tensor,
        gate: torch.Tensor,
        meta: LayerMeta,
        state: tuple[torch.Tensor, torch.Tensor],
        out_pool: torch.Tensor,
        out_slots: torch.Tensor,
        rotate: bool = False,
    ) -> None:
        """``kv`` / ``gate`` ``[T, width]``: this step's tokens' projections; ``rotate``: the entries are
        Walsh–Hadamard-rotated before the cache rounds them (V4's indexer keys as trained)."""
        state_kv, state_gate = state
        k.cache_write(state_kv, meta.state_write, kv)
        k.cache_write(state_gate, meta.state_write, gate)
        prev = meta.emit_prev_rows if self.overlap else None
        pooled = k.compress_kv(state_kv, state_gate, self.ape, meta.emit_rows, prev)  # in the state's dtype
        entry = k.rope(k.rms_norm(pooled, self.norm, self.eps).to(kv.dtype), meta.entry_cos, meta.entry_sin)
        k.cache_write(out_pool, out_slots, k.hadamard(entry) if rotate else entry)

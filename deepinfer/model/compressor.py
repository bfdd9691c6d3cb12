"""The KV compressor of CSA / HCA layers (and of the lightning indexer)."""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from .metadata import LayerMeta
from .params import ParamTree


class Compressor(ParamTree):
    """Pools every window of ``ratio`` tokens into one normalised, rotated entry.

    Each token's projections (``wkv``, ``wgate``) are stored in the cache's
    state pool; the token that closes a window pools it (``compress_kv``,
    with the learned per-slot bias ``ape``), then RMS-norms and rotates the
    entry at its window's first position and writes it into the output pool.
    With ``overlap`` each entry also pools the previous window (width 2·ratio).
    """

    def __init__(self, hidden: int, head_dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype, device) -> None:
        super().__init__(device)
        width = head_dim * (2 if overlap else 1)
        self.overlap = overlap
        self.eps = eps
        self.wkv = self.param("wkv.weight", (width, hidden), dtype)
        self.wgate = self.param("wgate.weight", (width, hidden), dtype)
        self.ape = self.param("ape", (ratio, width), torch.float32)
        self.norm = self.param("norm.weight", (head_dim,), torch.float32)

    def __call__(
        self,
        k: Kernels,
        x: torch.Tensor,
        meta: LayerMeta,
        state: tuple[torch.Tensor, torch.Tensor],
        out_pool: torch.Tensor,
        out_slots: torch.Tensor,
    ) -> None:
        state_kv, state_gate = state
        k.cache_write(state_kv, meta.state_write, x @ self.wkv.t())
        k.cache_write(state_gate, meta.state_write, x @ self.wgate.t())
        prev = meta.emit_prev_rows if self.overlap else None
        pooled = k.compress_kv(state_kv, state_gate, self.ape, meta.emit_rows, prev)
        entry = k.rope(k.rms_norm(pooled, self.norm, self.eps), meta.entry_cos, meta.entry_sin)
        k.cache_write(out_pool, out_slots, entry)

"""Per-step metadata shared by every layer of one layer type, derived on the device from the step's inputs.

Only rotary angles and the per-token view of the per-sequence entry tables are
computed here: device ops on tensors of static shape, nothing that reads a
value back to the host.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .cache_spec import CacheGeometry
from .config import SLIDING
from .inputs import ForwardInputs
from .rope import Rotary


@dataclass
class LayerMeta:
    """What the attention of one cache kind needs for the current step (a kind reading another kind's
    compressed entries shares that kind's entry fields)."""

    layer_type: str
    #: ``[T, R/2]`` rotary angles of each token (main rope for sliding layers, compress rope otherwise)
    cos: torch.Tensor
    sin: torch.Tensor
    #: ``[T]`` kv-pool rows receiving each token's K=V
    window_write: torch.Tensor
    #: ``[T, W]`` kv-pool rows of each token's sliding window (itself included), -1 before position 0
    window_rows: torch.Tensor
    ratio: int = 0
    #: ``[T]`` state-pool rows receiving each token's compressor projections
    state_write: torch.Tensor | None = None
    #: ``[E, m]`` state rows of the window of each entry the step completes (-1 rows: padding)
    emit_rows: torch.Tensor | None = None
    #: ``[E, m]`` state rows of the window before it (overlapping compressor only)
    emit_prev_rows: torch.Tensor | None = None
    #: ``[E]`` kv-pool / index-pool rows receiving each completed entry (-1: none)
    emit_kv_slot: torch.Tensor | None = None
    emit_index_slot: torch.Tensor | None = None
    #: ``[E, R/2]`` compress-rope angles at each completed entry's position (its window's first token)
    entry_cos: torch.Tensor | None = None
    entry_sin: torch.Tensor | None = None
    #: ``[B, N]`` kv-pool / index-pool rows of each sequence's entries ``0 … N − 1`` (-1: no block); a token
    #: sees the first ``visible`` of its sequence's (per-sequence tables: nothing here grows as ``T × N``)
    seq_kv: torch.Tensor | None = None
    seq_index: torch.Tensor | None = None
    #: ``[T]`` each token's row of the per-sequence tables
    token_seq: torch.Tensor | None = None
    #: ``[T]`` how many compressed entries each token sees
    visible: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> "LayerMeta":
        """The per-token fields at the batch rows ``rows`` (for a layer that reads entries but completes none)."""
        picked = {
            name: getattr(self, name).index_select(0, rows)
            for name in ("cos", "sin", "window_write", "window_rows", "token_seq", "visible")
            if getattr(self, name) is not None
        }
        return dataclasses.replace(self, **picked, state_write=None)

    @property
    def entries(self) -> int:
        """``N``: the entries a sequence's tables hold this step (a token sees at most that many)."""
        return self.seq_kv.shape[1]

    def entry_rows(self, entries: torch.Tensor, index: bool = False) -> torch.Tensor:
        """``[T, K]`` kv-pool (index-pool) rows of each token's entry numbers ``entries`` ``[T, K]`` (-1 stays -1)."""
        table = self.seq_index if index else self.seq_kv
        if entries.shape[1] == 0 or table.shape[1] == 0:
            return torch.full_like(entries, -1)
        rows = table[self.token_seq[:, None], entries.clamp(0, table.shape[1] - 1)]
        return torch.where(entries >= 0, rows, -1)


def build_layer_metas(inputs: ForwardInputs, geometry: CacheGeometry, rope_main: Rotary, rope_compress: Rotary) -> dict[str, LayerMeta]:
    """One ``LayerMeta`` per cache kind present."""
    pos = inputs.positions
    main = compress = None
    metas: dict[str, LayerMeta] = {}
    shared: dict[str, LayerMeta] = {}
    for lt, spec in geometry.specs.items():
        if lt == SLIDING:
            main = main or rope_main(pos)
            cos, sin = main
        else:
            compress = compress or rope_compress(pos)
            cos, sin = compress
        meta = LayerMeta(lt, cos, sin, inputs.window_write, inputs.window_rows)
        metas[lt] = meta
        if not spec.compressed:
            continue
        if spec.entry_kind in shared:  # a reader of entries another kind's fields already describe
            owner = shared[spec.entry_kind]
            meta.ratio, meta.seq_kv, meta.seq_index = owner.ratio, owner.seq_kv, owner.seq_index
            meta.token_seq, meta.visible = owner.token_seq, owner.visible
            meta.entry_cos, meta.entry_sin = owner.entry_cos, owner.entry_sin
            continue
        shared[spec.entry_kind] = meta
        li = inputs.layers[spec.entry_kind]
        m = spec.ratio
        meta.ratio = m
        meta.state_write = li.state_write
        meta.emit_rows = li.emit_rows
        meta.emit_prev_rows = li.emit_prev_rows
        meta.emit_kv_slot = li.emit_kv
        meta.emit_index_slot = li.emit_index
        meta.entry_cos, meta.entry_sin = rope_compress(li.emit_positions)
        meta.visible = li.visible
        meta.token_seq = inputs.token_seq
        meta.seq_kv, meta.seq_index = li.seq_kv, li.seq_index
    return metas

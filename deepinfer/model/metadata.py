"""Per-step index tensors shared by every layer of one layer type.

Fixed shapes: every token gets a window row list, and every token is a
potential emitter of one compressed entry (the token that closes a window of
``m`` positions emits it); rows that emit nothing carry ``-1`` slots, which the
ops skip. This keeps the step free of data-dependent shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import Batch
from .cache import ModelCache
from .config import CSA, SLIDING, ModelConfig
from .rope import Rotary


@dataclass
class LayerMeta:
    """What the attention of one layer type needs for the current step."""

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
    #: ``[T, m]`` state rows of the window a token closes (-1 rows: the token closes none)
    emit_rows: torch.Tensor | None = None
    #: ``[T, m]`` state rows of the window before it (overlapping compressor only)
    emit_prev_rows: torch.Tensor | None = None
    #: ``[T]`` kv-pool / index-pool rows receiving the emitted entry (-1: none)
    emit_kv_slot: torch.Tensor | None = None
    emit_index_slot: torch.Tensor | None = None
    #: ``[T, R/2]`` compress-rope angles at the emitted entry's position (its window's first token)
    entry_cos: torch.Tensor | None = None
    entry_sin: torch.Tensor | None = None
    #: ``[T, N]`` kv-pool / index-pool rows of the entries visible to each token (-1: not yet complete)
    visible_kv: torch.Tensor | None = None
    visible_index: torch.Tensor | None = None


def build_layer_meta(
    layer_type: str,
    batch: Batch,
    cache: ModelCache,
    config: ModelConfig,
    rope_main: Rotary,
    rope_compress: Rotary,
) -> LayerMeta:
    """Slots and rotary angles of one layer type for ``batch``."""
    pos = batch.positions
    seq = batch.token_slots
    device = pos.device
    rope = rope_main if layer_type == SLIDING else rope_compress
    cos, sin = rope(pos)
    w = config.sliding_window
    win_pos = pos[:, None] - torch.arange(w, device=device)[None, :]
    seq_w = seq[:, None].expand_as(win_pos)
    meta = LayerMeta(
        layer_type=layer_type,
        cos=cos,
        sin=sin,
        window_write=cache.window_slots(layer_type, seq, pos),
        window_rows=cache.window_slots(layer_type, seq_w, win_pos),
    )
    if layer_type == SLIDING:
        return meta

    m = config.compress_ratio(layer_type)
    meta.ratio = m
    meta.state_write = cache.state_slots(layer_type, seq, pos)
    closes = (pos + 1) % m == 0
    entry = torch.where(closes, (pos + 1) // m - 1, torch.full_like(pos, -1))
    first = pos - m + 1
    src = first[:, None] + torch.arange(m, device=device)[None, :]
    src = torch.where(closes[:, None], src, torch.full_like(src, -1))
    seq_m = seq[:, None].expand_as(src)
    meta.emit_rows = cache.state_slots(layer_type, seq_m, src)
    if layer_type == CSA:
        prev = torch.where(src >= m, src - m, torch.full_like(src, -1))
        meta.emit_prev_rows = cache.state_slots(layer_type, seq_m, prev)
    meta.emit_kv_slot = cache.entry_write_slots(layer_type, seq, entry)
    meta.entry_cos, meta.entry_sin = rope_compress(first.clamp(min=0))

    n_entries = batch.max_context_len // m
    entries = torch.arange(n_entries, device=device)[None, :].expand(pos.shape[0], n_entries)
    visible = torch.where(entries < ((pos + 1) // m)[:, None], entries, torch.full_like(entries, -1))
    seq_n = seq[:, None].expand_as(visible)
    meta.visible_kv = cache.entry_slots(layer_type, seq_n, visible)
    if layer_type == CSA:
        meta.emit_index_slot = cache.index_write_slots(layer_type, seq, entry)
        meta.visible_index = cache.index_slots(layer_type, seq_n, visible)
    return meta

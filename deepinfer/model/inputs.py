"""One step's index tensors: computed on the host, padded to static sizes, copied to the device at once.

Every size the forward depends on is fixed by a ``StepShape`` before the
forward starts: tokens ``T``, sequences ``B``, logits rows ``L`` and, per
compressing layer type, the compressed entries ``N`` each token may see. Every
index is computed here in numpy from the batch and the cache's host tables and
written into one flat int64 buffer (``StepLayout``); the device gets that
buffer in one copy, and the forward only gathers, scatters and masks with it,
so it never waits for the host (a decode step can be captured as a graph).

Rows beyond the batch's real tokens, sequences or logits are padding: their
cache rows are ``-1`` (nothing read or written), their token id and position 0,
and they see no compressed entry. Per-sequence tables (``seq_kv``: the rows of
each sequence's entries ``0 … N − 1``) are expanded to tokens on the device,
so a prefill chunk copies ``B × N`` rows rather than ``T × N``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .batch import Batch
from .cache import ModelCache
from .cache_spec import CacheGeometry


@dataclass(frozen=True)
class StepShape:
    """The static sizes of one step."""

    tokens: int
    seqs: int
    logits: int
    #: per compressing layer type (``geometry.compressed_types`` order): entries visible to a token
    entries: tuple[int, ...]

    @classmethod
    def exact(cls, batch: Batch, geometry: CacheGeometry) -> "StepShape":
        """No padding: the batch's own sizes."""
        return cls.padded(batch.num_tokens, batch.num_seqs, len(batch.logits_indices), batch.max_context_len, geometry)

    @classmethod
    def padded(cls, tokens: int, seqs: int, logits: int, context_len: int, geometry: CacheGeometry) -> "StepShape":
        """Room for ``tokens`` tokens of ``seqs`` sequences reaching at most ``context_len`` positions."""
        entries = tuple(context_len // geometry.specs[lt].ratio for lt in geometry.compressed_types)
        return cls(tokens, seqs, logits, entries)


@dataclass
class LayerInputs:
    """The indices of one compressing layer type (all layers of that type share them)."""

    #: ``[T]`` state-ring rows receiving each token's compressor projections
    state_write: torch.Tensor
    #: ``[T, m]`` state rows of the window a token closes (-1 rows: the token closes none)
    emit_rows: torch.Tensor
    #: ``[T]`` kv-pool rows receiving the entry a token closes (-1: none, or shared)
    emit_kv: torch.Tensor
    #: ``[T]`` compressed entries visible to each token
    visible: torch.Tensor
    #: ``[B, N]`` kv-pool rows of each sequence's entries ``0 … N − 1`` (-1: no block)
    seq_kv: torch.Tensor
    #: ``[T, m]`` state rows of the window before it (overlapping compressor only)
    emit_prev_rows: torch.Tensor | None = None
    #: ``[T]`` / ``[B, N]`` the same for the indexer keys (compressed sparse attention only)
    emit_index: torch.Tensor | None = None
    seq_index: torch.Tensor | None = None


@dataclass
class ForwardInputs:
    """Every index tensor of one step, as views into one flat device buffer."""

    #: ``[T]`` token ids (placeholders already filled from the previous step's samples)
    input_ids: torch.Tensor
    #: ``[T]`` absolute position of each token
    positions: torch.Tensor
    #: ``[T]`` index into the previous step's sampled tokens for placeholder tokens, else -1
    placeholder_src: torch.Tensor
    #: ``[T]`` each token's row in the per-sequence tables
    token_seq: torch.Tensor
    #: ``[L]`` rows of the batch whose logits the forward returns
    logits_indices: torch.Tensor
    #: ``[T]`` / ``[T, W]`` sliding-window ring rows: each token's own, and its window's (itself first)
    window_write: torch.Tensor
    window_rows: torch.Tensor
    layers: dict[str, LayerInputs]
    #: the flat int64 buffer every field is a view of
    buffer: torch.Tensor


class StepLayout:
    """Where each field of a ``StepShape`` lives in the flat buffer."""

    def __init__(self, shape: StepShape, geometry: CacheGeometry) -> None:
        self.shape = shape
        self.geometry = geometry
        t, b, w = shape.tokens, shape.seqs, geometry.sliding_window
        fields: list[tuple[str, tuple[int, ...]]] = [
            ("input_ids", (t,)), ("positions", (t,)), ("placeholder_src", (t,)), ("token_seq", (t,)),
            ("logits_indices", (shape.logits,)), ("window_write", (t,)), ("window_rows", (t, w)),
        ]
        for lt, n in zip(geometry.compressed_types, shape.entries):
            spec = geometry.specs[lt]
            m = spec.ratio
            fields += [(f"{lt}.state_write", (t,)), (f"{lt}.emit_rows", (t, m)), (f"{lt}.emit_kv", (t,)),
                       (f"{lt}.visible", (t,)), (f"{lt}.seq_kv", (b, n))]
            if spec.overlap:
                fields.append((f"{lt}.emit_prev_rows", (t, m)))
            if spec.index_head_dim:
                fields += [(f"{lt}.emit_index", (t,)), (f"{lt}.seq_index", (b, n))]
        self.fields = fields
        self.numel = sum(int(np.prod(s)) for _, s in fields)

    def carve(self, flat: Any) -> dict[str, Any]:
        """Views of ``flat`` (a numpy array or a tensor of ``numel`` elements), by field name."""
        out, at = {}, 0
        for name, shape in self.fields:
            n = int(np.prod(shape))
            out[name] = flat[at : at + n].reshape(shape)
            at += n
        return out

    def forward_inputs(self, buffer: torch.Tensor) -> ForwardInputs:
        """The typed views of a device buffer."""
        v = self.carve(buffer)
        layers = {}
        for lt in self.geometry.compressed_types:
            layers[lt] = LayerInputs(
                state_write=v[f"{lt}.state_write"], emit_rows=v[f"{lt}.emit_rows"], emit_kv=v[f"{lt}.emit_kv"],
                visible=v[f"{lt}.visible"], seq_kv=v[f"{lt}.seq_kv"], emit_prev_rows=v.get(f"{lt}.emit_prev_rows"),
                emit_index=v.get(f"{lt}.emit_index"), seq_index=v.get(f"{lt}.seq_index"),
            )
        return ForwardInputs(
            input_ids=v["input_ids"], positions=v["positions"], placeholder_src=v["placeholder_src"],
            token_seq=v["token_seq"], logits_indices=v["logits_indices"], window_write=v["window_write"],
            window_rows=v["window_rows"], layers=layers, buffer=buffer,
        )


def fill_step_inputs(
    host: np.ndarray, layout: StepLayout, batch: Batch, cache: ModelCache, placeholder_src: np.ndarray | None = None
) -> None:
    """Write every index of ``batch`` into ``host`` (``layout.numel`` int64), padding what the batch leaves.

    ``placeholder_src`` ``[batch.num_tokens]`` gives, for tokens the host does
    not know yet (negative ids), their index among the previous step's samples.
    """
    shape, g = layout.shape, layout.geometry
    v = layout.carve(host)
    lens = np.fromiter((len(t) for t in batch.token_ids), dtype=np.int64, count=batch.num_seqs)
    n, b = int(lens.sum()), batch.num_seqs
    if n > shape.tokens or b > shape.seqs or len(batch.logits_indices) > shape.logits:
        raise ValueError(f"a batch of {n} tokens, {b} sequences and {len(batch.logits_indices)} logits does not fit {shape}")
    seq = np.repeat(np.arange(b, dtype=np.int64), lens)
    first = np.cumsum(lens) - lens
    slots_b = np.full(shape.seqs, -1, dtype=np.int64)
    slots_b[:b] = batch.seq_slots
    pos = np.zeros(shape.tokens, dtype=np.int64)
    pos[:n] = np.asarray(batch.start_positions, dtype=np.int64)[seq] + np.arange(n, dtype=np.int64) - first[seq]
    slot = np.full(shape.tokens, -1, dtype=np.int64)
    slot[:n] = slots_b[seq]
    live = slot >= 0

    ids = v["input_ids"]
    ids[:] = 0
    if n:
        ids[:n] = np.concatenate([np.asarray(t, dtype=np.int64) for t in batch.token_ids])
    v["placeholder_src"][:] = -1
    if placeholder_src is not None:
        v["placeholder_src"][:n] = placeholder_src
    v["positions"][:] = pos
    v["token_seq"][:] = 0
    v["token_seq"][:n] = seq
    v["logits_indices"][:] = 0
    v["logits_indices"][: len(batch.logits_indices)] = batch.logits_indices
    v["window_write"][:] = cache.window_rows_of(slot, pos)
    w = g.sliding_window
    v["window_rows"][:] = cache.window_rows_of(slot[:, None], pos[:, None] - np.arange(w, dtype=np.int64)[None, :])

    for lt, entries in zip(g.compressed_types, shape.entries):
        spec = g.specs[lt]
        m = spec.ratio
        closes = live & ((pos + 1) % m == 0)
        entry = np.where(closes, (pos + 1) // m - 1, -1)
        src = np.where(closes[:, None], (pos - m + 1)[:, None] + np.arange(m, dtype=np.int64)[None, :], -1)
        v[f"{lt}.state_write"][:] = cache.state_rows_of(spec, slot, pos)
        v[f"{lt}.emit_rows"][:] = cache.state_rows_of(spec, slot[:, None], src)
        v[f"{lt}.emit_kv"][:] = cache.entry_write_rows_of(spec, slot, entry)
        v[f"{lt}.visible"][:] = np.where(live, (pos + 1) // m, 0)
        table = np.arange(entries, dtype=np.int64)[None, :]
        v[f"{lt}.seq_kv"][:] = cache.entry_rows_of(spec, slots_b[:, None], table)
        if spec.overlap:
            v[f"{lt}.emit_prev_rows"][:] = cache.state_rows_of(spec, slot[:, None], np.where(src >= m, src - m, -1))
        if spec.index_head_dim:
            v[f"{lt}.emit_index"][:] = cache.entry_write_rows_of(spec, slot, entry, index=True)
            v[f"{lt}.seq_index"][:] = cache.entry_rows_of(spec, slots_b[:, None], table, index=True)


def step_inputs(batch: Batch, cache: ModelCache, device: torch.device | str) -> ForwardInputs:
    """The unpadded inputs of ``batch`` on ``device`` (one copy): for running the model outside the engine."""
    layout = StepLayout(StepShape.exact(batch, cache.geometry), cache.geometry)
    host = np.empty(layout.numel, dtype=np.int64)
    fill_step_inputs(host, layout, batch, cache)
    return layout.forward_inputs(torch.from_numpy(host).to(device))

"""One step's index tensors: computed on the host, padded to static sizes, copied to the device at once.

Every size the forward depends on is fixed by a ``StepShape`` before the
forward starts: tokens ``T``, sequences ``B``, logits rows ``L`` and, per
compressing layer type, the compressed entries ``N`` each token may see and the
entries ``E`` the step's tokens complete (the tokens that close a window of
``m`` positions; the compressor pools only those). Every
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

import itertools
import math
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
    #: per cache kind owning compressed entries (``geometry.entry_kinds`` order): entries visible to a token
    entries: tuple[int, ...]
    #: per cache kind owning entries: entries the step's tokens complete
    emits: tuple[int, ...]
    #: per layer of ``geometry.prefill_tail``: the tokens it computes (all of them without a prefill tail)
    decoder_rows: tuple[int, ...] = ()

    @classmethod
    def exact(cls, batch: Batch, geometry: CacheGeometry) -> "StepShape":
        """No padding: the batch's own sizes."""
        ratios = [geometry.specs[lt].ratio for lt in geometry.entry_kinds]
        spans = list(zip(batch.start_positions, batch.query_lens))
        emits = tuple(sum((s + n) // m - s // m for s, n in spans) for m in ratios)
        entries = tuple(batch.max_context_len // m for m in ratios)
        rows = tuple(int(len(kept)) for kept in tail_rows(batch, geometry))
        return cls(batch.num_tokens, batch.num_seqs, len(batch.logits_indices), entries, emits, rows)

    @classmethod
    def padded(cls, tokens: int, seqs: int, logits: int, context_len: int, geometry: CacheGeometry) -> "StepShape":
        """Room for ``tokens`` tokens of ``seqs`` sequences reaching at most ``context_len`` positions
        (each token may complete an entry)."""
        ratios = [geometry.specs[lt].ratio for lt in geometry.entry_kinds]
        entries = tuple(context_len // m for m in ratios)
        return cls(tokens, seqs, logits, entries, (tokens,) * len(ratios), (tokens,) * len(geometry.prefill_tail))


def tail_rows(batch: Batch, geometry: CacheGeometry) -> list[np.ndarray]:
    """Per layer of ``geometry.prefill_tail``, the batch rows it computes: a token of a sequence with a
    ``prefill_end`` ``P`` only when it lies in the layer's tail ``[P − tail, P)``, every other token always."""
    if not geometry.prefill_tail:
        return []
    n = batch.num_tokens
    ends = batch.prefill_end or (0,) * batch.num_seqs
    lens = np.fromiter(batch.query_lens, dtype=np.int64, count=batch.num_seqs)
    seq = np.repeat(np.arange(batch.num_seqs), lens)
    first = np.cumsum(lens) - lens
    pos = np.asarray(batch.start_positions, dtype=np.int64)[seq] + np.arange(n) - first[seq]
    end = np.asarray(ends, dtype=np.int64)[seq]
    wanted = np.zeros(n, dtype=bool)
    wanted[list(batch.logits_indices)] = True  # a logits row runs every layer (exact only at the end)
    return [np.flatnonzero((end <= 0) | (pos >= end - tail) | wanted) for tail in geometry.prefill_tail]


@dataclass
class LayerInputs:
    """The indices of one cache kind owning compressed entries (every layer reading them shares them)."""

    #: ``[T]`` state-ring rows receiving each token's compressor projections
    state_write: torch.Tensor
    #: ``[E, m]`` state rows of each completed entry's window (-1 rows: padding)
    emit_rows: torch.Tensor
    #: ``[E]`` kv-pool rows receiving each completed entry (-1: padding, or shared)
    emit_kv: torch.Tensor
    #: ``[E]`` position of each completed entry's first token (its rotary position)
    emit_positions: torch.Tensor
    #: ``[T]`` compressed entries visible to each token
    visible: torch.Tensor
    #: ``[B, N]`` kv-pool rows of each sequence's entries ``0 … N − 1`` (-1: no block)
    seq_kv: torch.Tensor
    #: ``[E, m]`` state rows of the window before it (overlapping compressor only)
    emit_prev_rows: torch.Tensor | None = None
    #: ``[E]`` / ``[B, N]`` the same for the indexer keys (compressed sparse attention only)
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
    #: ``[T]`` / ``[T, N]`` token-history ring rows: each token's own, and those of the ``N`` tokens its
    #: n-gram spans (itself first; -1 before position 0); None without Engram
    history_write: torch.Tensor | None = None
    history_rows: torch.Tensor | None = None
    #: ``[S]`` ring rows and ``[S]`` token ids written before the step (a first chunk's look-back; -1: none)
    history_seed_rows: torch.Tensor | None = None
    history_seed_ids: torch.Tensor | None = None
    #: per layer of the prefill tail: the batch rows it computes, and their places among the rows the layer
    #: before computed (``take``); ``tail_logits``: the logits rows among the last layer's rows
    tail_rows: list[torch.Tensor] | None = None
    tail_take: list[torch.Tensor] | None = None
    tail_logits: torch.Tensor | None = None
    #: ``[R]`` int64 batch rows at image positions and ``[R, D]`` what their embedding becomes (an eager step
    #: whose chunks reach into image spans; None otherwise: the flat buffer's layout never depends on images)
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None

    @property
    def live(self) -> torch.Tensor:
        """``[T]`` bool: the batch's real tokens (every real token writes its sliding-window row; padding writes none)."""
        return self.window_write >= 0


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
        for j, rows in enumerate(shape.decoder_rows):
            fields += [(f"tail{j}.rows", (rows,)), (f"tail{j}.take", (rows,))]
        if shape.decoder_rows:
            fields.append(("tail_logits", (shape.logits,)))
        if geometry.history_rows:
            back = geometry.history_window
            fields += [("history_write", (t,)), ("history_rows", (t, back)), ("history_seed_rows", (b * (back - 1),)),
                       ("history_seed_ids", (b * (back - 1),))]
        for lt, n, e in zip(geometry.entry_kinds, shape.entries, shape.emits):
            spec = geometry.specs[lt]
            m = spec.ratio
            fields += [(f"{lt}.state_write", (t,)), (f"{lt}.emit_rows", (e, m)), (f"{lt}.emit_kv", (e,)),
                       (f"{lt}.emit_positions", (e,)), (f"{lt}.visible", (t,)), (f"{lt}.seq_kv", (b, n))]
            if spec.overlap:
                fields.append((f"{lt}.emit_prev_rows", (e, m)))
            if spec.index_head_dim:
                fields += [(f"{lt}.emit_index", (e,)), (f"{lt}.seq_index", (b, n))]
        self.fields = fields
        #: (name, first element, end, shape) of each field
        self._spans: list[tuple[str, int, int, tuple[int, ...]]] = []
        at = 0
        for name, shape in fields:
            n = math.prod(shape)
            self._spans.append((name, at, at + n, shape))
            at += n
        self.numel = at

    def carve(self, flat: Any) -> dict[str, Any]:
        """Views of ``flat`` (a numpy array or a tensor of ``numel`` elements), by field name."""
        return {name: flat[a:b].reshape(shape) for name, a, b, shape in self._spans}

    def forward_inputs(self, buffer: torch.Tensor) -> ForwardInputs:
        """The typed views of a device buffer."""
        v = self.carve(buffer)
        layers = {}
        for lt in self.geometry.entry_kinds:
            layers[lt] = LayerInputs(
                state_write=v[f"{lt}.state_write"], emit_rows=v[f"{lt}.emit_rows"], emit_kv=v[f"{lt}.emit_kv"],
                emit_positions=v[f"{lt}.emit_positions"], visible=v[f"{lt}.visible"], seq_kv=v[f"{lt}.seq_kv"], emit_prev_rows=v.get(f"{lt}.emit_prev_rows"),
                emit_index=v.get(f"{lt}.emit_index"), seq_index=v.get(f"{lt}.seq_index"),
            )
        return ForwardInputs(
            input_ids=v["input_ids"], positions=v["positions"], placeholder_src=v["placeholder_src"],
            token_seq=v["token_seq"], logits_indices=v["logits_indices"], window_write=v["window_write"],
            window_rows=v["window_rows"], layers=layers, buffer=buffer, history_write=v.get("history_write"),
            history_rows=v.get("history_rows"), history_seed_rows=v.get("history_seed_rows"),
            history_seed_ids=v.get("history_seed_ids"),
            tail_rows=[v[f"tail{j}.rows"] for j in range(len(self.shape.decoder_rows))] or None,
            tail_take=[v[f"tail{j}.take"] for j in range(len(self.shape.decoder_rows))] or None,
            tail_logits=v.get("tail_logits"),
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
    ids[:n] = np.fromiter(itertools.chain.from_iterable(batch.token_ids), dtype=np.int64, count=n)
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

    if shape.decoder_rows:
        kept = tail_rows(batch, g) if n else []
        before = np.arange(shape.tokens, dtype=np.int64)
        for j, size in enumerate(shape.decoder_rows):
            rows = kept[j] if n else np.zeros(0, dtype=np.int64)
            if len(rows) < size:  # a padded shape computes every row, padding included
                rows = np.concatenate([rows, np.setdiff1d(np.arange(shape.tokens), rows)])[:size]
                rows.sort()
            v[f"tail{j}.rows"][:] = rows
            v[f"tail{j}.take"][:] = np.searchsorted(before, rows)
            before = rows
        place = np.searchsorted(before, v["logits_indices"])
        v["tail_logits"][:] = np.minimum(place, max(len(before) - 1, 0))

    if g.history_rows:
        back = g.history_window
        v["history_write"][:] = cache.history_rows_of(slot, pos)
        v["history_rows"][:] = cache.history_rows_of(slot[:, None], pos[:, None] - np.arange(back, dtype=np.int64)[None, :])
        seed_rows = np.full((shape.seqs, back - 1), -1, dtype=np.int64)
        seed_ids = np.zeros((shape.seqs, back - 1), dtype=np.int64)
        for i, ids in enumerate(batch.history):
            ids = ids[len(ids) - (back - 1):] if len(ids) > back - 1 else ids
            if ids:
                start = batch.start_positions[i]
                at = np.arange(start - len(ids), start, dtype=np.int64)
                seed_rows[i, : len(ids)] = cache.history_rows_of(np.full(len(ids), batch.seq_slots[i]), at)
                seed_ids[i, : len(ids)] = ids
        v["history_seed_rows"][:] = seed_rows.reshape(-1)
        v["history_seed_ids"][:] = seed_ids.reshape(-1)

    for lt, entries, emits in zip(g.entry_kinds, shape.entries, shape.emits):
        spec = g.specs[lt]
        m = spec.ratio
        v[f"{lt}.state_write"][:] = cache.state_rows_of(spec, slot, pos)
        v[f"{lt}.visible"][:] = np.where(live, (pos + 1) // m, 0)
        table = np.arange(entries, dtype=np.int64)[None, :]
        v[f"{lt}.seq_kv"][:] = cache.entry_rows_of(spec, slots_b[:, None], table)
        if spec.index_head_dim:
            v[f"{lt}.seq_index"][:] = cache.entry_rows_of(spec, slots_b[:, None], table, index=True)
        # the tokens that close a window, in batch order, then padding
        closing = np.flatnonzero(live & ((pos + 1) % m == 0))
        if len(closing) > emits:
            raise ValueError(f"the batch completes {len(closing)} entries of {lt} but the shape has room for {emits}")
        e_slot = np.full(emits, -1, dtype=np.int64)
        e_slot[: len(closing)] = slot[closing]
        e_entry = np.full(emits, -1, dtype=np.int64)
        e_entry[: len(closing)] = (pos[closing] + 1) // m - 1
        first_pos = np.maximum(e_entry, 0) * m
        src = np.where((e_entry >= 0)[:, None], first_pos[:, None] + np.arange(m, dtype=np.int64)[None, :], -1)
        v[f"{lt}.emit_rows"][:] = cache.state_rows_of(spec, e_slot[:, None], src)
        v[f"{lt}.emit_positions"][:] = first_pos
        v[f"{lt}.emit_kv"][:] = cache.entry_write_rows_of(spec, e_slot, e_entry)
        if spec.overlap:
            v[f"{lt}.emit_prev_rows"][:] = cache.state_rows_of(spec, e_slot[:, None], np.where(src >= m, src - m, -1))
        if spec.index_head_dim:
            v[f"{lt}.emit_index"][:] = cache.entry_write_rows_of(spec, e_slot, e_entry, index=True)


def step_inputs(batch: Batch, cache: ModelCache, device: torch.device | str) -> ForwardInputs:
    """The unpadded inputs of ``batch`` on ``device`` (one copy): for running the model outside the engine."""
    layout = StepLayout(StepShape.exact(batch, cache.geometry), cache.geometry)
    host = np.empty(layout.numel, dtype=np.int64)
    fill_step_inputs(host, layout, batch, cache)
    return layout.forward_inputs(torch.from_numpy(host).to(device))

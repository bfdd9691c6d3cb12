"""Decode steps captured as device graphs, one per (padded batch size, context bucket).

A decode step of ``B`` sequences runs the graph of the smallest capture size
``≥ B`` and the smallest context bucket reaching its longest sequence: the
batch is padded to that size (padding tokens read and write nothing) and every
sequence's compressed-entry list to ``bucket / ratio`` entries. With speculative
decoding each size also has a verify graph of ``B · (1 + γ)`` tokens: a step of
at most ``B`` sequences each bringing one token and up to ``γ`` drafts (every
token's logits returned) replays it, padded to that token count. Each graph
owns static input buffers (a host staging buffer and its device copy); a step
fills the host buffer, copies it in one transfer and replays. Buckets double
from 256 tokens to ``max_model_len``, so padding at most doubles the entry
lists a step reads.

Under expert parallelism every rank captures the same graphs in the same order,
each with its token count as the dispatch capacity, and each step every rank
replays the graph of one agreed size and kind (``ExpertParallel.begin_step``,
then ``DecodeGraphs.get``): a rank that only decodes replays a verify graph
when another verifies.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from deepinfer_interfaces import Device

from .errors import ConfigError
from .models.common.batch import Batch
from .models.common.cache import ModelCache
from .models.common.inputs import ForwardInputs, StepLayout, StepShape, fill_step_inputs
from .models.common.causal_lm import CausalLM

log = logging.getLogger("deepinfer")

#: the smallest context bucket, in tokens
MIN_BUCKET = 256


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's shape: 1, 2, 4, then every multiple of 8, up to (and including) ``max_num_seqs``."""
    sizes = [s for s in [1, 2, 4, *range(8, max_num_seqs + 1, 8)] if s <= max_num_seqs]
    return sizes if sizes and sizes[-1] == max_num_seqs else [*sizes, max_num_seqs]


def context_buckets(block_size: int, max_model_len: int) -> list[int]:
    """Context lengths a graph is captured for: whole blocks, doubling, the last covering ``max_model_len``."""
    top = -(-max_model_len // block_size) * block_size
    b = -(-min(MIN_BUCKET, top) // block_size) * block_size
    out = []
    while b < top:
        out.append(b)
        b *= 2
    return [*out, top]


@dataclass
class DecodeGraph:
    """One captured decode step and its static inputs."""

    size: int
    context: int
    layout: StepLayout
    #: host staging buffer (numpy view of ``host_tensor``) and the device buffer the graph reads
    host: np.ndarray
    host_tensor: torch.Tensor
    inputs: ForwardInputs
    #: ``() -> (logits, [T, len(hidden_layers), D] hidden states)``
    replay: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    #: steps that replayed this graph
    replays: int = 0
    #: tokens each sequence brings: 1 (decode) or 1 + γ (verify)
    tokens_per_seq: int = 1

    @property
    def key(self) -> str:
        """``"B"`` for a decode graph of ``B`` sequences, ``"BxK"`` for a verify graph of ``K`` tokens each."""
        return str(self.size) if self.tokens_per_seq == 1 else f"{self.size}x{self.tokens_per_seq}"

    def load(self, batch: Batch, cache: ModelCache, placeholders: np.ndarray | None = None) -> None:
        """Write ``batch``'s indices into the static buffers (one host-to-device copy, queued)."""
        fill_step_inputs(self.host, self.layout, batch, cache, placeholders)
        self.inputs.buffer.copy_(self.host_tensor, non_blocking=True)


@dataclass
class CaptureReport:
    graphs: int
    seconds: float
    bytes: int


class DecodeGraphs:
    """The graphs of one model and cache, and which one a decode step runs."""

    def __init__(
        self, model: CausalLM, cache: ModelCache, device: Device, sizes: list[int], max_model_len: int,
        fix_capacity: Callable[[int], None] | None = None, hidden_layers: tuple[int, ...] = (), drafts: int = 0,
    ) -> None:
        self.model = model
        #: layers whose hidden states each replay also returns (the draft's context)
        self.hidden_layers = hidden_layers
        #: under expert parallelism: fixes the dispatch layout at a graph's token count before its capture
        self.fix_capacity = fix_capacity
        self.cache = cache
        self.device = device
        self.sizes = sorted(set(sizes))
        self.buckets = context_buckets(cache.block_size, max_model_len)
        #: most drafted tokens a verify graph's sequence brings (0: no verify graphs)
        self.drafts = drafts
        #: (size, tokens per sequence, context bucket) -> graph
        self.graphs: dict[tuple[int, int, int], DecodeGraph] = {}

    def find(self, num_seqs: int, context_len: int, num_tokens: int | None = None) -> DecodeGraph | None:
        """The graph a step of ``num_seqs`` sequences reaching ``context_len`` tokens replays, if any: a decode
        graph when it brings one token per sequence (``num_tokens`` None or ``num_seqs``), else a verify graph."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        if i == len(self.sizes):
            return None
        per = 1 if num_tokens is None or num_tokens == num_seqs else 1 + self.drafts
        if num_tokens is not None and num_tokens > self.sizes[i] * per:
            return None
        return self.get(self.sizes[i], per, context_len)

    def padded_tokens(self, num_seqs: int, verify: bool) -> int | None:
        """The token count of the graph a decode (``verify``: verify) step of ``num_seqs`` sequences replays,
        padding included, or None when no captured size holds it."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        if i == len(self.sizes) or (verify and not self.drafts):
            return None
        return self.sizes[i] * (1 + self.drafts if verify else 1)

    def get(self, size: int, tokens_per_seq: int, context_len: int) -> DecodeGraph | None:
        """The graph of exactly ``size`` sequences of ``tokens_per_seq`` tokens whose context bucket is the
        smallest reaching ``context_len``, if captured (under expert parallelism the ranks agreed on its size)."""
        j = bisect.bisect_left(self.buckets, context_len)
        return self.graphs.get((size, tokens_per_seq, self.buckets[j])) if j < len(self.buckets) else None

    def capture(self, progress: Callable[[int, int], None] | None = None) -> CaptureReport:
        """Capture every (size, bucket), largest first so smaller graphs reuse the pool's memory.

        The order depends on the configuration alone, so ranks under expert parallelism capture the
        same graphs in the same order and their collectives meet."""
        geometry = self.cache.geometry
        pool = self.device.new_graph_pool()
        per_seq = [1, 1 + self.drafts] if self.drafts else [1]
        keys = [(s, p, b) for p in reversed(per_seq) for s in reversed(self.sizes) for b in reversed(self.buckets)]
        free_before, _ = self.device.memory_info()
        t0 = time.perf_counter()
        empty = Batch((), (), (), ())
        for done, (size, per, bucket) in enumerate(keys):
            tokens = size * per
            layout = StepLayout(StepShape.padded(tokens, size, tokens, bucket, geometry), geometry)
            host_tensor = self.device.host_buffer(layout.numel, torch.int64)
            host = host_tensor.numpy()
            fill_step_inputs(host, layout, empty, self.cache)  # all padding: the warm-up runs read and write nothing
            buffer = host_tensor.to(self.device.torch_device, copy=True)
            graph = DecodeGraph(size, bucket, layout, host, host_tensor, layout.forward_inputs(buffer), tokens_per_seq=per)
            if self.fix_capacity is not None:
                self.fix_capacity(layout.shape.tokens)
            try:
                graph.replay = self.device.capture_graph(self._step_fn(graph.inputs), pool)
            except Exception as exc:
                lines = str(exc).strip().splitlines()
                raise ConfigError(
                    f"capturing the decode graph of {size} sequences on {self.device.describe()} failed "
                    f"({type(exc).__name__}: {lines[0] if lines else ''}); run with enforce_eager=True (--enforce-eager)"
                ) from None
            self.graphs[(size, per, bucket)] = graph
            if progress is not None:
                progress(done + 1, len(keys))
        self.device.synchronize()
        free_after, _ = self.device.memory_info()
        return CaptureReport(len(keys), time.perf_counter() - t0, max(0, free_before - free_after))

    def _step_fn(self, inputs: ForwardInputs) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        model, cache, layers = self.model, self.cache, self.hidden_layers

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            logits = model.forward(inputs, cache, layers)
            if not layers:
                return logits, logits[:, :0]
            return logits, torch.stack([model.hidden_states[i] for i in layers], dim=1)

        return step

"""DeepSeek V4.1 attention (CSA2): compressed KV and indexer keys shared across layers.

Every layer keeps its own sliding window of raw K=V rows. A layer with a
compress ratio ``m`` also attends over compressed entries, which only its KV
source owns (``kv_source_layer_ids``: the last at or before it):

- *Full* (a KV source): pools its input into one latent per ``m`` tokens
  (softmax-gated, no position bias, no overlapping windows; ratio 1 projects
  every token), publishes the rotated latents as entries and ``k_norm(wk(latent))``
  rotated as indexer keys, and runs the indexer;
- *Reindex* (an index source that is not a KV source): scores its own queries
  against its source's keys;
- *Reuse*: attends over the entries its last index source picked.

With two-level top-k the candidate source keeps the best blocks of
``candidate_block_size`` entries per query and every later index source scores
only inside them. A reader's window ring lives in its source's kv pool, so the
window and the chosen entries are rows of one pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_interfaces import Kernels

from ..common.attention import LatentAttention, round_as_cached
from ..common.cache import COMPRESSOR, ModelCache
from ..common.config import ModelConfig
from .text_config import V41Layer
from ..common.linear import FusedProjection, ProjectionPart, QuantPlan, linear, linear_param
from ..common.metadata import LayerMeta
from ..common.params import ParamTree


@dataclass
class SharedIndices:
    """What index sources publish within one forward for the layers after them."""

    #: ``[T, K]`` kv-pool rows of the entries the last index source picked (-1: none)
    topk: torch.Tensor | None = None
    #: ``[T, topk_blocks]`` the candidate source's kept blocks, ascending (-1: none)
    candidates: torch.Tensor | None = None


def candidate_entries(blocks: torch.Tensor, block_size: int, visible: torch.Tensor) -> torch.Tensor:
    """``[T, Kb · block_size]`` the entry numbers of the kept ``blocks`` ``[T, Kb]`` (ascending, as the blocks
    are), -1 for a missing block and past what each token sees: a reader's bounded candidate list."""
    entries = (blocks[:, :, None] * block_size + torch.arange(block_size, device=blocks.device)).flatten(1)
    ok = (blocks[:, :, None] >= 0).expand(-1, -1, block_size).flatten(1) & (entries < visible[:, None])
    return torch.where(ok, entries, -1)


def offset_rows(rows: torch.Tensor, base: int) -> torch.Tensor:
    """``rows`` moved by ``base`` where they name a row (-1 stays -1)."""
    return rows if not base else torch.where(rows >= 0, rows + base, rows)


class SharedCompressor(ParamTree):
    """A KV source's compressor: the latent of every ``ratio`` tokens (``norm(wkv(x))`` per token at ratio 1)."""

    def __init__(self, config: ModelConfig, ratio: int, dtype: torch.dtype, device, plan: QuantPlan, role: str) -> None:
        super().__init__(device)
        self.ratio, self.plan, self.role = ratio, plan, role
        self.width = config.head_dim
        self.eps = config.rms_norm_eps
        self.norm = self.param("norm.weight", (config.head_dim,), torch.float32)
        #: V4.1 pools without a per-slot bias: a zero one for the pooling op
        self.no_bias = torch.zeros(ratio, config.head_dim, dtype=torch.float32, device=device)

    def projection_parts(self) -> list[ProjectionPart]:
        parts = [ProjectionPart(self, "wkv", self.width, self.plan.storage(f"{self.role}.wkv"))]
        if self.ratio > 1:
            parts.append(ProjectionPart(self, "wgate", self.width, self.plan.storage(f"{self.role}.wgate")))
        return parts

    def __call__(self, k: Kernels, projected: list[torch.Tensor], meta: LayerMeta, cache: ModelCache, layer: int) -> torch.Tensor:
        """``[E, head_dim]`` pre-rope latents of the entries this step completes (at ratio 1, one per token)."""
        if self.ratio == 1:
            return k.rms_norm(projected[0], self.norm, self.eps)
        state_kv, state_gate = cache.state_pool(layer, COMPRESSOR)
        k.cache_write(state_kv, meta.state_write, projected[0])
        k.cache_write(state_gate, meta.state_write, projected[1])
        pooled = k.compress_kv(state_kv, state_gate, self.no_bias, meta.emit_rows)  # in the state's dtype
        return k.rms_norm(pooled, self.norm, self.eps).to(projected[0].dtype)


class SharedIndexer(ParamTree):
    """An index source's lightning indexer; a KV source's also derives the keys its group scores against."""

    def __init__(self, config: ModelConfig, layer: V41Layer, dtype: torch.dtype, device, plan: QuantPlan, role: str) -> None:
        super().__init__(device)
        c, v = config, config.text
        self.plan, self.role = plan, role
        self.heads, self.dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.eps = c.rms_norm_eps
        self.candidates = layer.candidates
        self.topk_blocks, self.block_size = v.candidate_topk_blocks, v.candidate_block_size
        self.wq_b = linear_param(self, "wq_b", self.heads * self.dim, c.q_lora_rank, dtype, plan.storage(f"{role}.wq_b"))
        self.wk = self.k_norm = None
        if layer.owns_kv:
            self.wk = linear_param(self, "wk", self.dim, c.head_dim, dtype, plan.storage(f"{role}.wk"))
            self.k_norm = self.param("k_norm.weight", (self.dim,), torch.float32)

    def projection_parts(self) -> list[ProjectionPart]:
        return [ProjectionPart(self, "weights_proj", self.heads, self.plan.storage(f"{self.role}.weights_proj"))]

    def publish_keys(self, k: Kernels, latent: torch.Tensor, meta: LayerMeta, cache: ModelCache, layer: int) -> None:
        """Write the indexer keys of this step's completed entries (a KV source only)."""
        keys = k.rms_norm(linear(k, latent, self.wk), self.k_norm, self.eps)
        k.cache_write(cache.index_pool(layer), meta.emit_index_slot, k.rope(keys, meta.entry_cos, meta.entry_sin))

    def __call__(
        self, k: Kernels, head_weights: torch.Tensor, q_lat: torch.Tensor, meta: LayerMeta, cache: ModelCache,
        source: int, shared: SharedIndices,
    ) -> torch.Tensor:
        """``[T, min(topk, N)]`` kv-pool rows of the entries each query attends to (-1: none)."""
        q = linear(k, q_lat, self.wq_b).view(q_lat.shape[0], self.heads, self.dim)
        q = round_as_cached(k, k.rope(q, meta.cos, meta.sin), cache.formats.index)
        weights, keys, topk = head_weights * self.heads**-0.5, cache.index_pool(source), min(self.topk, meta.entries)
        scale, tables = self.dim**-0.5, (meta.seq_index, meta.token_seq, meta.visible)
        if self.candidates == "read" and shared.candidates is not None:
            # two-level top-k: score only the entries of the candidate source's kept blocks
            entries = candidate_entries(shared.candidates, self.block_size, meta.visible)
            scores = k.indexer_scores(q, weights, keys, meta.entry_rows(entries, index=True), scale)
            return meta.entry_rows(k.topk_select(scores, entries, topk))
        if self.candidates == "source":
            shared.candidates = k.indexer_block_topk(q, weights, keys, *tables, scale, self.topk_blocks, self.block_size)
        return meta.entry_rows(k.indexer_topk(q, weights, keys, *tables, scale, topk))


class SharedAttention(LatentAttention):
    """One V4.1 layer's attention: low-rank q (no per-head norm), one K=V latent, sinks, grouped output."""

    def __init__(self, config: ModelConfig, layer: V41Layer, dtype: torch.dtype, device, plan: QuantPlan, role: str = "attn") -> None:
        super().__init__(config, dtype, device, plan, role)
        c = config
        self.layer = layer
        self.compressor: SharedCompressor | None = None
        self.indexer: SharedIndexer | None = None
        #: how many of the fused projection's outputs after ``wq_a`` and ``wkv`` are the compressor's
        self.compressor_outputs = 0
        parts = [
            ProjectionPart(self, "wq_a", c.q_lora_rank, plan.storage(f"{role}.wq_a")),
            ProjectionPart(self, "wkv", c.head_dim, plan.storage(f"{role}.wkv")),
        ]
        if layer.owns_kv:
            self.compressor = self.child("compressor", SharedCompressor(c, layer.compress_ratio, dtype, device, plan, f"{role}.compressor"))
            compressor_parts = self.compressor.projection_parts()
            self.compressor_outputs = len(compressor_parts)
            parts += compressor_parts
        if layer.runs_indexer:
            self.indexer = self.child("indexer", SharedIndexer(c, layer, dtype, device, plan, f"{role}.indexer"))
            parts += self.indexer.projection_parts()
        self.proj_in = FusedProjection(c.hidden_size, parts, dtype, device)
        self.wq_a, self.wkv = self.proj_in.parts[0], self.proj_in.parts[1]

    def __call__(self, k: Kernels, x: torch.Tensor, meta: LayerMeta, cache: ModelCache, shared: SharedIndices) -> torch.Tensor:
        t, i = x.shape[0], self.layer.index
        projected = self.proj_in(k, x)
        q_lat = k.rms_norm(projected[0], self.q_norm, self.eps)
        q = k.rope(linear(k, q_lat, self.wq_b).view(t, self.heads, self.head_dim), meta.cos, meta.sin)
        kv = k.rope(k.rms_norm(projected[1], self.kv_norm, self.eps), meta.cos, meta.sin)
        pool = cache.kv_pool(i)
        base = cache.window_base[i]
        k.cache_write(pool, offset_rows(meta.window_write, base), kv)
        rows = offset_rows(meta.window_rows, base)
        if self.layer.compress_ratio:
            rest = projected[2:]
            if self.compressor is not None:
                n_comp = self.compressor_outputs
                latent = self.compressor(k, rest[:n_comp], meta, cache, i)
                rest = rest[n_comp:]
                self.indexer.publish_keys(k, latent, meta, cache, i)
                k.cache_write(pool, meta.emit_kv_slot, k.rope(latent, meta.entry_cos, meta.entry_sin))
            if self.indexer is not None:
                shared.topk = self.indexer(k, rest[0], q_lat, meta, cache, self.layer.kv_source, shared)
            rows = torch.cat([rows, shared.topk], dim=1)
        return self.attend(k, q, pool, rows, meta)

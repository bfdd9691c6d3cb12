"""DeepSeek-V4 attention: low-rank q, one shared K=V head, sinks, grouped output.

Every layer attends over its sliding window of raw K=V rows; CSA layers add the
compressed entries the lightning indexer picks, HCA layers every compressed
entry already complete.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from .cache import COMPRESSOR, INDEXER, ModelCache
from .compressor import Compressor
from .config import CSA, HCA, ModelConfig
from .metadata import LayerMeta
from .params import FusedProjection, ParamTree


class Indexer(ParamTree):
    """The lightning indexer: scores compressed entries per query, keeps the top k.

    ``weights_proj`` and its compressor's projections read the layer's input:
    they are rows of the attention's fused input projection (``projection_parts``).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__(device)
        c = config
        self.heads, self.dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.wq_b = self.param("wq_b.weight", (c.index_n_heads * c.index_head_dim, c.q_lora_rank), dtype)
        self.compressor = self.child(
            "compressor", Compressor(c.index_head_dim, c.compress_ratio(CSA), True, c.rms_norm_eps, dtype, device)
        )

    def projection_parts(self) -> list[tuple[ParamTree, str, int]]:
        return [(self, "weights_proj.weight", self.heads), *self.compressor.projection_parts()]

    def __call__(
        self, k: Kernels, projected: list[torch.Tensor], q_lat: torch.Tensor, meta: LayerMeta, cache: ModelCache, layer: int
    ) -> torch.Tensor:
        """``[T, min(topk, N)]`` kv-pool rows of the chosen entries (-1: none); ``projected`` is
        this step's ``weights_proj``, compressor kv and gate outputs."""
        head_weights, kv, gate = projected
        keys = cache.index_pool(layer)
        self.compressor(k, kv, gate, meta, cache.state_pool(layer, INDEXER), keys, meta.emit_index_slot)
        q = (q_lat @ self.wq_b.t()).view(q_lat.shape[0], self.heads, self.dim)
        q = k.rope(q, meta.cos, meta.sin)
        scores = k.indexer_scores(q, head_weights * self.heads**-0.5, keys, meta.visible_index, self.dim**-0.5)
        return k.topk_select(scores, meta.visible_kv, min(self.topk, meta.visible_kv.shape[1]))


class Attention(ParamTree):
    """Every map of the layer's input (``wq_a``, ``wkv``, and the compressors' and indexer's) runs as
    one matmul over a fused weight; each map keeps its checkpoint key and a view of its rows."""

    def __init__(self, config: ModelConfig, layer_type: str, dtype: torch.dtype, device) -> None:
        super().__init__(device)
        c = config
        self.layer_type = layer_type
        self.heads, self.head_dim, self.groups = c.num_attention_heads, c.head_dim, c.o_groups
        self.eps = c.rms_norm_eps
        hd = c.num_attention_heads * c.head_dim
        self.q_norm = self.param("q_norm.weight", (c.q_lora_rank,), torch.float32)
        self.wq_b = self.param("wq_b.weight", (hd, c.q_lora_rank), dtype)
        self.kv_norm = self.param("norm.weight", (c.head_dim,), torch.float32)
        self.wo_a = self.param("wo_a.weight", (c.o_groups * c.o_lora_rank, hd // c.o_groups), dtype)
        self.wo_b = self.param("wo_b.weight", (c.hidden_size, c.o_groups * c.o_lora_rank), dtype)
        self.sinks = self.param("attn_sink", (c.num_attention_heads,), torch.float32)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if layer_type in (CSA, HCA):
            ratio = c.compress_ratio(layer_type)
            self.compressor = self.child("compressor", Compressor(c.head_dim, ratio, layer_type == CSA, c.rms_norm_eps, dtype, device))
        if layer_type == CSA:
            self.indexer = self.child("indexer", Indexer(c, dtype, device))
        parts = [(self, "wq_a.weight", c.q_lora_rank), (self, "wkv.weight", c.head_dim)]
        parts += self.compressor.projection_parts() if self.compressor is not None else []
        parts += self.indexer.projection_parts() if self.indexer is not None else []
        self.proj_in = FusedProjection(c.hidden_size, parts, dtype, device)
        #: the rows of ``wq_a`` and ``wkv`` (views of the fused weight)
        self.wq_a, self.wkv = self._tensors["wq_a.weight"], self._tensors["wkv.weight"]

    def __call__(self, k: Kernels, x: torch.Tensor, meta: LayerMeta, cache: ModelCache, layer: int) -> torch.Tensor:
        t = x.shape[0]
        projected = self.proj_in(x)
        q_lat = k.rms_norm(projected[0], self.q_norm, self.eps)
        q = k.rms_norm((q_lat @ self.wq_b.t()).view(t, self.heads, self.head_dim), None, self.eps)
        q = k.rope(q, meta.cos, meta.sin)
        kv = k.rope(k.rms_norm(projected[1], self.kv_norm, self.eps), meta.cos, meta.sin)
        pool = cache.kv_pool(layer)
        k.cache_write(pool, meta.window_write, kv)
        rows = meta.window_rows
        if self.compressor is not None:
            self.compressor(k, projected[2], projected[3], meta, cache.state_pool(layer, COMPRESSOR), pool, meta.emit_kv_slot)
            extra = self.indexer(k, projected[4:], q_lat, meta, cache, layer) if self.indexer is not None else meta.visible_kv
            rows = torch.cat([rows, extra], dim=1)
        out = k.sparse_attention(q, pool, rows, self.sinks, self.head_dim**-0.5)
        out = k.rope(out, meta.cos, meta.sin, inverse=True)
        per_group = self.heads * self.head_dim // self.groups
        grouped = out.reshape(t, self.groups, per_group)
        w = self.wo_a.view(self.groups, -1, per_group)
        mixed = torch.einsum("tgi,gri->tgr", grouped, w).reshape(t, self.wo_b.shape[1])
        return mixed @ self.wo_b.t()

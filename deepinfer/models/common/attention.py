"""DeepSeek-V4 attention: low-rank q, one shared K=V head, sinks, grouped output.

Every layer attends over its sliding window of raw K=V rows; CSA layers add the
compressed entries the lightning indexer picks, HCA layers every compressed
entry already complete. Linear weights are held as the ``QuantPlan`` says
(plain, or FP8 codes with block scales).
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels, KVFormat, QuantizedWeight

from .cache import COMPRESSOR, INDEXER, ModelCache
from .compressor import Compressor
from .config import CSA, HCA, ModelConfig
from .linear import PLAIN, FusedProjection, ProjectionPart, QuantPlan, linear, linear_param
from .metadata import LayerMeta
from .params import ParamTree


class Indexer(ParamTree):
    """The lightning indexer: scores compressed entries per query, keeps the top k.

    ``weights_proj`` and its compressor's projections read the layer's input:
    they are parts of the attention's fused input projection (``projection_parts``).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, plan: QuantPlan, role: str) -> None:
        super().__init__(device)
        c = config
        self.role = role
        self.plan = plan
        self.heads, self.dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.wq_b = linear_param(self, "wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, dtype, plan.storage(f"{role}.wq_b"))
        self.compressor = self.child(
            "compressor",
            Compressor(c.index_head_dim, c.compress_ratio(CSA), True, c.rms_norm_eps, dtype, device, plan, f"{role}.compressor"),
        )

    def projection_parts(self) -> list[ProjectionPart]:
        weights = ProjectionPart(self, "weights_proj", self.heads, self.plan.storage(f"{self.role}.weights_proj"))
        return [weights, *self.compressor.projection_parts()]

    def __call__(
        self, k: Kernels, projected: list[torch.Tensor], q_lat: torch.Tensor, meta: LayerMeta, cache: ModelCache, layer: int
    ) -> torch.Tensor:
        """``[T, min(topk, N)]`` kv-pool rows of the chosen entries (-1: none; ``[T, topk]`` in batch-invariant
        mode, so the attention's width does not follow the longest context in the step); ``projected`` is
        this step's ``weights_proj``, compressor kv and gate outputs."""
        head_weights, kv, gate = projected
        keys = cache.index_pool(layer)
        rotate = cache.formats.index_rotate
        self.compressor(k, kv, gate, meta, cache.state_pool(layer, INDEXER), keys, meta.emit_index_slot, rotate)
        q = linear(k, q_lat, self.wq_b).view(q_lat.shape[0], self.heads, self.dim)
        q = round_as_cached(k, k.rope(q, meta.cos, meta.sin), cache.formats.index, rotate)
        picks = k.indexer_topk(q, head_weights * self.heads**-0.5, keys, meta.seq_index, meta.token_seq, meta.visible,
                               self.dim**-0.5, self.topk if k.batch_invariant else min(self.topk, meta.entries))
        return meta.entry_rows(picks)


class LatentAttention(ParamTree):
    """What every DeepSeek V4 / V4.1 attention holds: the low-rank q's norm and up-projection, the K=V
    latent's norm, the sinks and the grouped output projection; and the attention over pool rows."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, plan: QuantPlan, role: str) -> None:
        super().__init__(device)
        c = config
        self.heads, self.head_dim, self.groups = c.num_attention_heads, c.head_dim, c.o_groups
        self.eps = c.rms_norm_eps
        hd = c.num_attention_heads * c.head_dim
        self.q_norm = self.param("q_norm.weight", (c.q_lora_rank,), torch.float32)
        self.wq_b = linear_param(self, "wq_b", hd, c.q_lora_rank, dtype, plan.storage(f"{role}.wq_b"))
        self.kv_norm = self.param("norm.weight", (c.head_dim,), torch.float32)
        wo_a = plan.storage(f"{role}.wo_a")
        if wo_a.quantized and c.o_groups > 1 and c.o_lora_rank % wo_a.block[0]:
            wo_a = PLAIN  # its groups would split scale blocks: held plain
        self.wo_a = linear_param(self, "wo_a", c.o_groups * c.o_lora_rank, hd // c.o_groups, dtype, wo_a)
        self.wo_b = linear_param(self, "wo_b", c.hidden_size, c.o_groups * c.o_lora_rank, dtype, plan.storage(f"{role}.wo_b"))
        self.sinks = self.param("attn_sink", (c.num_attention_heads,), torch.float32)

    def attend(
        self, k: Kernels, q: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, meta: LayerMeta, every_entry: bool = False
    ) -> torch.Tensor:
        """``[T, D]``: the heads' attention over ``rows`` of ``pool`` (and, with ``every_entry``, over every
        compressed entry each token sees, in tiles), un-rotated, through the grouped output."""
        t = q.shape[0]
        if every_entry:
            out = k.entry_attention(q, pool, rows, meta.seq_kv, meta.token_seq, meta.visible, self.sinks, self.head_dim**-0.5)
        else:
            out = k.sparse_attention(q, pool, rows, self.sinks, self.head_dim**-0.5)
        out = k.rope(out, meta.cos, meta.sin, inverse=True)
        grouped = out.reshape(t, self.groups, self.heads * self.head_dim // self.groups)
        return linear(k, grouped_output(k, grouped, self.wo_a, self.groups), self.wo_b)


class Attention(LatentAttention):
    """Every map of the layer's input (``wq_a``, ``wkv``, and the compressors' and indexer's) runs in as
    few matmuls as their storage allows; each map keeps its checkpoint key and a view of its rows."""

    def __init__(self, config: ModelConfig, layer_type: str, dtype: torch.dtype, device, plan: QuantPlan, role: str = "attn") -> None:
        super().__init__(config, dtype, device, plan, role)
        c = config
        self.layer_type = layer_type
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if layer_type in (CSA, HCA):
            ratio = c.compress_ratio(layer_type)
            self.compressor = self.child(
                "compressor", Compressor(c.head_dim, ratio, layer_type == CSA, c.rms_norm_eps, dtype, device, plan, f"{role}.compressor")
            )
        if layer_type == CSA:
            self.indexer = self.child("indexer", Indexer(c, dtype, device, plan, f"{role}.indexer"))
        parts = [
            ProjectionPart(self, "wq_a", c.q_lora_rank, plan.storage(f"{role}.wq_a")),
            ProjectionPart(self, "wkv", c.head_dim, plan.storage(f"{role}.wkv")),
        ]
        parts += self.compressor.projection_parts() if self.compressor is not None else []
        parts += self.indexer.projection_parts() if self.indexer is not None else []
        self.proj_in = FusedProjection(c.hidden_size, parts, dtype, device)
        #: the weights of ``wq_a`` and ``wkv`` (views of the fused ones)
        self.wq_a, self.wkv = self.proj_in.parts[0], self.proj_in.parts[1]

    def __call__(self, k: Kernels, x: torch.Tensor, meta: LayerMeta, cache: ModelCache, layer: int) -> torch.Tensor:
        t = x.shape[0]
        projected = self.proj_in(k, x)
        q_lat = k.rms_norm(projected[0], self.q_norm, self.eps)
        q = k.rms_norm(linear(k, q_lat, self.wq_b).view(t, self.heads, self.head_dim), None, self.eps)
        q = k.rope(q, meta.cos, meta.sin)
        kv = k.rope(k.rms_norm(projected[1], self.kv_norm, self.eps), meta.cos, meta.sin)
        pool = cache.kv_pool(layer)
        k.cache_write(pool, meta.window_write, kv)
        rows = meta.window_rows
        if self.compressor is not None:
            self.compressor(k, projected[2], projected[3], meta, cache.state_pool(layer, COMPRESSOR), pool, meta.emit_kv_slot)
            if self.indexer is None:  # heavily compressed: every entry, in tiles
                return self.attend(k, q, pool, rows, meta, every_entry=True)
            rows = torch.cat([rows, self.indexer(k, projected[4:], q_lat, meta, cache, layer)], dim=1)
        return self.attend(k, q, pool, rows, meta)


def round_as_cached(k: Kernels, x: torch.Tensor, fmt: KVFormat | None, rotate: bool = False) -> torch.Tensor:
    """``x`` ``[..., d]`` rounded as the cache rounds the rows it is scored against (``fmt``; None: as is),
    Walsh–Hadamard-rotated first with ``rotate``: the indexer's queries as the models were trained."""
    if fmt is None:
        return x
    if rotate:
        x = k.hadamard(x)
    flat = x.reshape(-1, x.shape[-1])
    return k.kv_unpack(k.kv_pack(flat, fmt), fmt, x.dtype).view(x.shape)


def grouped_output(k: Kernels, grouped: torch.Tensor, wo_a, groups: int) -> torch.Tensor:
    """``[T, G·R]``: each group ``g`` of ``grouped`` ``[T, G, per_group]`` times its ``R`` rows of ``wo_a``."""
    t = grouped.shape[0]
    if isinstance(wo_a, QuantizedWeight):
        rows = wo_a.shape[0] // groups
        return torch.cat([linear(k, grouped[:, g], wo_a.rows(g * rows, (g + 1) * rows)) for g in range(groups)], dim=-1)
    w = wo_a.view(groups, -1, grouped.shape[-1])
    if k.batch_invariant:  # one row-tiled product per group: a token's result then has one shape whatever the batch
        return torch.cat([k.linear(grouped[:, g], w[g]) for g in range(groups)], dim=-1)
    return torch.einsum("tgi,gri->tgr", grouped, w).reshape(t, wo_a.shape[0])

"""One DeepSeek V4.1 decoder layer: Engram injection, then attention and MoE in hyper-connections.

V4.1 computes each site's mixes from one projection of the streams, but the
``pre`` weights a site computes collapse the streams for the *next* site: the
attention input is collapsed with the previous layer's FFN ``pre`` (one-hot on
stream 0 before the first layer) and the FFN input with this layer's attention
``pre``; the layer hands its FFN ``pre`` on.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from .attention import SharedAttention, SharedIndices
from ..common.cache import ModelCache
from .cache import v41_kind
from ..common.config import ModelConfig
from .text_config import V41Layer
from .engram import TABLE_STORAGE, Engram, EngramTable
from ..common.layer import HyperConnection
from ..common.linear import QuantPlan, Storage
from ..common.metadata import LayerMeta
from ..common.moe import ExpertSharding, MoE
from ..common.params import ParamTree


class DecoderLayerV41(ParamTree):
    def __init__(
        self, config: ModelConfig, layer: V41Layer, dtype: torch.dtype, device, plan: QuantPlan,
        sharding: ExpertSharding | None = None, table: EngramTable | None = None, table_storage: Storage = TABLE_STORAGE,
    ) -> None:
        """``table``: this layer's Engram table, memory-mapped (None: held as parameters the loader fills, as
        ``table_storage``)."""
        super().__init__(device)
        self.index = layer.index
        self.role = layer
        #: this layer's cache kind (its metadata's key)
        self.layer_type = v41_kind(layer)
        self.eps = config.rms_norm_eps
        self.attn = self.child("attn", SharedAttention(config, layer, dtype, device, plan))
        self.ffn = self.child("ffn", MoE(config, False, dtype, device, plan, sharding=sharding, layer=layer.index))
        self.attn_norm = self.param("attn_norm.weight", (config.hidden_size,), torch.float32)
        self.ffn_norm = self.param("ffn_norm.weight", (config.hidden_size,), torch.float32)
        self.hc_attn = HyperConnection(self, "attn", config)
        self.hc_ffn = HyperConnection(self, "ffn", config)
        self.engram: Engram | None = None
        if layer.engram_table is not None:
            self.engram = self.child("engram", Engram(
                config.text, layer.index, dtype, device, table=table, wkv_storage=plan.storage("engram.wkv"),
                table_storage=table_storage,
            ))

    def __call__(
        self, k: Kernels, streams: torch.Tensor, pre: torch.Tensor, input_ids: torch.Tensor, meta: LayerMeta,
        cache: ModelCache, shared: SharedIndices, hash_ids: dict[int, torch.Tensor], image: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, hc_mult, D]`` streams and the previous site's ``[T, hc_mult]`` pre in; the same out. ``image``
        ``[T]`` bool marks image positions: Engram adds nothing there and the router uses ``bias_vl``."""
        if self.engram is not None:
            injected = self.engram(k, streams, hash_ids[self.index])
            streams = injected if image is None else torch.where(image[:, None, None], streams, injected)
        attn_pre, post, comb = self.hc_attn.mix(k, streams)
        x = k.mhc_collapse(streams, pre)
        y = self.attn(k, k.rms_norm(x, self.attn_norm, self.eps), meta, cache, shared)
        streams = k.mhc_post(y, streams, post, comb)
        ffn_pre, post, comb = self.hc_ffn.mix(k, streams)
        x = k.mhc_collapse(streams, attn_pre)
        y = self.ffn(k, k.rms_norm(x, self.ffn_norm, self.eps), input_ids, image)
        return k.mhc_post(y, streams, post, comb), ffn_pre

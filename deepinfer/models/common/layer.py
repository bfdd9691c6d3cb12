"""One decoder layer: attention and MoE, each wrapped in a hyper-connection."""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from .attention import Attention
from .cache import ModelCache
from .config import ModelConfig
from .linear import QuantPlan
from .metadata import LayerMeta
from .moe import ExpertSharding, MoE
from .params import ParamTree


class HyperConnection:
    """The ``fn``/``base``/``scale`` of one mHC site (tensors owned by the layer's tree)."""

    def __init__(self, tree: ParamTree, site: str, config: ModelConfig) -> None:
        n, d = config.hc_mult, config.hidden_size
        self.fn = tree.param(f"hc_{site}_fn", ((2 + n) * n, n * d), torch.float32)
        self.base = tree.param(f"hc_{site}_base", ((2 + n) * n,), torch.float32)
        self.scale = tree.param(f"hc_{site}_scale", (3,), torch.float32)
        self.norm_eps, self.hc_eps, self.iters = config.rms_norm_eps, config.hc_eps, config.hc_sinkhorn_iters

    def pre(self, k: Kernels, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return k.mhc_pre(streams, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters)

    def mix(self, k: Kernels, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pre, post, comb)`` without the collapse (V4.1: the next site collapses with this ``pre``)."""
        return k.mhc_mix(streams, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters)


class DecoderLayer(ParamTree):
    def __init__(
        self, config: ModelConfig, index: int, dtype: torch.dtype, device, plan: QuantPlan | None = None,
        sharding: ExpertSharding | None = None,
    ) -> None:
        super().__init__(device)
        plan = plan or QuantPlan()
        self.index = index
        self.layer_type = config.layer_types[index]
        self.eps = config.rms_norm_eps
        self.attn = self.child("attn", Attention(config, self.layer_type, dtype, device, plan))
        self.ffn = self.child("ffn", MoE(
            config, config.mlp_layer_types[index] == "hash_moe", dtype, device, plan, sharding=sharding, layer=index
        ))
        self.attn_norm = self.param("attn_norm.weight", (config.hidden_size,), torch.float32)
        self.ffn_norm = self.param("ffn_norm.weight", (config.hidden_size,), torch.float32)
        self.hc_attn = HyperConnection(self, "attn", config)
        self.hc_ffn = HyperConnection(self, "ffn", config)

    def __call__(self, k: Kernels, streams: torch.Tensor, input_ids: torch.Tensor, meta: LayerMeta, cache: ModelCache) -> torch.Tensor:
        """``[T, hc_mult, D]`` streams in, the same shape out."""
        x, post, comb = self.hc_attn.pre(k, streams)
        y = self.attn(k, k.rms_norm(x, self.attn_norm, self.eps), meta, cache, self.index)
        streams = k.mhc_post(y, streams, post, comb)
        x, post, comb = self.hc_ffn.pre(k, streams)
        y = self.ffn(k, k.rms_norm(x, self.ffn_norm, self.eps), input_ids)
        return k.mhc_post(y, streams, post, comb)

"""The MoE block: learned or hash routing, routed clamped-SwiGLU experts, one shared expert."""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from .config import ModelConfig
from .params import FusedProjection, ParamTree


class MoE(ParamTree):
    """Experts are stored stacked (``w13`` ``[E, 2I, D]``, ``w2`` ``[E, D, I]``) and
    exposed per expert under the checkpoint's ``experts.{e}.w1/w3/w2`` keys as views.
    The router and the shared expert's gate and up maps read the same input and
    run as one matmul over a fused weight (each keeps its key and a view)."""

    def __init__(self, config: ModelConfig, hash_routed: bool, dtype: torch.dtype, device) -> None:
        super().__init__(device)
        c = config
        e, i, d = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.hash_routed = hash_routed
        self.top_k = c.num_experts_per_tok
        self.scaling = c.routed_scaling_factor
        self.scoring = c.scoring_func
        self.limit = c.swiglu_limit
        self.bias: torch.Tensor | None = None
        self.tid2eid: torch.Tensor | None = None
        if hash_routed:
            self.tid2eid = self.param("gate.tid2eid", (c.vocab_size, c.num_experts_per_tok), torch.int64)
        else:
            self.bias = self.param("gate.bias", (e,), torch.float32)
        self.w13 = torch.empty(e, 2 * i, d, dtype=dtype, device=self.device)
        self.w2 = torch.empty(e, d, i, dtype=dtype, device=self.device)
        for x in range(e):
            self.alias(f"experts.{x}.w1.weight", self.w13[x, :i])
            self.alias(f"experts.{x}.w3.weight", self.w13[x, i:])
            self.alias(f"experts.{x}.w2.weight", self.w2[x])
        self.proj_in = FusedProjection(
            d, [(self, "gate.weight", e), (self, "shared_experts.w1.weight", i), (self, "shared_experts.w3.weight", i)], dtype, device
        )
        self.shared_w2 = self.param("shared_experts.w2.weight", (d, i), dtype)

    def __call__(self, k: Kernels, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        logits, shared_gate, shared_up = self.proj_in(x)
        # transformers' V4 router always renormalises the chosen weights (norm_topk_prob is not read)
        if self.hash_routed:
            weights, ids = k.hash_route(logits, input_ids, self.tid2eid, self.scaling, self.scoring, True)
        else:
            weights, ids = k.moe_route(logits, self.bias, self.top_k, self.scaling, self.scoring, True)
        routed = k.moe_experts(x, ids, weights, self.w13, self.w2, self.limit)
        shared = k.swiglu(shared_gate, shared_up, self.limit) @ self.shared_w2.t()
        return routed + shared

"""The MoE block: learned or hash routing, routed clamped-SwiGLU experts, one shared expert."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from deepinfer_interfaces import Kernels, QuantizedWeight

from .config import ModelConfig
from .linear import EXPERTS, PLAIN, FusedProjection, ProjectionPart, QuantPlan, linear, linear_param, quantized_param
from .params import ParamTree


#: the local experts' clamped SwiGLU over received rows: ``(hidden, local topk_ids, topk_weights) -> [R, D]``
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertSharding(Protocol):
    """Where a layer's routed experts live under expert parallelism, and how tokens reach them."""

    def local_experts(self, layer: int) -> list[int]:
        """The logical expert held in each of this rank's expert slots of ``layer``."""

    def begin_forward(self, positions: torch.Tensor, live: torch.Tensor) -> None:
        """The step's token positions ``[T]`` (on the device: they spread tokens over an expert's replicas)
        and which of its rows are real tokens (``[T]`` bool; padding rows reach no expert)."""

    def routed(
        self, layer: int, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, compute: ExpertCompute
    ) -> torch.Tensor:
        """``[T, D]``: the weighted expert outputs of this rank's tokens, wherever their experts are."""


class MoE(ParamTree):
    """Experts are stored stacked (``w13`` ``[E, 2I, D]``, ``w2`` ``[E, D, I]``), plain or quantized as
    the plan says, and exposed per expert under the checkpoint's ``experts.{e}.w1/w3/w2`` keys as views.
    The router and the shared expert's gate and up maps read the same input and run in as few matmuls
    as their storage allows (each keeps its key and a view)."""

    def __init__(
        self,
        config: ModelConfig,
        hash_routed: bool,
        dtype: torch.dtype,
        device,
        plan: QuantPlan,
        role: str = "ffn",
        sharding: ExpertSharding | None = None,
        layer: int = 0,
    ) -> None:
        super().__init__(device)
        c = config
        i, d = c.moe_intermediate_size, c.hidden_size
        self.sharding = sharding
        self.layer = layer
        #: the logical expert in each slot of the stacks (every expert, in order, without sharding)
        self.slots = sharding.local_experts(layer) if sharding is not None else list(range(c.n_routed_experts))
        e = c.n_routed_experts
        self.hash_routed = hash_routed
        self.top_k = c.num_experts_per_tok
        self.scaling = c.routed_scaling_factor
        self.scoring = c.scoring_func
        self.limit = c.swiglu_limit
        self.gate_temp = c.gate_temp
        self.renormalize = c.renormalize_topk
        self.bias: torch.Tensor | None = None
        self.tid2eid: torch.Tensor | None = None
        if hash_routed:
            self.tid2eid = self.param("gate.tid2eid", (c.vocab_size, c.num_experts_per_tok), torch.int64)
        else:
            self.bias = self.param("gate.bias", (e,), torch.float32)
        #: the router bias for image positions (a vision-language checkpoint's ``gate.bias_vl``), else None
        self.bias_vl: torch.Tensor | None = None
        if c.router_image_bias:
            self.bias_vl = self.param("gate.bias_vl", (e,), torch.float32)
        experts = plan.storage(EXPERTS)
        if experts.quantized and i % experts.block[0]:
            experts = PLAIN  # w1 and w3 would share a block of w13's rows: held plain
        self.w13, self.w2 = self._experts(len(self.slots), i, d, dtype, experts)
        self.proj_in = FusedProjection(d, [
            ProjectionPart(self, "gate", e, plan.storage(f"{role}.gate")),
            ProjectionPart(self, "shared_experts.w1", i, plan.storage(f"{role}.shared_experts.w1")),
            ProjectionPart(self, "shared_experts.w3", i, plan.storage(f"{role}.shared_experts.w3")),
        ], dtype, device)
        self.shared_w2 = linear_param(self, "shared_experts.w2", d, i, dtype, plan.storage(f"{role}.shared_experts.w2"))

    def _experts(self, e: int, i: int, d: int, dtype: torch.dtype, storage):
        """Stacked ``w13`` and ``w2``, with each expert's ``w1``/``w3``/``w2`` (and scales) as views of the
        first slot holding it (``fill_replicas`` copies it into the others)."""
        first = {expert: x for x, expert in reversed(list(enumerate(self.slots)))}
        if not storage.quantized:
            w13 = torch.empty(e, 2 * i, d, dtype=dtype, device=self.device)
            w2 = torch.empty(e, d, i, dtype=dtype, device=self.device)
            for expert, x in sorted(first.items()):
                self.alias(f"experts.{expert}.w1.weight", w13[x, :i])
                self.alias(f"experts.{expert}.w3.weight", w13[x, i:])
                self.alias(f"experts.{expert}.w2.weight", w2[x])
            return w13, w2
        stack = ParamTree(self.device)
        w13 = quantized_param(stack, "w13", (e, 2 * i, d), storage)
        w2 = quantized_param(stack, "w2", (e, d, i), storage)
        for expert, x in sorted(first.items()):
            for name, view in (("w1", w13.rows(0, i)), ("w3", w13.rows(i, 2 * i)), ("w2", w2)):
                self.alias(f"experts.{expert}.{name}.weight", view.codes[x])
                self.alias(f"experts.{expert}.{name}.scale", view.scales[x])
        return w13, w2

    def expert_tensors(self) -> list[torch.Tensor]:
        """The stacked expert tensors, slot first: what moves when an expert changes rank."""
        out = []
        for w in (self.w13, self.w2):
            out.extend((w.codes, w.scales) if isinstance(w, QuantizedWeight) else (w,))
        return out

    def fill_replicas(self) -> None:
        """Copy each expert loaded into its first slot into the other slots holding it."""
        first: dict[int, int] = {}
        for x, expert in enumerate(self.slots):
            src = first.setdefault(expert, x)
            if src != x:
                for t in self.expert_tensors():
                    t[x].copy_(t[src])

    def _image_route(
        self, k: Kernels, logits: torch.Tensor, image: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The text choice where ``image`` is False, the choice under ``bias_vl`` where it is True (a hash-routed
        layer's image rows too: an image position has no token id to look up). Both are computed and one is
        picked per row, on the device: no read-back, the same on every rank."""
        w_vl, ids_vl = k.moe_route(logits, self.bias_vl, self.top_k, self.scaling, self.scoring, self.renormalize)
        pick = image[:, None]
        return torch.where(pick, w_vl.to(weights.dtype), weights), torch.where(pick, ids_vl, ids)

    def _experts_out(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, k: Kernels) -> torch.Tensor:
        if isinstance(self.w13, QuantizedWeight):
            return k.moe_experts_quantized(hidden, ids, weights, self.w13, self.w2, self.limit)
        return k.moe_experts(hidden, ids, weights, self.w13, self.w2, self.limit)

    def join(self, k: Kernels, x: torch.Tensor) -> None:
        """Take part in this layer's dispatch and combine without tokens of its own (an idle rank under EP)."""
        top = self.top_k
        ids = torch.empty(0, top, dtype=torch.int64, device=x.device)
        weights = torch.empty(0, top, dtype=torch.float32, device=x.device)
        self.sharding.routed(self.layer, x[:0], ids, weights, lambda h, i, w: self._experts_out(h, i, w, k))

    def __call__(self, k: Kernels, x: torch.Tensor, input_ids: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """``image`` ``[T]`` bool: the rows at image positions, which choose their experts with ``bias_vl``
        (None: a step without images)."""
        logits, shared_gate, shared_up = self.proj_in(k, x)
        if self.gate_temp != 1.0:
            logits = logits / self.gate_temp
        if self.hash_routed:
            weights, ids = k.hash_route(logits, input_ids, self.tid2eid, self.scaling, self.scoring, self.renormalize)
        else:
            weights, ids = k.moe_route(logits, self.bias, self.top_k, self.scaling, self.scoring, self.renormalize)
        if image is not None and self.bias_vl is not None:
            weights, ids = self._image_route(k, logits, image, weights, ids)
        if self.sharding is not None:
            routed = self.sharding.routed(self.layer, x, ids, weights, lambda h, i, w: self._experts_out(h, i, w, k))
        else:
            routed = self._experts_out(x, ids, weights, k)
        shared = linear(k, k.swiglu(shared_gate, shared_up, self.limit), self.shared_w2)
        return routed + shared

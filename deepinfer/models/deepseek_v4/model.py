"""The DeepSeek-V4 causal LM, built from ``Kernels`` ops over a flattened batch."""

from __future__ import annotations

import torch

from deepinfer_interfaces import Kernels

from ..common.cache import ModelCache
from ..common.causal_lm import CausalLM
from ..common.dspark import DSparkDraft
from ..common.inputs import ForwardInputs
from ..common.layer import DecoderLayer
from ..common.linear import QuantPlan
from ..common.metadata import build_layer_metas
from ..common.moe import ExpertSharding
from .config import DeepseekV4Config


class DeepseekV4Model(CausalLM):
    """Parameters (named as the checkpoint's keys) and the forward step.

    Weights in ``dtype`` except those V4 keeps in fp32 (norms, hyper-connections,
    sinks, compressor position biases, router correction bias) and those the
    ``plan`` keeps quantized (FP8 / FP4 codes with block scales, as the
    checkpoint stores them); ``tid2eid`` is int64. Parameters are allocated
    uninitialised: load them with ``load_weights(model.named_parameters(), dir)``
    or use ``from_pretrained``.
    With ``sharding`` (expert parallelism) each MoE layer holds only this
    rank's expert slots and reaches the others through the sharding's
    dispatch and combine; ``from_pretrained`` then reads only this rank's
    experts from the checkpoint.
    """

    config_class = DeepseekV4Config
    draft_class = DSparkDraft

    def __init__(
        self,
        config: DeepseekV4Config,
        kernels: Kernels,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        plan: QuantPlan | None = None,
        sharding: ExpertSharding | None = None,
    ) -> None:
        super().__init__(config, kernels, dtype=dtype, device=device, plan=plan, sharding=sharding)
        c, body = config, self.body
        n, d = c.hc_mult, c.hidden_size
        self.layers = [DecoderLayer(c, i, dtype, device, self.plan, sharding) for i in range(c.num_hidden_layers)]
        for i, layer in enumerate(self.layers):
            body.child(f"layers.{i}", layer)
        self.norm = body.param("norm.weight", (d,), torch.float32)
        self.hc_fn = body.param("hc_head.hc_fn", (n, n * d), torch.float32)
        self.hc_base = body.param("hc_head.hc_base", (n,), torch.float32)
        self.hc_scale = body.param("hc_head.hc_scale", (1,), torch.float32)

    def forward(self, inputs: ForwardInputs, cache: ModelCache, hidden_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """Run one step: write every layer's state for the step's tokens into
        ``cache`` and return ``[L, vocab]`` logits (``inputs.logits_indices``) in
        the model dtype. Reads only device tensors of static shape and never
        waits for the host, so it can be captured as a graph (callers run it
        without autograd: ``torch.no_grad`` or ``torch.inference_mode``, the
        latter not under ``torch.compile``). For each layer
        index in ``hidden_layers`` (the DSpark draft's target layers),
        ``self.hidden_states[i]`` is set to ``[T, D]``: the mean of that
        layer's output streams for every token."""
        k = self.kernels
        c = self.config
        metas = build_layer_metas(inputs, cache.geometry, self.rope_main, self.rope_compress)
        if self.sharding is not None:
            self.sharding.begin_forward(inputs.positions, inputs.live)
        x = self.embed[inputs.input_ids]
        streams = x[:, None, :].expand(-1, c.hc_mult, -1).contiguous()
        self.hidden_states = {}
        for layer in self.layers:
            streams = layer(k, streams, inputs.input_ids, metas[layer.layer_type], cache)
            if layer.index in hidden_layers:
                self.hidden_states[layer.index] = streams.mean(dim=1)
        rows = streams[inputs.logits_indices]
        h = k.mhc_head(rows, self.hc_fn, self.hc_base, self.hc_scale, c.rms_norm_eps, c.hc_eps)
        h = k.rms_norm(h, self.norm, c.rms_norm_eps)
        return k.linear(h, self.head)

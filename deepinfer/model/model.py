"""The DeepSeek-V4 causal LM, built from ``Kernels`` ops over a flattened batch, and what V4.1 shares with it."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer_interfaces import Kernels

from ..errors import ConfigError
from .batch import Batch
from .cache import ModelCache
from .config import ModelConfig
from .inputs import ForwardInputs, step_inputs
from .layer import DecoderLayer
from .linear import QuantPlan, expert_of
from .metadata import build_layer_metas
from .moe import ExpertSharding
from .params import ParamTree
from .rope import Rotary


class CausalLM(ParamTree):
    """What every model of the family shares: loading, expert ownership, the idle rank's step and an
    eager call; subclasses build their layers and ``forward``."""

    def __init__(
        self,
        config: ModelConfig,
        kernels: Kernels,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        plan: QuantPlan | None = None,
        sharding: ExpertSharding | None = None,
    ) -> None:
        """The embedding, the head and the two rotary tables; subclasses add ``layers`` and the final norm
        under ``self.body`` (the ``model.`` tree)."""
        super().__init__(device)
        self.config = config
        self.kernels = kernels
        self.dtype = dtype
        self.sharding = sharding
        self.plan = plan or QuantPlan()
        c = config
        self.body = self.child("model", ParamTree(device))
        self.embed = self.body.param("embed_tokens.weight", (c.vocab_size, c.hidden_size), dtype)
        self.head = self.embed if c.tie_word_embeddings else self.param("head.weight", (c.vocab_size, c.hidden_size), dtype)
        self.rope_main = Rotary(c.rope_main, c.qk_rope_head_dim, c.max_position_embeddings, device)
        self.rope_compress = Rotary(c.rope_compress, c.qk_rope_head_dim, c.max_position_embeddings, device)
        self.layers: list = []
        #: checkpoint tensors kept aside by ``from_pretrained`` (the ``mtp.*`` draft layers)
        self.extra_tensors: dict[str, torch.Tensor] = {}
        #: per layer index asked for in ``forward(..., hidden_layers=...)``, its mean output stream ``[T, D]``
        self.hidden_states: dict[int, torch.Tensor] = {}

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        kernels: Kernels,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        quantization: str = "auto",
        sharding: ExpertSharding | None = None,
    ) -> "CausalLM":
        """Build from ``model_dir/config.json`` and load every checkpoint tensor.

        ``quantization="auto"`` keeps every weight the checkpoint stores quantized
        (codes with a block-scale companion) quantized; ``"dequantize"`` loads
        every weight in ``dtype``.
        """
        from ..loader import load_weights, read_checkpoint, read_config

        config = ModelConfig.from_hf(read_config(model_dir))
        if cls is CausalLM:  # the family member the checkpoint holds
            from .model_v41 import DeepseekV41Model

            cls = DeepseekV41Model if config.v41 is not None else DeepseekV4Model
        checkpoint = read_checkpoint(model_dir)
        if quantization == "auto":
            plan = QuantPlan.from_checkpoint(checkpoint.catalog, checkpoint.block)
        elif quantization == "dequantize":
            plan = QuantPlan()
        else:
            raise ConfigError(f"quantization {quantization!r} is not one of 'auto', 'dequantize'")
        model = cls(config, kernels, dtype=dtype, device=device, plan=plan, sharding=sharding,
                    **cls.checkpoint_kwargs(config, checkpoint))
        model.extra_tensors = load_weights(model.named_parameters(), checkpoint, keep_prefixes=("mtp.",), skip=model.not_loaded)
        for layer in model.layers:
            layer.ffn.fill_replicas()
        model.loaded(checkpoint)
        return model

    @classmethod
    def checkpoint_kwargs(cls, config: ModelConfig, checkpoint) -> dict:
        """Constructor arguments a model takes from the checkpoint itself (tensors it reads lazily)."""
        return {}

    def loaded(self, checkpoint) -> None:
        """Called once the checkpoint's tensors are in (a model that reads others lazily opens them here)."""

    def graph_blocker(self) -> str | None:
        """Why a step of this model cannot be captured as a graph on its device (None: it can)."""
        return None

    def not_loaded(self, name: str) -> bool:
        """True for a checkpoint tensor (model name) that loading leaves in the files: another rank's expert."""
        return self.sharding is not None and self.foreign_expert(name)

    def foreign_expert(self, name: str) -> bool:
        """True for a checkpoint tensor (model name) of a routed expert this rank does not hold."""
        where = expert_of(name)
        if where is None:
            return False
        layer, expert = where
        return layer < len(self.layers) and expert not in self.layers[layer].ffn.slots

    @torch.inference_mode()
    def join_step(self) -> None:
        """An idle rank's step under expert parallelism: every layer's dispatch and combine, no tokens."""
        x = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for layer in self.layers:
            layer.ffn.join(self.kernels, x)

    def forward(self, inputs: ForwardInputs, cache: ModelCache, hidden_layers: tuple[int, ...] = ()) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def __call__(self, batch: Batch, cache: ModelCache, hidden_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """One eager step from a host ``Batch`` (its inputs built unpadded and copied to the device)."""
        cache.begin_forward(batch)
        return self.forward(step_inputs(batch, cache, self.device), cache, hidden_layers)


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

    def __init__(
        self,
        config: ModelConfig,
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
        return h @ self.head.t()

"""What every model family's causal LM shares: loading, expert ownership, the idle rank's step, an eager call."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from deepinfer_interfaces import Device, Kernels

from ...errors import ConfigError
from .batch import Batch
from .cache import ModelCache
from .config import ModelConfig
from .inputs import ForwardInputs, step_inputs
from .linear import QuantPlan, expert_of
from .moe import ExpertSharding
from .params import ParamTree
from .rope import Rotary


class CausalLM(ParamTree):
    """What every model shares: loading, expert ownership, the idle rank's step and an eager call; a
    family's subclass names its config and draft classes, builds its layers and ``forward``."""

    #: the family's config class (parses its ``config.json``)
    config_class: ClassVar[type[ModelConfig]] = ModelConfig
    #: the family's DSpark draft network (None: the family has none)
    draft_class: ClassVar[type | None] = None

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
        from ...loader import load_weights, read_checkpoint, read_config

        if cls is CausalLM:
            raise TypeError("CausalLM is the shared base; load a checkpoint with deepinfer.models.registry.load_model")
        config = cls.config_class.from_hf(read_config(model_dir))
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

    @classmethod
    def inventory_kwargs(cls, quantized: bool) -> dict:
        """Constructor arguments that build the model on the meta device as its checkpoint stores it
        (``quantized``) or dequantized, for ``deepinfer inspect``."""
        return {}

    def inventory_part(self, name: str) -> str:
        """The part of the weights a parameter counts in (``backbone`` unless a family keeps it apart)."""
        return "backbone"

    def image_blocker(self) -> str | None:
        """Why this model cannot read images (None: it encodes them with ``encode_images``)."""
        return f"the {self.config.model_type} model has no vision tower; send text only"

    def place_tables(self, device: Device, placement: str) -> str | None:
        """Put the tables a family keeps outside its parameters where ``placement`` asks (``EngineConfig.engram_tables``)
        on ``device``; a line for the log, or None where the family has none."""
        return None

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
        """One step over device inputs: ``[L, vocab]`` logits; each family's model defines it."""
        raise NotImplementedError(f"{type(self).__name__} defines no forward; a family's model class does")

    @torch.inference_mode()
    def __call__(self, batch: Batch, cache: ModelCache, hidden_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """One eager step from a host ``Batch`` (its inputs built unpadded and copied to the device)."""
        cache.begin_forward(batch)
        return self.forward(step_inputs(batch, cache, self.device), cache, hidden_layers)

"""Which model family a checkpoint holds, by its ``config.json``'s ``model_type`` (or ``architectures``).

The one place that knows every family: the loader reads files and names
tensors without importing any, shared model code names none, and the engine
asks here for the config, the model and the prompt rules of a checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from deepinfer_interfaces import Kernels

from ..errors import CheckpointError, ConfigError
from ..loader import read_config
from .common.causal_lm import CausalLM
from .common.config import ModelConfig
from .common.images import ImageReader
from .common.moe import ExpertSharding
from .deepseek_v4 import FAMILY as DEEPSEEK_V4
from .deepseek_v41 import FAMILY as DEEPSEEK_V41
from .family import ModelFamily

#: every family the engine runs
FAMILIES: tuple[ModelFamily, ...] = (DEEPSEEK_V4, DEEPSEEK_V41)
MODEL_TYPES: dict[str, ModelFamily] = {t: f for f in FAMILIES for t in f.model_types}
ARCHITECTURES: dict[str, ModelFamily] = {a: f for f in FAMILIES for a in f.architectures}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(MODEL_TYPES)


def family_named(model_type: str | None) -> ModelFamily | None:
    """The family of ``model_type``, or None when no family runs it."""
    return MODEL_TYPES.get(model_type) if model_type is not None else None


def family_of(raw: dict[str, Any]) -> ModelFamily | None:
    """The family a raw ``config.json`` mapping declares: by ``model_type``, else by its ``architectures``."""
    if raw.get("model_type") is not None:
        return family_named(raw["model_type"])
    for arch in raw.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    return None


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Parse a raw ``config.json`` mapping with its family's config class; an unknown or bad one raises a
    one-line ``ConfigError`` naming the field."""
    family = family_of(raw)
    if family is None:
        raise ConfigError(
            f"config.json has model_type {raw.get('model_type')!r}, which this engine does not run; "
            f"use a checkpoint with model_type {' or '.join(map(repr, SUPPORTED_MODEL_TYPES))}"
        )
    return family.config_class.from_hf({"model_type": family.model_types[0], **raw})


def family_for(model_dir: str | Path) -> ModelFamily:
    """The family of the checkpoint in ``model_dir``; an unknown ``model_type`` is a ``CheckpointError``."""
    raw = read_config(model_dir)
    family = family_of(raw)
    if family is None:
        raise CheckpointError(
            f"unknown model_type {raw.get('model_type')!r}: deepinfer runs {' and '.join(SUPPORTED_MODEL_TYPES)} checkpoints"
        )
    return family


def load_config(model_dir: str | Path) -> ModelConfig:
    """Read and parse ``model_dir/config.json`` with its family's config class."""
    family = family_for(model_dir)
    return family.config_class.from_hf({"model_type": family.model_types[0], **read_config(model_dir)})


def load_model(
    model_dir: str | Path,
    kernels: Kernels,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    quantization: str = "auto",
    sharding: ExpertSharding | None = None,
) -> CausalLM:
    """Build the checkpoint's family model and load its tensors (``CausalLM.from_pretrained``)."""
    model_class = family_for(model_dir).model_class
    return model_class.from_pretrained(model_dir, kernels, dtype=dtype, device=device, quantization=quantization, sharding=sharding)


def check_prompt(model_type: str, prompt: object) -> None:
    """Raise a one-line error for a prompt the model cannot read (e.g. images for a text-only family)."""
    family = family_named(model_type)
    if family is not None:
        family.check_prompt(prompt)


def image_reader(raw: Mapping[str, Any]) -> ImageReader | None:
    """The image reader of the checkpoint whose ``config.json`` is ``raw``: None for a text-only family (whose
    ``check_prompt`` refuses images); a checkpoint without a vision tower raises a one-line ``ConfigError``."""
    family = family_of(dict(raw))
    if family is None or family.image_reader is None:
        return None
    return family.image_reader(raw)


def chat_encoder(model_type: str | None) -> str | None:
    """The built-in chat encoder of ``model_type``'s family (None: none, or an unknown type)."""
    family = family_named(model_type)
    return family.chat_encoder if family is not None else None

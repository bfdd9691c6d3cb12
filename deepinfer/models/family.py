"""The small contract a model family offers the engine: its names, config, model and prompt rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from .common.causal_lm import CausalLM
    from .common.config import ModelConfig
    from .common.images import ImageReader


def any_prompt(prompt: object) -> None:
    """The prompt rule of a family that refuses nothing up front (its image reader decides about images)."""


@dataclass(frozen=True)
class ModelFamily:
    """One architecture: the ``model_type`` and ``architectures`` names its ``config.json`` carries, the
    config class that parses it (its cache geometry, replay length and draft fields), the model class that
    builds the network and its draft, what a prompt may hold, how its images are read and how chat
    messages become tokens."""

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    config_class: type["ModelConfig"]
    model_class: type["CausalLM"]
    #: raises a one-line error for a prompt the family cannot read (e.g. images, for a text-only family)
    check_prompt: Callable[[object], None] = any_prompt
    #: builds a checkpoint's image reader from its raw ``config.json`` (a one-line ``ConfigError`` when that
    #: checkpoint reads no images); None: the family is text-only
    image_reader: Callable[[Mapping[str, Any]], "ImageReader"] | None = None
    #: the built-in chat encoder for checkpoints without a chat template (``deepinfer.chat.formats``); None: none
    chat_encoder: str | None = None

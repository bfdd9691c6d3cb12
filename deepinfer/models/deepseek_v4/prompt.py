"""What a DeepSeek-V4 prompt may carry: text only (the model has no vision tower)."""

from __future__ import annotations

from ..common.prompt import refuse_images

IMAGES_REFUSAL = "images are not supported: DeepSeek-V4 is a text-only model; send text only"


def check_prompt(prompt: object) -> None:
    """Refuse a request that carries images."""
    refuse_images(prompt, IMAGES_REFUSAL)

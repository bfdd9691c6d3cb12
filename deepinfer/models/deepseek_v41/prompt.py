"""What a DeepSeek V4.1 prompt may carry: text only until its vision tower runs."""

from __future__ import annotations

from ..common.prompt import refuse_images

IMAGES_REFUSAL = "images are not supported yet: DeepSeek V4.1's vision tower is not implemented; send text only"


def check_prompt(prompt: object) -> None:
    """Refuse a request that carries images (a mapping with ``images`` / ``multi_modal_data``, or image content parts)."""
    refuse_images(prompt, IMAGES_REFUSAL)

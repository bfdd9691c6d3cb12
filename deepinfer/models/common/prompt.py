"""What a prompt may carry: text or token ids, and images only where a family reads them."""

from __future__ import annotations

from ...errors import ConfigError


def carries_images(prompt: object) -> bool:
    """True when ``prompt`` holds an image: a mapping with ``images`` / ``multi_modal_data``, or an image
    content part, at any depth of mappings and lists."""
    if isinstance(prompt, dict):
        if prompt.get("images") or prompt.get("multi_modal_data") or prompt.get("type") in ("image", "image_url"):
            return True
        return carries_images(prompt.get("content"))
    if isinstance(prompt, (list, tuple)):
        return any(carries_images(part) for part in prompt if isinstance(part, (dict, list, tuple)))
    return False


def refuse_images(prompt: object, reason: str) -> None:
    """Raise a one-line ``ConfigError`` (``reason``) when ``prompt`` carries an image."""
    if carries_images(prompt):
        raise ConfigError(reason)

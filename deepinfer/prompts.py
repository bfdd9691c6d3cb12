"""A prompt as callers pass it, turned into what the engine runs: token ids, with images expanded into spans.

Callers pass text, token ids, or vLLM's mappings ``{"prompt": text_or_ids}`` /
``{"prompt_token_ids": ids}``, which may add ``"multi_modal_data": {"image":
one image or a list}`` (each image a PIL image, bytes, a data URI or a file
path: ``image_input``). The checkpoint's family rules what a prompt may hold
(``check_prompt``) and, where it reads images, expands each placeholder token
into its image's span (``ImageReader``). This is the one place a prompt
becomes ``(token ids, image spans)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tokenizers import Tokenizer

from .errors import ConfigError
from .image_input import ImageLimits, image_list, load_images
from .models.common.images import ImageReader
from .models.registry import check_prompt, image_reader
from .multimodal import ImageSpan
from .sampling_params import InvalidRequestError

#: why a prompt with images is refused when the model reads none (a family's own reason wins)
NO_IMAGES = "this model reads no images; send text only"


@dataclass(frozen=True)
class EnginePrompt:
    """A prompt ready for the engine: its text (None when given as ids), its token ids (every image's span
    expanded) and its images' spans in prompt order."""

    text: str | None
    token_ids: list[int]
    images: tuple[ImageSpan, ...] = ()


def split_prompt(prompt: Any) -> tuple[str | list[int], list[Any]]:
    """A prompt's text or token ids, and the images its ``multi_modal_data`` carries (not yet decoded)."""
    sources: list[Any] = []
    if isinstance(prompt, Mapping):
        data = prompt.get("multi_modal_data") or {}
        if not isinstance(data, Mapping):
            raise InvalidRequestError(f"multi_modal_data is a mapping like {{'image': [...]}}, not {type(data).__name__}")
        other = sorted(set(data) - {"image"})
        if other:
            raise InvalidRequestError(f"multi_modal_data has {', '.join(map(repr, other))}; this engine reads 'image' only")
        if data.get("image") is not None:
            sources = image_list(data["image"])
        prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
    if isinstance(prompt, str):
        return prompt, sources
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt), sources
    raise InvalidRequestError(f"a prompt is text or a list of token ids, not {type(prompt).__name__}; pass a str or list[int]")


class PromptReader:
    """Reads prompts for one checkpoint: its tokenizer, its family's prompt rules and image reader, the image limits."""

    def __init__(self, tokenizer: Tokenizer, model_type: str, raw_config: Mapping[str, Any], limits: ImageLimits) -> None:
        self.tokenizer = tokenizer
        self.model_type = model_type
        self.limits = limits
        #: the checkpoint's image reader; None with ``no_images`` the reason a prompt with images is refused
        self.images: ImageReader | None = None
        self.no_images = NO_IMAGES
        try:
            self.images = image_reader(raw_config)
        except ConfigError as exc:
            self.no_images = str(exc)

    def read(self, prompt: Any) -> EnginePrompt:
        """The prompt's token ids and image spans; a bad prompt or image raises a one-line error."""
        check_prompt(self.model_type, prompt)
        body, sources = split_prompt(prompt)
        text = body if isinstance(body, str) else None
        ids = self.tokenizer.encode(body).ids if isinstance(body, str) else body
        if self.images is None:
            if sources:
                raise InvalidRequestError(self.no_images)
            return EnginePrompt(text, ids)
        ids, spans = self.images.expand(ids, load_images(sources, self.limits))
        return EnginePrompt(text, ids, spans)


def image_placeholder(raw_config: Mapping[str, Any], tokenizer: Tokenizer) -> str | None:
    """The text of the checkpoint's image placeholder token (what a chat format writes where an image
    goes); None when the checkpoint reads no images."""
    try:
        reader = image_reader(raw_config)
    except ConfigError:
        return None
    return tokenizer.id_to_token(reader.placeholder_id) if reader is not None else None

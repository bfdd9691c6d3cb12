"""What a family that reads images offers the engine: a reader that expands a prompt's image placeholders.

The prompt holds one placeholder token where each image goes; the reader
preprocesses each decoded image into an ``ImageSpan`` and replaces its
placeholder by the span's length of placeholder tokens, so every span position
holds the placeholder id and the span records where the image's rows go.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from ...image_input import ImageInputError
from ...multimodal import ImageSpan


class ImageReader(Protocol):
    """A checkpoint's image reader (``ModelFamily.image_reader`` builds it from ``config.json``)."""

    #: the token that marks an image in a prompt, and fills every position of its span
    placeholder_id: int

    def expand(self, token_ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The prompt with each placeholder expanded to its image's span, and the spans in prompt order."""
        ...

    def span_length(self, image: Any) -> int:
        """The span a decoded image takes in the prompt (its grid planned, no pixel touched)."""
        ...


def expand_placeholders(
    token_ids: Sequence[int], images: Sequence[Any], placeholder_id: int, span_of: Callable[[Any, int], ImageSpan],
) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """Replace the ``k``-th ``placeholder_id`` of ``token_ids`` by ``images[k]``'s span (``span_of(image,
    offset)``); the counts must match."""
    where = [i for i, t in enumerate(token_ids) if t == placeholder_id]
    if len(where) != len(images):
        raise ImageInputError(
            f"the prompt has {len(where)} image placeholders (token {placeholder_id}) but {len(images)} images; "
            "put one placeholder where each image goes"
        )
    out: list[int] = []
    spans: list[ImageSpan] = []
    last = 0
    for pos, image in zip(where, images):
        out.extend(token_ids[last:pos])
        span = span_of(image, len(out))
        spans.append(span)
        out.extend([placeholder_id] * span.length)
        last = pos + 1
    out.extend(token_ids[last:])
    return out, tuple(spans)

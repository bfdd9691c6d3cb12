"""Images in a prompt, as the engine carries them: where each image's span sits and what fills it.

A family that reads images (DeepSeek V4.1) turns a prompt's images into
``ImageSpan`` records when the request is added: each placeholder token is
expanded to the image's span (its start delimiter, ``llm_h`` rows of
``llm_w`` patch tokens each ended by a newline delimiter, its end delimiter),
and the image's preprocessed patches travel with the request. The engine
never looks inside a span: the scheduler keys cache blocks by the spans'
digests, the runner has the model encode each image once and splices the
rows into the step's embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: what each position of an image span holds (``ImageGrid.token_types``)
IMAGE_START, IMAGE_PATCH, IMAGE_NEWLINE, IMAGE_END = range(4)


@dataclass(frozen=True)
class ImageGrid:
    """One image's geometry after preprocessing: the ViT's patch grid and the language model's token grid."""

    #: patch rows and columns the ViT sees (the resized image is ``vit_h · p`` × ``vit_w · p`` pixels)
    vit_h: int
    vit_w: int
    #: token rows and columns after the aligner merges ``r × r`` patches (``ceil(vit / r)``)
    llm_h: int
    llm_w: int

    def __post_init__(self) -> None:
        if min(self.vit_h, self.vit_w, self.llm_h, self.llm_w) < 1:
            raise ValueError(f"an image grid is at least 1 × 1 everywhere; got {self}")

    @property
    def patches(self) -> int:
        return self.vit_h * self.vit_w

    @property
    def tokens(self) -> int:
        """Span length: start, ``llm_h`` rows of ``llm_w`` patch tokens and a newline, end."""
        return self.llm_h * (self.llm_w + 1) + 2

    def token_types(self) -> np.ndarray:
        """``[tokens]`` int8: ``IMAGE_START``, then per row ``IMAGE_PATCH`` × ``llm_w`` and ``IMAGE_NEWLINE``, then ``IMAGE_END``."""
        row = np.full(self.llm_w + 1, IMAGE_PATCH, dtype=np.int8)
        row[-1] = IMAGE_NEWLINE
        return np.concatenate([[IMAGE_START], np.tile(row, self.llm_h), [IMAGE_END]]).astype(np.int8)


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a request's prompt, preprocessed, and the prompt positions it fills."""

    #: prompt position of the span's first token (its start delimiter)
    offset: int
    grid: ImageGrid
    #: ``[grid.patches, 3 · p · p]`` float32: the normalised pixels, patch by patch in row-major order,
    #: each patch channel-major (``[3, p, p]`` flattened)
    patches: torch.Tensor
    #: sha256 of the preprocessed image (grid and patches): its identity in block hashes and the encoder cache
    digest: bytes

    def __post_init__(self) -> None:
        if self.patches.dim() != 2 or self.patches.shape[0] != self.grid.patches:
            raise ValueError(f"an image of {self.grid.patches} patches needs patches [{self.grid.patches}, 3·p·p]; got {tuple(self.patches.shape)}")

    @property
    def length(self) -> int:
        return self.grid.tokens

    @property
    def end(self) -> int:
        """The prompt position just after the span."""
        return self.offset + self.grid.tokens

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions ``[start, end)`` reach into the span."""
        return self.offset < end and start < self.end

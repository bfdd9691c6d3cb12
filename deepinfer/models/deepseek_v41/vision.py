"""DeepSeek V4.1's vision tower: a ViT over 14 × 14 patches, an aligner into the text hidden size, learned delimiters.

As released (``vision.*``, ``aligner.*``, ``image_start`` / ``image_newline`` /
``image_end``): a linear patch embedding (no learned position embedding, no class
token); pre-norm blocks ``x += attn(norm1(x))``, ``x += mlp(norm2(x))`` whose
attention rotates q and k by a 2D rotary embedding (each head's first half by
the patch's row angles and column angles, rotate-half style) and is bidirectional
within an image; a SwiGLU MLP (``w1`` gate | up, ``w2``); a final norm. The
aligner pads the patch grid with zeros to multiples of ``r`` and merges each
``r × r`` tile (features channel-major, then the tile's offsets row-major) through
``w2(gelu(w1(x)))`` (exact gelu). An image's span is its start vector, ``llm_h``
rows of ``llm_w`` aligner rows each followed by the newline vector, its end vector.

Every image of a call runs in one ViT pass: the patches of all images are packed
into one sequence and ``Kernels.vit_attention`` keeps each image to itself. What
depends on the grids (rotary positions, image boundaries, tile and span gathers)
is planned on the host and copied once, so the pass reads nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deepinfer_interfaces import Kernels

from ...multimodal import IMAGE_END, IMAGE_NEWLINE, IMAGE_PATCH, IMAGE_START, ImageSpan
from ..common.params import ParamTree
from .config import V41VisionConfig


#: the model names of the tower's parameters start with one of these (the release's names, at the top level)
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_newline", "image_end")


def rotary_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[P, n, d]`` rotated rotate-half style by angles ``[P, 1, d/2]`` (``cos``, ``sin``), in fp32 and
    returned in ``x.dtype``: with ``x1, x2`` the halves, ``(x1·cos − x2·sin, x2·cos + x1·sin)``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[P, 1, 2F]`` of each patch's angles: its row times the ``F`` frequencies, then its column times them."""
    angles = (positions.float()[:, :, None] * inv_freq).flatten(1)  # [P, 2 * F]: row angles, then column angles
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


@dataclass(frozen=True)
class VisionPlan:
    """What one encode call needs besides the pixels, built on the host from the images' grids."""

    #: ``[P, 3·p·p]`` float32: every image's patches, one image after another
    patches: torch.Tensor
    #: ``[P, 2]`` int64: each patch's (row, column) in its image
    positions: torch.Tensor
    #: ``[n + 1]`` int32: where each image's patches start and end in the packed sequence
    cu_seqlens: torch.Tensor
    #: ``[R, r·r]`` int64: the ViT rows each aligner row merges (row-major in its tile), ``P`` for padding
    tiles: torch.Tensor
    #: ``[S]`` int64: each span position's row of ``[aligner rows (R); start; newline; end]``
    span_rows: torch.Tensor
    #: each image's span length
    lengths: tuple[int, ...]

    @classmethod
    def build(cls, spans: list[ImageSpan], patch_size: int, ratio: int) -> "VisionPlan":
        width = 3 * patch_size * patch_size
        positions, tiles, rows, bounds = [], [], [], [0]
        merged = sum(s.grid.llm_h * s.grid.llm_w for s in spans)
        total = sum(s.grid.patches for s in spans)
        delimiter = {IMAGE_START: merged, IMAGE_NEWLINE: merged + 1, IMAGE_END: merged + 2}
        first_row = 0
        for span in spans:
            g = span.grid
            if span.patches.shape[1] != width:
                raise ValueError(f"an image of {patch_size} × {patch_size} patches needs {width} values per patch; got {span.patches.shape[1]}")
            if (g.llm_h, g.llm_w) != (-(-g.vit_h // ratio), -(-g.vit_w // ratio)):
                raise ValueError(f"an image of {g.vit_h} × {g.vit_w} patches merges {ratio} × {ratio} into "
                                 f"{-(-g.vit_h // ratio)} × {-(-g.vit_w // ratio)} tokens; its grid says {g.llm_h} × {g.llm_w}")
            r, c = np.divmod(np.arange(g.patches), g.vit_w)
            positions.append(np.stack([r, c], axis=1))
            ty, tx, dy, dx = np.meshgrid(np.arange(g.llm_h), np.arange(g.llm_w), np.arange(ratio), np.arange(ratio), indexing="ij")
            row, col = ty * ratio + dy, tx * ratio + dx
            inside = (row < g.vit_h) & (col < g.vit_w)
            tiles.append(np.where(inside, bounds[-1] + row * g.vit_w + col, total).reshape(-1, ratio * ratio))
            types = g.token_types()
            span_rows = np.empty(len(types), dtype=np.int64)
            patch = types == IMAGE_PATCH
            span_rows[patch] = first_row + np.arange(int(patch.sum()))
            for kind, at in delimiter.items():
                span_rows[types == kind] = at
            rows.append(span_rows)
            first_row += g.llm_h * g.llm_w
            bounds.append(bounds[-1] + g.patches)
        return cls(
            patches=torch.cat([s.patches for s in spans]).float(),
            positions=torch.from_numpy(np.concatenate(positions)).long(),
            cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
            tiles=torch.from_numpy(np.concatenate(tiles)).long(),
            span_rows=torch.from_numpy(np.concatenate(rows)),
            lengths=tuple(s.length for s in spans),
        )


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: from pinned memory, asynchronously, so the host never waits on the device."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class VisionBlock(ParamTree):
    """One pre-norm block: 2D-rotary attention within each image, then a SwiGLU MLP."""

    def __init__(self, c: V41VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__(device)
        d, i = c.hidden_size, c.intermediate_size
        self.heads, self.eps = c.num_attention_heads, c.rms_norm_eps
        self.norm1 = self.param("norm1.weight", (d,), torch.float32)
        self.wqkv = self.param("attn.wqkv.weight", (3 * d, d), dtype)
        self.bqkv = self.param("attn.wqkv.bias", (3 * d,), dtype)
        self.wo = self.param("attn.wo.weight", (d, d), dtype)
        self.bo = self.param("attn.wo.bias", (d,), dtype)
        self.norm2 = self.param("norm2.weight", (d,), torch.float32)
        self.w1 = self.param("mlp.w1.weight", (2 * i, d), dtype)
        self.w2 = self.param("mlp.w2.weight", (d, i), dtype)

    def __call__(self, k: Kernels, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        p, d = x.shape
        h = self.heads
        qkv = F.linear(k.rms_norm(x, self.norm1, self.eps), self.wqkv, self.bqkv)
        qk = rotary_2d(qkv[:, : 2 * d].view(p, 2 * h, d // h), cos, sin)  # q's heads, then k's
        v = qkv[:, 2 * d :].view(p, h, d // h)
        o = k.vit_attention(qk[:, :h], qk[:, h:], v, cu_seqlens, (d // h) ** -0.5)
        x = x + F.linear(o.reshape(p, d), self.wo, self.bo)
        gate, up = F.linear(k.rms_norm(x, self.norm2, self.eps), self.w1).chunk(2, dim=-1)
        return x + F.linear(k.swiglu(gate, up, None), self.w2)


class VisionTransformer(ParamTree):
    """``vision.*``: the patch embedding, the blocks and the final norm."""

    def __init__(self, c: V41VisionConfig, dtype: torch.dtype, device) -> None:
        super().__init__(device)
        d = c.hidden_size
        self.eps = c.rms_norm_eps
        self.proj = self.param("patch_embed.proj.weight", (d, 3 * c.patch_size**2), dtype)
        self.proj_bias = self.param("patch_embed.proj.bias", (d,), dtype)
        self.blocks = [VisionBlock(c, dtype, device) for _ in range(c.num_hidden_layers)]
        for i, block in enumerate(self.blocks):
            self.child(f"blocks.{i}", block)
        self.norm = self.param("norm.weight", (d,), torch.float32)
        rope = c.head_dim // 2  # channels a half-head holds: half turned by row angles, half by column angles
        self.inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, rope, 2, dtype=torch.float32, device=device) / rope)

    def __call__(self, k: Kernels, patches: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``[P, 3·p·p]`` patches of packed images in, ``[P, hidden]`` features out (model dtype)."""
        x = F.linear(patches.to(self.proj.dtype), self.proj, self.proj_bias)
        cos, sin = rotary_angles(positions, self.inv_freq)
        for block in self.blocks:
            x = block(k, x, cos, sin, cu_seqlens)
        return k.rms_norm(x, self.norm, self.eps)


class Aligner(ParamTree):
    """``aligner.*``: ``r × r`` tiles of ViT features into the text hidden size, ``w2(gelu(w1(tile)))``."""

    def __init__(self, c: V41VisionConfig, hidden: int, dtype: torch.dtype, device) -> None:
        super().__init__(device)
        self.w1 = self.param("w1.weight", (hidden, c.hidden_size * c.downsample_ratio**2), dtype)
        self.b1 = self.param("w1.bias", (hidden,), dtype)
        self.w2 = self.param("w2.weight", (hidden, hidden), dtype)
        self.b2 = self.param("w2.bias", (hidden,), dtype)

    def __call__(self, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        """ViT rows ``[P, C]`` and each merged row's ``[R, r·r]`` tile (``P``: a zero pad) in; ``[R, hidden]`` out."""
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        feats = padded[tiles].transpose(1, 2).reshape(tiles.shape[0], -1)  # feature c·r² + j: channel-major
        return F.linear(F.gelu(F.linear(feats, self.w1, self.b1)), self.w2, self.b2)


class VisionTower(ParamTree):
    """The ViT (``vision.*``), the aligner (``aligner.*``) and the delimiters, under the release's top-level names."""

    def __init__(self, c: V41VisionConfig, hidden: int, dtype: torch.dtype, device) -> None:
        super().__init__(device)
        self.config = c
        self.vit = self.child("vision", VisionTransformer(c, dtype, device))
        self.aligner = self.child("aligner", Aligner(c, hidden, dtype, device))
        self.image_start = self.param("image_start", (hidden,), dtype)
        self.image_newline = self.param("image_newline", (hidden,), dtype)
        self.image_end = self.param("image_end", (hidden,), dtype)

    def encode(self, k: Kernels, spans: list[ImageSpan]) -> list[torch.Tensor]:
        """Each image's span embedding ``[span.length, hidden]`` in the model dtype, all images in one ViT pass."""
        if not spans:
            return []
        c = self.config
        plan = VisionPlan.build(spans, c.patch_size, c.downsample_ratio)
        dev = self.device
        x = self.vit(k, to_device(plan.patches, dev), to_device(plan.positions, dev), to_device(plan.cu_seqlens, dev))
        merged = self.aligner(x, to_device(plan.tiles, dev))
        table = torch.cat([merged, self.image_start[None], self.image_newline[None], self.image_end[None]])
        return list(table[to_device(plan.span_rows, dev)].split(plan.lengths))

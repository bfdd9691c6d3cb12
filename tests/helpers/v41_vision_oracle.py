"""A dense float64 oracle of DeepSeek V4.1's vision tower and of images spliced into its text forward.

Written from the published description and imports nothing from ``deepinfer``;
the tensors are read from the checkpoint's ``*.safetensors`` under the
release's names (``vision.*``, ``aligner.*``, ``image_start`` /
``image_newline`` / ``image_end``, ``layers.{i}.ffn.gate.bias_vl``).

The ViT, per image: a linear patch embedding of the ``[3, p, p]`` patches
(channel-major); blocks ``x += wo(attn(norm1 x))``, ``x += w2(silu(g) · u)``
with ``g | u = w1(norm2 x)``; a final norm (RMS norms with eps 1e-6). The
attention is full (every patch sees every patch of its image, nothing else),
a plain softmax at ``head_dim^-0.5``, with a 2D rotary on q and k: for the
patch at (row, col) the angles are ``row · f`` then ``col · f`` (``f`` =
``theta^(-2i/d)``, ``d = head_dim / 2``), rotating channel ``j`` with channel
``j + d`` (the halves), the tables in fp32 as the published code builds them.
The aligner zero-pads the ``[C, vit_h, vit_w]`` grid bottom and right to
multiples of ``r``, takes the ``r × r`` tiles in row-major order, each
flattened channel-major then row-major within the tile (feature
``c · r² + dy · r + dx``), then ``w2(gelu(w1 x))`` with the exact (erf) gelu.
An image's span: ``image_start``, ``llm_h`` rows of ``llm_w`` aligner rows
each ended by ``image_newline``, ``image_end``.

In the text forward (``v41_oracle.Splice``) the span rows replace the token
embeddings at the span's positions; those positions choose experts with
``gate.bias_vl`` in place of ``gate.bias``; Engram adds nothing there, and an
n-gram reaching back to an image position is cut there (that position and
everything older read as the pad id), as a sequence start cuts it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .oracle_math import DTYPE, rms_norm
from .oracle_tensors import CheckpointTensors
from .v41_image_oracle import Plan, VisionSpec, preprocess
from .v41_oracle import OracleResult, Splice, oracle_forward

EPS = 1e-6


@dataclass
class OracleImage:
    """One image of a prompt for the oracle: its span's first position, patches and grids."""

    offset: int
    #: ``[P, 3·p·p]`` float32 normalised patches
    patches: np.ndarray
    plan: Plan

    @classmethod
    def of(cls, image: Image.Image, offset: int, spec: VisionSpec) -> "OracleImage":
        patches, grid = preprocess(image, spec)
        return cls(offset, patches, grid)


def load_spec(directory: str | Path) -> tuple[VisionSpec, int]:
    """The checkpoint's vision config and ``image_token_id``."""
    raw = json.loads((Path(directory) / "config.json").read_text())
    return VisionSpec.of(raw), int(raw["image_token_id"])


def rope_tables(vit_h: int, vit_w: int, spec: VisionSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``[P, head_dim / 2]`` cos and sin of each patch's angles (row then column), computed in fp32."""
    d = spec.head_dim // 2
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rows = torch.arange(vit_h, dtype=torch.float32).repeat_interleave(vit_w)
    cols = torch.arange(vit_w, dtype=torch.float32).repeat(vit_h)
    angles = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)
    return angles.cos().to(DTYPE), angles.sin().to(DTYPE)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[P, heads, head_dim]``: channel ``j`` and ``j + head_dim/2`` rotated by angle ``j``."""
    d = x.shape[-1] // 2
    a, b = x[..., :d], x[..., d:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def _linear(x: torch.Tensor, tensors: CheckpointTensors, prefix: str) -> torch.Tensor:
    y = x @ tensors(prefix + ".weight").t()
    return y + tensors(prefix + ".bias") if prefix + ".bias" in tensors else y


def vit(tensors: CheckpointTensors, patches: torch.Tensor, vit_h: int, vit_w: int, spec: VisionSpec,
        layers: int | None = None) -> torch.Tensor:
    """``[P, hidden]`` float64: one image's ViT output (after the final norm); ``layers`` blocks if given."""
    x = _linear(patches.to(DTYPE), tensors, "vision.patch_embed.proj")
    cos, sin = rope_tables(vit_h, vit_w, spec)
    n, hd = spec.num_attention_heads, spec.head_dim
    for i in range(spec.num_hidden_layers if layers is None else layers):
        p = f"vision.blocks.{i}."
        h = rms_norm(x, tensors(p + "norm1.weight"), EPS)
        q, k, v = _linear(h, tensors, p + "attn.wqkv").view(-1, 3, n, hd).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        scores = torch.einsum("phd,shd->hps", q, k) / math.sqrt(hd)
        out = torch.einsum("hps,shd->phd", torch.softmax(scores, dim=-1), v).reshape(-1, n * hd)
        x = x + _linear(out, tensors, p + "attn.wo")
        gate, up = (rms_norm(x, tensors(p + "norm2.weight"), EPS) @ tensors(p + "mlp.w1.weight").t()).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ tensors(p + "mlp.w2.weight").t()
    return rms_norm(x, tensors("vision.norm.weight"), EPS)


def merge_tiles(x: torch.Tensor, vit_h: int, vit_w: int, r: int) -> torch.Tensor:
    """``[llm_h · llm_w, C · r²]``: the zero-padded grid's ``r × r`` tiles, row-major, each channel-major."""
    c = x.shape[-1]
    lh, lw = -(-vit_h // r), -(-vit_w // r)
    grid = x.new_zeros(lh * r, lw * r, c)
    grid[:vit_h, :vit_w] = x.view(vit_h, vit_w, c)
    tiles = grid.view(lh, r, lw, r, c).permute(0, 2, 4, 1, 3)  # [lh, lw, c, dy, dx]
    return tiles.reshape(lh * lw, c * r * r)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def aligner(tensors: CheckpointTensors, features: torch.Tensor, vit_h: int, vit_w: int, spec: VisionSpec) -> torch.Tensor:
    """``[llm_h · llm_w, text hidden]``: the merged tiles through the two-layer MLP."""
    tiles = merge_tiles(features, vit_h, vit_w, spec.downsample_ratio)
    return _linear(gelu(_linear(tiles, tensors, "aligner.w1")), tensors, "aligner.w2")


def span_rows(tensors: CheckpointTensors, image: OracleImage, spec: VisionSpec, layers: int | None = None) -> torch.Tensor:
    """``[plan.tokens, text hidden]`` float64: the image's whole span, delimiters included."""
    g = image.plan
    feats = vit(tensors, torch.from_numpy(image.patches), g.vit_h, g.vit_w, spec, layers)
    tokens = aligner(tensors, feats, g.vit_h, g.vit_w, spec).view(g.llm_h, g.llm_w, -1)
    newline = tensors("image_newline").view(1, 1, -1).expand(g.llm_h, 1, -1)
    body = torch.cat([tokens, newline], dim=1).flatten(0, 1)
    return torch.cat([tensors("image_start")[None], body, tensors("image_end")[None]])


def splice(directory: str | Path, length: int, images: list[OracleImage]) -> Splice:
    """The ``Splice`` of ``images`` in a prompt of ``length`` tokens."""
    spec, _ = load_spec(directory)
    tensors = CheckpointTensors(Path(directory))
    mask = torch.zeros(length, dtype=torch.bool)
    rows = torch.zeros(length, tensors("image_start").shape[0], dtype=DTYPE)
    for image in images:
        end = image.offset + image.plan.tokens
        if end > length or mask[image.offset:end].any():
            raise ValueError(f"an image span [{image.offset}, {end}) overlaps another or runs past {length} tokens")
        mask[image.offset:end] = True
        rows[image.offset:end] = span_rows(tensors, image, spec)
    return Splice(mask, rows)


def expand(ids: list[int], images: list[Image.Image], spec: VisionSpec, image_token_id: int) -> tuple[list[int], list[OracleImage]]:
    """``ids`` with each placeholder (``image_token_id``) widened to its image's span, and the images placed."""
    if ids.count(image_token_id) != len(images):
        raise ValueError(f"{ids.count(image_token_id)} placeholders for {len(images)} images")
    out: list[int] = []
    placed: list[OracleImage] = []
    pending = iter(images)
    for token in ids:
        if token != image_token_id:
            out.append(token)
            continue
        image = OracleImage.of(next(pending), len(out), spec)
        placed.append(image)
        out.extend([image_token_id] * image.plan.tokens)
    return out, placed


def oracle_forward_images(directory: str | Path, ids: list[int], images: list[OracleImage], **kwargs) -> OracleResult:
    """``v41_oracle.oracle_forward`` of the expanded ``ids`` with ``images`` spliced in (``kwargs`` passed on)."""
    return oracle_forward(directory, ids, splice=splice(directory, len(ids), images), **kwargs)

"""Vision-transformer attention cases: one image, several of unequal lengths (a 1-patch image among them), an
empty segment, int32 and int64 boundaries, large logits, one long image, V4.1's heads (16 of 64 channels)
over two images, and an empty batch. A relative-RMS limit catches sums kept in 16 bits over long images."""

import torch

from .spec import RMS_LIMITS, Case, OpSpec, randn, register, seeded

#: DeepSeek V4.1's vision tower: 16 heads of 64 channels
V41_VIT_HEADS, V41_VIT_HEAD_DIM = 16, 64


def _inputs(g: torch.Generator, lengths: list[int], heads: int, dim: int, dtype=torch.int32, q_scale: float = 1.0) -> dict:
    """Unit-variance q, k, v of images of ``lengths`` patches packed one after another, and their boundaries."""
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype) if lengths else torch.zeros(1, dtype=dtype)
    return dict(q=randn(t, heads, dim, gen=g, scale=q_scale), k=randn(t, heads, dim, gen=g), v=randn(t, heads, dim, gen=g),
                cu_seqlens=cu, scale=dim**-0.5)


def _cases() -> list[Case]:
    g = seeded(70)
    return [
        Case("one_image_t9_h2_d16", _inputs(g, [9], 2, 16)),
        Case("unequal_images_5_17_1_h3_d32", _inputs(g, [5, 17, 1], 3, 32)),
        Case("one_patch_images_around_one_of_7", _inputs(g, [1, 7, 1], 2, 16)),
        Case("empty_segment_int64_bounds", _inputs(g, [4, 0, 6], 2, 16, dtype=torch.int64)),
        Case("large_logits_t12_h2_d16", _inputs(g, [12], 2, 16, q_scale=6.0)),
        Case("long_image_t600_h2_d64", _inputs(g, [600], 2, 64)),
        Case("v41_h16_d64_two_images_117_36", _inputs(g, [117, 36], V41_VIT_HEADS, V41_VIT_HEAD_DIM)),
        Case("empty_batch", _inputs(g, [], 2, 16)),
    ]


register(OpSpec(
    op="vit_attention", cases=_cases, cast=("q", "k", "v"), rms_limits=RMS_LIMITS,
    rms_reason="softmax-weighted sums over up to 600 keys per image: an accumulator kept in bf16 between key tiles loses several roundings' worth",
))

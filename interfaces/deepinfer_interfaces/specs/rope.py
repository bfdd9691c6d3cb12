"""Partial interleaved RoPE cases: forward and inverse, 2-D and 3-D, large positions, no rope channels,
one token, and V4-Flash's attention (64 heads of 512, the last 64 rotated)."""

import torch

from .shapes import HEAD_DIM, HEADS, ROPE_DIM
from .spec import Case, OpSpec, randn, register, seeded


def angles(positions: torch.Tensor, rope_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    freqs = positions.double()[:, None] * inv_freq
    return freqs.cos().float(), freqs.sin().float()


def _cases() -> list[Case]:
    g = seeded(1)
    out = []
    for inverse in (False, True):
        tag = "inverse" if inverse else "forward"
        pos = torch.tensor([0, 1, 2, 5, 9])
        c, s = angles(pos, 16)
        out.append(Case(f"t5_h4_d64_r16_{tag}", dict(x=randn(5, 4, 64, gen=g), cos=c, sin=s, inverse=inverse)))
        pos = torch.tensor([0, 4095, 65535])
        c, s = angles(pos, 64)
        out.append(Case(f"t3_d64_full_rope_far_positions_{tag}", dict(x=randn(3, 64, gen=g), cos=c, sin=s, inverse=inverse)))
        c, s = angles(torch.tensor([37]), ROPE_DIM)
        out.append(Case(f"one_token_h64_d512_r64_{tag}", dict(x=randn(1, HEADS, HEAD_DIM, gen=g), cos=c, sin=s, inverse=inverse)))
        c, s = angles(torch.tensor([127, 4000]), ROPE_DIM)
        out.append(Case(f"t2_h64_d512_r64_{tag}", dict(x=randn(2, HEADS, HEAD_DIM, gen=g), cos=c, sin=s, inverse=inverse)))
    c, s = angles(torch.tensor([3, 4]), 0)
    out.append(Case("no_rope_channels", dict(x=randn(2, 3, 16, gen=g), cos=c, sin=s, inverse=False)))
    c, s = angles(torch.empty(0, dtype=torch.long), 8)
    out.append(Case("empty_batch", dict(x=torch.empty(0, 2, 16), cos=c, sin=s, inverse=False)))
    return out


register(OpSpec(op="rope", cases=_cases, cast=("x",)))

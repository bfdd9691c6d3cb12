"""The math both dense oracles (``v4_oracle``, ``v41_oracle``) share, written from the published description
(transformers' ``deepseek_v4`` / ``deepseek_v41`` modelling code): RMS norm, interleaved-pair partial RoPE
(plain or YaRN) and its main / compress parameters, mHC's mixes with Sinkhorn, and how close a top-k choice
came to another. Nothing from ``deepinfer``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

DTYPE = torch.float64


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Root-mean-square normalisation over the last axis, optionally scaled per channel."""
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_frequencies(params: dict[str, Any], rope_dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """One inverse frequency per rotated pair and the cos/sin amplitude: plain, or YaRN's blend of
    interpolated (divided by ``factor``) and original frequencies across a linear ramp of pairs. In fp32,
    step by step as the published code computes its rotary tables."""
    base = float(params["rope_theta"])
    pos_freqs = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    if params.get("rope_type", params.get("type", "default")) == "default":
        return 1.0 / pos_freqs, 1.0
    original = params.get("original_max_position_embeddings") or max_positions
    factor = params.get("factor") or max_positions / original
    amplitude = params.get("attention_factor")
    if amplitude is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            amplitude = _yarn_mscale(factor, params["mscale"]) / _yarn_mscale(factor, params["mscale_all_dim"])
        else:
            amplitude = _yarn_mscale(factor)
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def pair_of(rotations: float) -> float:
        # the pair index whose wavelength fits `rotations` times into the original context
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(pair_of(fast)), 0), min(math.ceil(pair_of(slow)), rope_dim - 1)
    if lo == hi:
        hi += 0.001
    original_share = 1 - ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return 1.0 / (factor * pos_freqs) * (1 - original_share) + 1.0 / pos_freqs * original_share, float(amplitude)


@dataclass
class Rope:
    """Rotates the trailing ``rope_dim`` channels as adjacent (even, odd) pairs."""

    #: fp32, as the published rotary tables are
    inv_freq: torch.Tensor
    amplitude: float

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``x`` is ``[N, ..., D]`` with ``positions`` ``[N]``; ``inverse`` rotates by minus the angle. The
        cos/sin tables in fp32 (``position · inv_freq``, as the published code builds them), the rotation in
        ``x``'s precision."""
        rd = 2 * self.inv_freq.shape[0]
        angle = positions.to(torch.float32)[:, None] * self.inv_freq
        cos, sin = (angle.cos() * self.amplitude).to(x.dtype), (angle.sin() * self.amplitude).to(x.dtype)
        if inverse:
            sin = -sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
        cos, sin = cos.view(shape), sin.view(shape)
        head, tail = x[..., : x.shape[-1] - rd], x[..., x.shape[-1] - rd :]
        re, im = tail[..., 0::2], tail[..., 1::2]
        out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
        return torch.cat([head, out], dim=-1)


def fold_rope(text: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``main`` and ``compress`` rope parameters: given per type, or derived from the thetas with
    ``rope_scaling`` (YaRN, amplitude 1 unless given) applying to ``compress`` only."""
    rp = text.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return dict(rp["main"]), dict(rp["compress"])
    scaling = {k: v for k, v in (text.get("rope_scaling") or {}).items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": text.get("rope_theta", 10000.0)}
    compress = {**scaling, "rope_theta": text.get("compress_rope_theta", 160000.0)}
    compress.setdefault("rope_type", compress.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def top_k_margin(values: torch.Tensor, k: int) -> tuple[float, int]:
    """How close a keep-the-``k``-largest choice per row came to going the other way: the smallest gap
    between the last kept and the first dropped value, over the row's largest magnitude (exact ties
    excluded), and the number of rows whose choice fell inside an exact tie."""
    if values.shape[-1] <= k or k <= 0:
        return math.inf, 0
    top = values.sort(dim=-1, descending=True).values
    kept, dropped = top[..., k - 1], top[..., k]
    live = torch.isfinite(kept) & torch.isfinite(dropped)
    ties = int((live & (kept == dropped)).sum())
    live &= kept != dropped
    if not live.any():
        return math.inf, ties
    scale = torch.where(torch.isfinite(values), values.abs(), 0).amax(-1)
    gap = (kept - dropped) / (scale + 1e-300)
    return float(gap[live].min()), ties


# ----------------------------------------------------------------------------- mHC


def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, text: dict):
    """``(pre, post, comb)`` of one site from one projection of the RMS-normed flattened streams;
    ``comb`` is pushed towards doubly stochastic by Sinkhorn (columns first, then rows and columns)."""
    hc, eps = text["hc_mult"], text["hc_eps"]
    flat = rms_norm(streams.flatten(1), None, text["rms_norm_eps"])
    mix = flat @ fn.t()
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mix[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (mix[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(text["hc_sinkhorn_iters"] - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``Σ_k pre_k · stream_k``: ``[T, hc, D]`` -> ``[T, D]``."""
    return (pre[:, :, None] * streams).sum(1)


def hc_expand(x: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New stream ``k`` = ``post_k · x + Σ_j comb[j, k] · residual_j``."""
    return post[:, :, None] * x[:, None, :] + torch.einsum("tjk,tjd->tkd", comb, residual)

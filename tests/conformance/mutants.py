"""Kernel sets with one subtle bug each: the conformance suite must fail every one.

Each class is a plausible mistake in a vendor's kernel, a few characters away
from the reference. ``tests/conformance/test_mutants.py`` installs this module as a real
plugin (copied under another name next to a dist-info) and checks that op
parity fails exactly the ops that carry the bug and that end-to-end parity
fails too. This module imports nothing from the tests, so it can be copied.

The communicator mutant (a dispatch that drops the last token) lives in
``tests/conformance/test_conformance_comm.py``.

The mutants after the FP4 one each hide from the greedy, batched, fp32 e2e
run (sampling, the bitmask, a batch of one, the clamp's lower bound, a bf16
path); ``ALTERNATIVES`` holds correct kernel sets written differently from the
reference (sums in another order), which must pass.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import INTERFACE_VERSION, Kernels, QuantizedWeight


class NoEpsKernels(Kernels):
    """RMSNorm that forgets ``eps`` inside the square root."""

    name = "mutant-no-eps"
    interface_version = INTERFACE_VERSION

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return super().rms_norm(x, weight, 0.0)


class RopeHalvesKernels(Kernels):
    """RoPE that pairs channel ``i`` with ``i + R/2`` (the GPT-NeoX layout) instead of ``(2i, 2i+1)``."""

    name = "mutant-rope-halves"
    interface_version = INTERFACE_VERSION

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        half = cos.shape[-1]
        if half == 0 or x.shape[0] == 0:
            return x.clone()
        c, s = cos.float(), (-sin if inverse else sin).float()
        if x.dim() == 3:
            c, s = c[:, None, :], s[:, None, :]
        rot = x[..., -2 * half:].float()
        x0, x1 = rot[..., :half], rot[..., half:]
        out = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
        return torch.cat([x[..., : x.shape[-1] - 2 * half], out.to(x.dtype)], dim=-1)


class NoSinkKernels(Kernels):
    """Sparse attention that leaves the per-head sink logit out of the softmax."""

    name = "mutant-no-sink"
    interface_version = INTERFACE_VERSION

    def sparse_attention(self, q, kv, indices, sinks, scale):
        # a sink of -inf takes no probability mass
        return super().sparse_attention(q, kv, indices, torch.full_like(sinks, float("-inf")), scale)


class WindowShortKernels(Kernels):
    """Sparse attention whose loop bound is off by one: the last valid index of each row is skipped.

    The model lists a token's sliding window newest first, so on sliding rows
    this drops the oldest position: a window of ``W − 1`` tokens.
    """

    name = "mutant-window-short"
    interface_version = INTERFACE_VERSION

    def sparse_attention(self, q, kv, indices, sinks, scale):
        valid = indices >= 0
        cols = torch.arange(indices.shape[1], device=indices.device).expand_as(indices)
        last = torch.where(valid, cols, torch.full_like(cols, -1)).amax(dim=1, keepdim=True) if indices.numel() else cols
        trimmed = torch.where(valid & (cols == last), torch.full_like(indices, -1), indices)
        return super().sparse_attention(q, kv, trimmed, sinks, scale)


class NoRouteBiasKernels(Kernels):
    """Learned routing that chooses experts without the load-balancing bias."""

    name = "mutant-no-route-bias"
    interface_version = INTERFACE_VERSION

    def moe_route(self, logits, bias, top_k, routed_scaling, scoring="sqrtsoftplus", renormalize=True):
        return super().moe_route(logits, None, top_k, routed_scaling, scoring, renormalize)


class NoRenormKernels(Kernels):
    """Routing (learned and hash) that skips renormalising the chosen top-k weights."""

    name = "mutant-no-renorm"
    interface_version = INTERFACE_VERSION

    def moe_route(self, logits, bias, top_k, routed_scaling, scoring="sqrtsoftplus", renormalize=True):
        return super().moe_route(logits, bias, top_k, routed_scaling, scoring, False)

    def hash_route(self, logits, token_ids, tid2eid, routed_scaling, scoring="sqrtsoftplus", renormalize=True):
        return super().hash_route(logits, token_ids, tid2eid, routed_scaling, scoring, False)


class NoClampKernels(Kernels):
    """SwiGLU without the clamp, in the standalone activation and in the grouped experts."""

    name = "mutant-no-clamp"
    interface_version = INTERFACE_VERSION

    def swiglu(self, gate, up, limit):
        return super().swiglu(gate, up, None)

    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        return super().moe_experts(x, topk_ids, topk_weights, w13, w2, None)


class ShortSinkhornKernels(Kernels):
    """Hyper-connection weights with the Sinkhorn loop cut to 3 iterations."""

    name = "mutant-short-sinkhorn"
    interface_version = INTERFACE_VERSION

    def mhc_pre(self, x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
        return super().mhc_pre(x, fn, base, scale, norm_eps, hc_eps, min(sinkhorn_iters, 3))


class FP8LastBlockScaleKernels(Kernels):
    """FP8 linear whose scale index is off by one on the last block of columns: it reuses its neighbour's scale."""

    name = "mutant-fp8-last-block-scale"
    interface_version = INTERFACE_VERSION

    def fp8_linear(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        scales = weight.scales.clone()
        if scales.shape[-1] > 1:
            scales[..., -1] = scales[..., -2]
        return super().fp8_linear(x, QuantizedWeight(weight.codes, scales, weight.block, weight.fmt))


class FP4SwappedNibblesKernels(Kernels):
    """FP4 experts decoded high nibble first: each packed pair of values comes out swapped."""

    name = "mutant-fp4-swapped-nibbles"
    interface_version = INTERFACE_VERSION

    def moe_experts_quantized(self, x, topk_ids, topk_weights, w13: QuantizedWeight, w2: QuantizedWeight, limit):
        def swap(w: QuantizedWeight) -> QuantizedWeight:
            if w.fmt != "e2m1":
                return w
            c = w.codes
            return QuantizedWeight(((c & 0x0F) << 4) | (c >> 4), w.scales, w.block, w.fmt)

        return super().moe_experts_quantized(x, topk_ids, topk_weights, swap(w13), swap(w2), limit)


class SampleTimesNoiseKernels(Kernels):
    """Sampling whose exponential race takes ``p · noise`` instead of ``p / noise`` (greedy rows unaffected)."""

    name = "mutant-sample-times-noise"
    interface_version = INTERFACE_VERSION

    def sample(self, logits, temperature, top_k, top_p, min_p, noise):
        return super().sample(logits, temperature, top_k, top_p, min_p, 1.0 / noise)


class SampleSqueezeKernels(Kernels):
    """Sampling that squeezes its result: a batch of one comes back as a 0-d tensor, which crashes the engine."""

    name = "mutant-sample-squeeze"
    interface_version = INTERFACE_VERSION

    def sample(self, logits, temperature, top_k, top_p, min_p, noise):
        return super().sample(logits, temperature, top_k, top_p, min_p, noise).squeeze()


class BitmaskMsbFirstKernels(Kernels):
    """Token bitmask read most significant bit first: token ``32·i + j`` is taken from bit ``31 − j``."""

    name = "mutant-bitmask-msb-first"
    interface_version = INTERFACE_VERSION

    def apply_token_bitmask(self, logits, bitmask):
        shifts = 31 - torch.arange(32, device=bitmask.device, dtype=torch.int32)
        bits = ((bitmask.to(torch.int32)[..., None] >> shifts) & 1).flatten(-2).bool()
        allowed = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        covered = min(logits.shape[-1], bits.shape[-1])
        allowed[:, :covered] = bits[:, :covered]
        return logits.masked_fill_(~allowed, float("-inf"))


class OneTokenNoSinkKernels(Kernels):
    """Sparse attention with a one-query fast path (a request decoding alone) that forgets the sink."""

    name = "mutant-one-token-no-sink"
    interface_version = INTERFACE_VERSION

    def sparse_attention(self, q, kv, indices, sinks, scale):
        if q.shape[0] == 1:
            sinks = torch.full_like(sinks, float("-inf"))
        return super().sparse_attention(q, kv, indices, sinks, scale)


def _clamp_up_above_only(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(max=limit)
    return torch.nn.functional.silu(gate) * up


class ClampUpAboveOnlyKernels(Kernels):
    """SwiGLU whose ``up`` clamp forgets the lower bound ``−limit`` (only matters where activations reach it)."""

    name = "mutant-clamp-up-above-only"
    interface_version = INTERFACE_VERSION

    def swiglu(self, gate, up, limit):
        return _clamp_up_above_only(gate.float(), up.float(), limit).to(gate.dtype)

    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        half = w13.shape[1] // 2
        for e in range(w13.shape[0]):
            hit = topk_ids == e
            rows = hit.any(-1)
            if not bool(rows.any()):
                continue
            h = x[rows].float() @ w13[e].float().T
            weight = (topk_weights.float() * hit).sum(-1)[rows]
            out[rows] += weight[:, None] * (_clamp_up_above_only(h[:, :half], h[:, half:], limit) @ w2[e].float().T)
        return out.to(x.dtype)


class Bf16RopeInverseKernels(Kernels):
    """RoPE whose bf16 path rotates the wrong way (the inverse rotation); fp32 is right."""

    name = "mutant-bf16-rope-inverse"
    interface_version = INTERFACE_VERSION

    def rope(self, x, cos, sin, inverse: bool = False):
        return super().rope(x, cos, sin, not inverse if x.dtype == torch.bfloat16 else inverse)


class ReorderedSumsKernels(Kernels):
    """A correct kernel set that sums in another order than the reference: RMSNorm's mean square over the
    channels reversed, attention over each row's positions reversed, each token's experts in reverse order."""

    name = "alternative-reordered-sums"
    interface_version = INTERFACE_VERSION

    def rms_norm(self, x, weight, eps):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(acc)
        y = xf * torch.rsqrt(xf.flip(-1).pow(2).mean(-1, keepdim=True) + eps)
        return (y if weight is None else weight.to(acc) * y).to(x.dtype)

    def sparse_attention(self, q, kv, indices, sinks, scale):
        return super().sparse_attention(q, kv, indices.flip(-1), sinks, scale)

    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        return super().moe_experts(x, topk_ids.flip(-1), topk_weights.flip(-1), w13, w2, limit)


class SplitKLinearKernels(Kernels):
    """A dense linear that is right to fp32 rounding but splits its reduction by the batch size (split-K
    for a batch of one, as GEMM heuristics do when there are too few rows to fill the device): a row's
    bits depend on how many rows came with it, even in batch-invariant mode."""

    name = "mutant-split-k-linear"
    interface_version = INTERFACE_VERSION

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] != 1 or flat.shape[1] < 2:
            return flat.matmul(weight.t()).view(*x.shape[:-1], weight.shape[0])
        half = flat.shape[1] // 2
        out = flat[:, :half].float() @ weight[:, :half].t().float() + flat[:, half:].float() @ weight[:, half:].t().float()
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


#: entry-point name -> class name, for the test's dist-info: kernel sets the suite must fail
MUTANTS = {cls.name: cls.__name__ for cls in (
    NoEpsKernels, RopeHalvesKernels, NoSinkKernels, WindowShortKernels,
    NoRouteBiasKernels, NoRenormKernels, NoClampKernels, ShortSinkhornKernels,
    FP8LastBlockScaleKernels, FP4SwappedNibblesKernels,
    SampleTimesNoiseKernels, SampleSqueezeKernels, BitmaskMsbFirstKernels, OneTokenNoSinkKernels,
    ClampUpAboveOnlyKernels, Bf16RopeInverseKernels,
)}
#: correct kernel sets written differently: the suite must pass them
ALTERNATIVES = {cls.name: cls.__name__ for cls in (ReorderedSumsKernels,)}
#: kernel sets within tolerance everywhere that the batch-invariance suite must fail
INVARIANCE_MUTANTS = {cls.name: cls.__name__ for cls in (SplitKLinearKernels,)}

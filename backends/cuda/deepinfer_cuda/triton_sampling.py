"""Sampling by the exponential race, in three Triton passes with torch ordering the candidates.

1. ``_softmax_stats_kernel``: per row, the max and the sum of ``exp`` of the
   tempered logits (online, per lane), so later passes rebuild any probability
   as ``exp(l/t − m) / s`` without storing ``[B, V]`` probabilities.
2. Only for rows that filter by top-k or top-p: torch orders the candidates
   (``topk`` of the largest k asked for, or a full sort when a row filters by
   top-p alone) and ``_cutoff_kernel`` walks them in order to find the smallest
   logit that survives; survivors are then exactly the logits at or above it.
3. ``_race_kernel``: per row, among survivors (also above the min-p floor) the
   token maximising ``p / noise`` wins; temperature-0 rows take the argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, autotune_configs, choose, unit_inner


def _row_configs() -> list[triton.Config]:
    """Block sizes for the passes that stream whole rows of logits; tuned once per vocabulary size."""
    return autotune_configs(
        [triton.Config({"BLOCK": b}, num_warps=w) for b in (1024, 2048, 4096) for w in (4, 8)],
        triton.Config({"BLOCK": 128}, num_warps=1),
    )


@triton.autotune(configs=_row_configs(), key=["V"])
@triton.jit
def _softmax_stats_kernel(logits_ptr, temp_ptr, max_ptr, sum_ptr, V, stride_l, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row)
    t = tl.where(t <= 0, 1.0, t)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_l + v, mask=v < V, other=float("-inf")).to(tl.float32) / t
        m_new = tl.maximum(m, x)
        # a lane that has seen only -inf keeps s = 0; shifting by 0 there avoids inf - inf
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = m_new
    row_max = tl.max(m, axis=0)
    row_shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(s * tl.exp(m - row_shift), axis=0)
    tl.store(max_ptr + row, row_max)
    tl.store(sum_ptr + row, row_sum)


@triton.jit
def _cutoff_kernel(
    sorted_ptr, stride_s, K, V, temp_ptr, top_k_ptr, top_p_ptr, need_ptr, max_ptr, sum_ptr, cutoff_ptr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cutoff = tl.full([], float("-inf"), tl.float32)
    if tl.load(need_ptr + row) != 0:
        t = tl.load(temp_ptr + row)
        k = tl.load(top_k_ptr + row)
        k = tl.where((k <= 0) | (k > V), V, k)
        k = tl.minimum(k, K)
        top_p = tl.load(top_p_ptr + row)
        m = tl.load(max_ptr + row)
        s = tl.load(sum_ptr + row)
        base = sorted_ptr + row * stride_s
        # mass of the top-k candidates, to renormalise over
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            j = start + tl.arange(0, BLOCK)
            val = tl.load(base + j, mask=j < k, other=float("-inf")).to(tl.float32)
            acc += tl.where(j < k, tl.exp(val / t - m) / s, 0.0)
        kept_mass = tl.sum(acc, axis=0)
        # walk in order: a candidate survives while the mass strictly before it is below top_p
        before_chunk = tl.zeros([], dtype=tl.float32)
        cutoff = tl.full([], float("inf"), tl.float32)
        for start in range(0, K, BLOCK):
            j = start + tl.arange(0, BLOCK)
            live = j < k
            val = tl.load(base + j, mask=live, other=float("-inf")).to(tl.float32)
            mass = tl.where(live, (tl.exp(val / t - m) / s) / kept_mass, 0.0)
            before = before_chunk + tl.cumsum(mass, axis=0) - mass
            keep = live & ((before < top_p) | (j == 0))
            cutoff = tl.minimum(cutoff, tl.min(tl.where(keep, val, float("inf")), axis=0))
            before_chunk += tl.sum(mass, axis=0)
    tl.store(cutoff_ptr + row, cutoff)


@triton.autotune(configs=_row_configs(), key=["V"])
@triton.jit
def _race_kernel(
    logits_ptr, noise_ptr, V, stride_l, stride_n, temp_ptr, min_p_ptr, max_ptr, sum_ptr, cutoff_ptr, out_ptr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(temp_ptr + row)
    greedy = t <= 0
    t = tl.where(greedy, 1.0, t)
    m = tl.load(max_ptr + row)
    s = tl.load(sum_ptr + row)
    cutoff = tl.load(cutoff_ptr + row)
    floor = tl.load(min_p_ptr + row) * (1.0 / s)  # min_p times the largest probability, exp(0)/s
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], dtype=tl.int64)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        ok = v < V
        lg = tl.load(logits_ptr + row * stride_l + v, mask=ok, other=float("-inf")).to(tl.float32)
        noise = tl.load(noise_ptr + row * stride_n + v, mask=ok, other=1.0).to(tl.float32)
        p = tl.exp(lg / t - m) / s
        keep = (lg >= cutoff) & (p >= floor)
        score = tl.where(greedy, lg, tl.where(keep, p / noise, -1.0))
        score = tl.where(ok, score, float("-inf"))
        chunk_best = tl.max(score, axis=0)
        chunk_idx = tl.argmax(score, axis=0)  # first index among equals, like torch.argmax
        better = chunk_best > best  # strict: an earlier chunk keeps ties
        best_idx = tl.where(better, start + chunk_idx.to(tl.int64), best_idx)
        best = tl.where(better, chunk_best, best)
    tl.store(out_ptr + row, best_idx)


def cutoff_tiles() -> Tiles:
    """The top-k / top-p walk over ordered candidates: 1024 per step."""
    return Tiles({"BLOCK": choose(1024, 128)}, num_warps=choose(4, 1))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
) -> torch.Tensor:
    """``Kernels.sample`` on the device for ``[B, V]`` logits with ``B >= 1``.

    Survivors of top-k/top-p are the logits at or above the last survivor's
    logit; the reference cuts by sorted position instead, which differs only
    when that logit is tied exactly. One host sync (choosing how many
    candidates to order) makes this op unsuitable for CUDA-graph capture.
    """
    if logits.dim() != 2 or tuple(noise.shape) != tuple(logits.shape):
        raise ValueError(f"sample: need logits [B, V] and noise of the same shape, got {tuple(logits.shape)} and {tuple(noise.shape)}")
    batch, vocab = logits.shape
    for name, param in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        if tuple(param.shape) != (batch,):
            raise ValueError(f"sample: {name} must have shape ({batch},) (one per row), got {tuple(param.shape)}")
    dev = logits.device
    logits = unit_inner(logits)
    noise = unit_inner(noise)
    temperature = temperature.to(dev, torch.float32).contiguous()
    top_k = top_k.to(dev, torch.int64).contiguous()
    top_p = top_p.to(dev, torch.float32).contiguous()
    min_p = min_p.to(dev, torch.float32).contiguous()

    row_max = torch.empty(batch, dtype=torch.float32, device=dev)
    row_sum = torch.empty(batch, dtype=torch.float32, device=dev)
    _softmax_stats_kernel[(batch,)](logits, temperature, row_max, row_sum, vocab, logits.stride(0))

    k_eff = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    need = (temperature > 0) & ((k_eff < vocab) | (top_p < 1.0))
    # one host sync decides how many candidates to order: none, the largest k asked for, or all
    any_need, any_full, k_max = torch.stack(
        [need.any().long(), (need & (k_eff >= vocab)).any().long(), torch.where(need, k_eff, 0).max()]
    ).tolist()
    cutoff = torch.full((batch,), float("-inf"), dtype=torch.float32, device=dev)
    if any_need:
        if any_full or k_max >= vocab:
            ordered = logits.sort(dim=-1, descending=True).values
        else:
            ordered = logits.topk(k_max, dim=-1, sorted=True).values
        _cutoff_kernel[(batch,)](
            ordered, ordered.stride(0), ordered.shape[1], vocab, temperature, top_k, top_p,
            need.to(torch.int8), row_max, row_sum, cutoff, **cutoff_tiles().kwargs(),
        )
    out = torch.empty(batch, dtype=torch.int64, device=dev)
    _race_kernel[(batch,)](
        logits, noise, vocab, logits.stride(0), noise.stride(0), temperature, min_p, row_max, row_sum, cutoff, out,
    )
    return out

"""Kernel sets for the op specs' rules: one plausible vendor mistake each, and correct alternatives.

Each ``*Kernels`` class but the last ones carries one bug that only a rule-,
size- or precision-specific case of the op specs exposes: ties taken in the
wrong order, a decode path taken only for one token, a tile bound that only
real head dims reach, sums kept in bf16. ``AlternativeKernels`` computes the
same ops another valid way (tiled, reordered, 16-bit operands where real
kernels use them) and must pass. ``tests/conformance/test_conformance_rules.py`` runs op
parity on them. This module imports nothing from the tests, so it can be
installed as a plugin.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import INTERFACE_VERSION, Kernels
from deepinfer_interfaces.kernels.tiles import take_rows


def tiled_attention(q, kv, indices, sinks, scale, tile: int, keep: torch.dtype | None, reverse: bool = False):
    """Sparse attention as a flash kernel computes it: an online softmax over tiles of ``tile`` rows.

    The running output and its normaliser live in ``keep`` between tiles (None: fp32,
    as specified); the probabilities are rounded to ``q.dtype`` before the value
    product (the 16-bit tensor-core operand); ``reverse`` walks the tiles backwards.
    """
    t, h, d = q.shape
    if t == 0 or indices.shape[1] == 0:
        return q.new_zeros(t, h, d)
    qf = q.float()
    rows = take_rows(kv, indices).float()  # [T, K, D]; a packed pool's rows decoded
    valid = indices >= 0
    top = torch.full((t, h, 1), float("-inf"))
    norm = torch.zeros(t, h, 1)
    out = torch.zeros(t, h, d)
    starts = list(range(0, indices.shape[1], tile))
    for a in reversed(starts) if reverse else starts:
        r, v = rows[:, a : a + tile], valid[:, a : a + tile]
        s = torch.einsum("thd,tkd->thk", qf, r) * scale
        s = s.masked_fill(~v[:, None, :], float("-inf"))
        new_top = torch.maximum(top, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isfinite(new_top), new_top, torch.zeros_like(new_top))
        alpha = torch.exp(top - safe)
        p = torch.exp(s - safe)
        pv = torch.einsum("thk,tkd->thd", p.to(q.dtype).float(), r)
        out, norm = out * alpha + pv, norm * alpha + p.sum(-1, keepdim=True)
        if keep is not None:
            out, norm = out.to(keep).float(), norm.to(keep).float()
        top = new_top
    sink = sinks.float()[None, :, None]
    final = torch.maximum(top, sink)
    denom = norm * torch.exp(top - final) + torch.exp(sink - final)
    return (out * torch.exp(top - final) / denom).to(q.dtype)


def chunked_matmul(a: torch.Tensor, b: torch.Tensor, chunk: int, keep: torch.dtype | None) -> torch.Tensor:
    """``a @ b`` (fp32 operands) summed over the contraction in chunks, the partial sum kept in ``keep``."""
    out = torch.zeros(a.shape[0], b.shape[1])
    for k in range(0, a.shape[1], chunk):
        out = out + a[:, k : k + chunk] @ b[k : k + chunk]
        if keep is not None:
            out = out.to(keep).float()
    return out


def expert_loop(kernels, x, topk_ids, topk_weights, w13, w2, limit, chunk: int, keep: torch.dtype | None, reverse: bool):
    """``moe_experts`` one (token, expert) pair at a time with ``chunked_matmul``; the activation
    rounded to ``x.dtype`` between the projections, as the down projection's 16-bit operand is."""
    t, d = x.shape
    e, two_i = w13.shape[0], w13.shape[1]
    out = torch.zeros(t, d)
    for tok in range(t):
        slots = range(topk_ids.shape[1])
        for j in reversed(slots) if reverse else slots:
            ex = int(topk_ids[tok, j])
            if not 0 <= ex < e:
                continue
            h = chunked_matmul(x[tok : tok + 1].float(), w13[ex].float().t(), chunk, keep)
            act = kernels.swiglu(h[:, : two_i // 2], h[:, two_i // 2 :], limit).to(x.dtype).float()
            out[tok] += float(topk_weights[tok, j]) * chunked_matmul(act, w2[ex].float().t(), chunk, keep)[0]
    return out.to(x.dtype)


class TopkTieHighColumnKernels(Kernels):
    """Top-k selection that breaks equal scores towards the higher column (an unstable descending sort)."""

    name = "mutant-topk-tie-high-column"
    interface_version = INTERFACE_VERSION

    def topk_select(self, scores, values, k):
        flipped = super().topk_select(scores.flip(-1), values.flip(-1), k)
        return flipped


class RouteTieHighExpertKernels(Kernels):
    """Expert choice that takes equal ``score + bias`` in descending expert order."""

    name = "mutant-route-tie-high-expert"
    interface_version = INTERFACE_VERSION

    def moe_route(self, logits, bias, top_k, routed_scaling, scoring="sqrtsoftplus", renormalize=True):
        flip = None if bias is None else bias.flip(-1)
        weights, ids = super().moe_route(logits.flip(-1), flip, top_k, routed_scaling, scoring, renormalize)
        return weights, logits.shape[-1] - 1 - ids


class DecodePathIgnoresPaddingKernels(Kernels):
    """Sparse attention whose one-token (decode) fast path reads ``-1`` indices as row 0."""

    name = "mutant-decode-ignores-padding"
    interface_version = INTERFACE_VERSION

    def sparse_attention(self, q, kv, indices, sinks, scale):
        if q.shape[0] == 1:
            indices = indices.clamp(min=0)
        return super().sparse_attention(q, kv, indices, sinks, scale)


class SqueezedRouteKernels(Kernels):
    """Routing that squeezes the token dim away, so a single token gets ``[top_k]`` outputs."""

    name = "mutant-squeezed-route"
    interface_version = INTERFACE_VERSION

    def moe_route(self, logits, bias, top_k, routed_scaling, scoring="sqrtsoftplus", renormalize=True):
        weights, ids = super().moe_route(logits, bias, top_k, routed_scaling, scoring, renormalize)
        return weights.squeeze(0), ids.squeeze(0)


class HeadDimTileKernels(Kernels):
    """Sparse attention whose score tile covers at most 256 channels: head dims past it lose the rest."""

    name = "mutant-head-dim-tile"
    interface_version = INTERFACE_VERSION

    def sparse_attention(self, q, kv, indices, sinks, scale):
        if q.shape[-1] <= 256:
            return super().sparse_attention(q, kv, indices, sinks, scale)
        t, h, d = q.shape
        if t == 0 or indices.shape[1] == 0:
            return q.new_zeros(t, h, d)
        rows = take_rows(kv, indices).float()
        s = torch.einsum("thd,tkd->thk", q[..., :256].float(), rows[..., :256]) * scale
        s = s.masked_fill((indices < 0)[:, None, :], float("-inf"))
        logits = torch.cat([s, sinks.float()[None, :, None].expand(t, h, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.einsum("thk,tkd->thd", p, rows).to(q.dtype)


class WindowTileKernels(Kernels):
    """A KV compressor whose window loop stops at 64 slots: V4's 128-token windows lose their newer half."""

    name = "mutant-window-tile"
    interface_version = INTERFACE_VERSION

    def compress_kv(self, kv, gate, position_bias, indices, prev_indices=None):
        if indices.shape[1] > 64:
            indices = indices.clone()
            indices[:, 64:] = -1
        return super().compress_kv(kv, gate, position_bias, indices, prev_indices)


class Bf16AccumAttentionKernels(Kernels):
    """Flash-style sparse attention that keeps its output accumulator in the input dtype between tiles of 64."""

    name = "mutant-bf16-accum-attention"
    interface_version = INTERFACE_VERSION

    def sparse_attention(self, q, kv, indices, sinks, scale):
        return tiled_attention(q, kv, indices, sinks, scale, tile=64, keep=q.dtype)


class Bf16PoolingCompressorKernels(Kernels):
    """A KV compressor that pools each window slot by slot, its running sums (weighted rows and normaliser) kept in
    the input dtype: a Triton loop over the window with a 16-bit accumulator."""

    name = "mutant-bf16-pooling-compressor"
    interface_version = INTERFACE_VERSION

    def compress_kv(self, kv, gate, position_bias, indices, prev_indices=None):
        if indices.shape[0] == 0:
            return kv.new_zeros(0, kv.shape[1] if prev_indices is None else kv.shape[1] // 2)
        c = kv.shape[1]
        series = [(indices, slice(0, c))] if prev_indices is None else [(prev_indices, slice(0, c // 2)), (indices, slice(c // 2, c))]
        vals, logits = [], []
        for rows, chans in series:
            valid = (rows >= 0)[..., None]
            vals.append(take_rows(kv, rows).float()[..., chans])
            z = take_rows(gate, rows).float()[..., chans] + position_bias.float()[:, chans]
            logits.append(z.masked_fill(~valid, float("-inf")))
        v, z = torch.cat(vals, 1), torch.cat(logits, 1)
        top = z.amax(1, keepdim=True)
        w = torch.exp(z - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
        num = torch.zeros(v.shape[0], v.shape[2])
        den = torch.zeros_like(num)
        for j in range(v.shape[1]):
            num = (num + w[:, j] * v[:, j]).to(kv.dtype).float()
            den = (den + w[:, j]).to(kv.dtype).float()
        return (num / torch.where(den > 0, den, torch.ones_like(den))).to(kv.dtype)


class Bf16SumOfSquaresKernels(Kernels):
    """RMSNorm whose sum of squares is kept in the input dtype between chunks of 64 channels."""

    name = "mutant-bf16-sum-of-squares"
    interface_version = INTERFACE_VERSION

    def rms_norm(self, x, weight, eps):
        xf = x.float()
        total = torch.zeros(*x.shape[:-1], 1)
        for a in range(0, x.shape[-1], 64):
            total = (total + xf[..., a : a + 64].square().sum(-1, keepdim=True)).to(x.dtype).float()
        y = xf * torch.rsqrt(total / x.shape[-1] + eps)
        return (y if weight is None else y * weight.float()).to(x.dtype)


class Bf16AccumExpertsKernels(Kernels):
    """Grouped experts whose GEMMs keep their partial sums in the input dtype between K tiles of 64."""

    name = "mutant-bf16-accum-experts"
    interface_version = INTERFACE_VERSION

    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        return expert_loop(self, x, topk_ids, topk_weights, w13, w2, limit, chunk=64, keep=x.dtype, reverse=False)


def visible_lists(table: torch.Tensor, token_seq: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """``[T, N]`` each token's visible table rows (-1 past them): the per-token lists the long-context ops avoid."""
    cols = torch.arange(table.shape[1])
    return torch.where(cols[None, :] < visible[:, None], table[token_seq], -1)


class EntryTopkTieHighKernels(Kernels):
    """The fused indexer top-k taking equal scores towards the higher entry (scores, then an unstable top-k)."""

    name = "mutant-entry-topk-tie-high"
    interface_version = INTERFACE_VERSION

    def indexer_topk(self, q, weights, keys, table, token_seq, visible, scale, k):
        lists = visible_lists(table, token_seq, visible)
        scores = self.indexer_scores(q, weights, keys, lists, scale)
        entries = torch.arange(table.shape[1]).expand_as(lists).contiguous()
        return self.topk_select(scores.flip(-1), entries.flip(-1), k)


class EntryTopkFirstTilesKernels(Kernels):
    """The fused indexer top-k whose tile loop stops after 16,384 entries: long contexts lose the rest."""

    name = "mutant-entry-topk-first-tiles"
    interface_version = INTERFACE_VERSION

    def indexer_topk(self, q, weights, keys, table, token_seq, visible, scale, k):
        return super().indexer_topk(q, weights, keys, table[:, :16384], token_seq, visible.clamp(max=16384), scale, k)


class EntryAttentionFirstTilesKernels(Kernels):
    """Attention over every entry whose tile loop stops after 4,096 entries."""

    name = "mutant-entry-attention-first-tiles"
    interface_version = INTERFACE_VERSION

    def entry_attention(self, q, kv, indices, table, token_seq, visible, sinks, scale):
        return super().entry_attention(q, kv, indices, table[:, :4096], token_seq, visible.clamp(max=4096), sinks, scale)


class AlternativeKernels(Kernels):
    """Correct in another way: tiled online-softmax attention walked backwards, experts pair by pair in
    fp32 K tiles with 16-bit operands, top-k and routing by a composite key instead of a stable sort, the
    long-context ops over per-token lists in one piece."""

    name = "alternative-correct"
    interface_version = INTERFACE_VERSION

    def sparse_attention(self, q, kv, indices, sinks, scale):
        return tiled_attention(q, kv, indices, sinks, scale, tile=32, keep=None, reverse=True)

    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        return expert_loop(self, x, topk_ids, topk_weights, w13, w2, limit, chunk=128, keep=None, reverse=True)

    def topk_select(self, scores, values, k):
        t, n = scores.shape
        out = torch.full((t, k), -1, dtype=torch.int64)
        take = min(k, n)
        if t == 0 or take == 0:
            return out
        # rank every column by (score descending, column ascending) with a pairwise count
        s = scores.float()
        cols = torch.arange(n)
        better = (s[:, None, :] > s[:, :, None]) | ((s[:, None, :] == s[:, :, None]) & (cols[None, :] < cols[:, None])[None])
        rank = better.sum(-1)  # [T, N]: how many columns precede each column
        order = torch.argsort(rank, dim=-1)[:, :take]
        picked = values.gather(1, order).to(torch.int64)
        out[:, :take] = torch.where(s.gather(1, order) > float("-inf"), picked, torch.full_like(picked, -1))
        return out

    def indexer_topk(self, q, weights, keys, table, token_seq, visible, scale, k):
        lists = visible_lists(table, token_seq, visible)
        entries = torch.arange(table.shape[1]).expand_as(lists).contiguous()
        # the specified stable top-k (this set's pairwise one would take [T, N, N] at 32,768 entries)
        return Kernels.topk_select(self, self.indexer_scores(q, weights, keys, lists, scale), entries, k)

    def entry_attention(self, q, kv, indices, table, token_seq, visible, sinks, scale):
        rows = torch.cat([indices, visible_lists(table, token_seq, visible)], dim=1)
        return self.sparse_attention(q, kv, rows, sinks, scale)


MUTANTS = {cls.name: cls.__name__ for cls in (
    TopkTieHighColumnKernels, RouteTieHighExpertKernels, DecodePathIgnoresPaddingKernels, SqueezedRouteKernels,
    HeadDimTileKernels, WindowTileKernels, Bf16AccumAttentionKernels, Bf16AccumExpertsKernels,
    Bf16PoolingCompressorKernels, Bf16SumOfSquaresKernels,
    EntryTopkTieHighKernels, EntryTopkFirstTilesKernels, EntryAttentionFirstTilesKernels,
)}
CORRECT = {AlternativeKernels.name: AlternativeKernels.__name__}

"""A dense float64 oracle of DeepSeek-V4's forward from a checkpoint in the release's layout, written from the
published math, with the KV rounding the model was trained with.

The published description is transformers' ``deepseek_v4`` modelling code (the
math) and DeepSeek's release (the tensor names, the stored FP8 / FP4 weights and
where its inference code rounds what it caches). This module re-derives every
step in plain PyTorch over whole sequences and imports nothing from
``deepinfer``: the config is read from ``config.json``, the tensors under the
release's names (``oracle_tensors``), the rounding from ``kv_rounding``.

Covered: interleaved-pair partial RoPE (``main`` on sliding layers, the
``compress`` rope, optionally YaRN, on compressed layers, their entries and the
indexer); the per-head unweighted q norm; the shared K=V head with sinks, a
sliding window, the inverse rope on the output and the grouped ``wo_a`` /
``wo_b``; CSA's overlapping compressor (each entry pools the previous window's
first half and its own window's second half) with its lightning indexer (an
overlapping compressor at ``index_head_dim``, ReLU scores weighted per head,
top-k over the visible entries); HCA's compressor (every visible entry); hash
routing then biased top-k routing with the shared expert; mHC with Sinkhorn,
each site collapsing with its own ``pre``; the ``hc_head`` collapse.

``rounding=True`` rounds what DeepSeek's inference code rounds (and only that), and
holds the compressors' pooling state (their per-token projections) in fp32:
after ``kv_norm`` and RoPE the window K=V's non-rotary channels to FP8 e4m3 in
blocks of 64 with the checkpoint's scale format (``ue8m0`` powers of two, else
fp32), the rotary channels kept (bf16); the compressed entries the same after
pooling, norm and RoPE; the indexer keys (after their compressor's pooling,
norm and RoPE) and queries (after RoPE) Walsh–Hadamard-rotated, then FP4 e2m1
in blocks of 32 with ue8m0 scales. The main attention's queries are not
rounded. A row narrower than a block is one block.

``hit`` / ``replay`` give the bounded replay of a prefix hit: the entries of
windows before ``hit`` are those of a forward over ``ids[:hit]`` (the cached
blocks), and only the tokens from ``hit - replay`` on are computed, their
windows and compressors seeing no earlier token.

Exact ties in a top-k choice are broken towards the lower index, as a stable
sort does; ``min_margin`` says how close any choice came to going the other way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .kv_rounding import e2m1_round, e4m3_round, hadamard
from .oracle_math import DTYPE, Rope, fold_rope, hc_collapse, hc_expand, hc_mixes, rms_norm, rope_frequencies, top_k_margin
from .oracle_tensors import CheckpointTensors

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def load_config(directory: Path) -> dict[str, Any]:
    """``config.json`` with the release's fields folded: layer types from ``compress_ratios`` (or given),
    hash layers from ``num_hash_layers``, the rope dim from ``qk_rope_head_dim``."""
    cfg = json.loads((Path(directory) / "config.json").read_text())
    if cfg.get("model_type") != "deepseek_v4":
        raise ValueError(f"{directory} is not a deepseek_v4 checkpoint")
    n = cfg["num_hidden_layers"]
    rates = {CSA: cfg.get("compress_rate_csa") or 4, HCA: cfg.get("compress_rate_hca") or 128}
    rates.update(cfg.get("compress_rates") or {})
    if cfg.get("layer_types") is None:
        by_ratio = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
        cfg["layer_types"] = [by_ratio[r] for r in cfg["compress_ratios"][:n]]
    cfg["layer_types"] = cfg["layer_types"][:n]
    cfg["ratio"] = [rates.get(t, 0) for t in cfg["layer_types"]]
    cfg["hash_layers"] = cfg.get("num_hash_layers", 3)
    cfg.setdefault("scoring_func", "sqrtsoftplus")
    cfg.setdefault("hc_eps", 1e-6)
    cfg.setdefault("rms_norm_eps", 1e-6)
    quant = cfg.get("quantization_config") or {}
    cfg["kv_scale"] = "ue8m0" if quant.get("scale_fmt") == "ue8m0" else "fp32"
    return cfg


@dataclass
class V4Result:
    """The oracle's logits and what a failing comparison needs to be explained."""

    #: ``[T - start, vocab]`` float64 logits of positions ``start ..``
    logits: torch.Tensor
    start: int = 0
    #: layer -> ``[E, head_dim]`` its compressed entries (as attended: rotated, rounded with ``rounding``)
    entries: dict[int, torch.Tensor] = field(default_factory=dict)
    #: CSA layer -> ``[E, index_head_dim]`` its indexer keys (as scored)
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    #: the smallest relative gap between the last kept and the first dropped score of any top-k choice
    #: (indexer, routing), exact ties excluded
    min_margin: float = math.inf
    #: top-k choices that fell inside an exact tie (broken towards the lower index)
    exact_ties: int = 0

    def note(self, values: torch.Tensor, k: int) -> None:
        margin, ties = top_k_margin(values, k)
        self.min_margin, self.exact_ties = min(self.min_margin, margin), self.exact_ties + ties


class _Model:
    """One checkpoint: its config, tensors, ropes and the rounding choice."""

    def __init__(self, directory: Path, rounding: bool) -> None:
        self.cfg = cfg = load_config(directory)
        self.t = CheckpointTensors(directory)
        self.rounding = rounding
        rd = cfg["qk_rope_head_dim"]
        self.rd = rd
        main, comp = fold_rope(cfg)
        maxpos = cfg.get("max_position_embeddings", 1 << 20)
        self.ropes = {name: Rope(*rope_frequencies(p, rd, maxpos)) for name, p in (("main", main), ("compress", comp))}

    # ----- rounding points -----

    def kv_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Window K=V rows and compressed entries as the cache holds them."""
        if not self.rounding:
            return x
        return e4m3_round(x, 64, self.cfg["kv_scale"], keep=self.rd)

    def index_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Indexer keys and queries as they are scored."""
        return e2m1_round(hadamard(x), 32) if self.rounding else x

    # ----- pieces -----

    def compress(self, x: torch.Tensor, start: int, first: int, prefix: str, ratio: int, width: int, overlap: bool) -> torch.Tensor:
        """``[E, width]`` normed, rotated entries of the windows ``[w·ratio, (w+1)·ratio)`` at or after ``first``
        that the tokens ``x`` (at positions ``start ..``) complete. Each entry is a per-channel softmax over its
        slots' gates (plus ``ape``) of their projections; with ``overlap`` the slots are the previous window's
        first halves and its own window's second halves (none before window 0). With ``rounding`` the
        projections are held and pooled in fp32, as the trained cache keeps its pooling state."""
        t = self.t
        state = torch.float32 if self.rounding else DTYPE
        kv = (x @ t(prefix + "wkv.weight").t()).to(state)
        gate = (x @ t(prefix + "wgate.weight").t()).to(state)
        ape = t(prefix + "ape").to(state)
        end = start + x.shape[0]
        w0, w1 = -(-first // ratio), end // ratio
        out = []
        for w in range(w0, w1):
            rows = torch.arange(w * ratio, (w + 1) * ratio) - start
            g = gate[rows] + ape
            if overlap:
                slots_kv, slots_gate = [kv[rows, width:]], [g[:, width:]]
                if w > 0:
                    if rows[0] - ratio < 0:
                        raise ValueError(f"window {w} needs the tokens before position {start}: replay at least {ratio}")
                    prev = rows - ratio
                    slots_kv.insert(0, kv[prev, :width])
                    slots_gate.insert(0, (gate[prev] + ape)[:, :width])
                skv, sg = torch.cat(slots_kv), torch.cat(slots_gate)
            else:
                skv, sg = kv[rows], g
            out.append((skv * torch.softmax(sg, dim=0)).sum(0))
        if not out:
            return torch.zeros(0, width, dtype=DTYPE)
        pooled = rms_norm(torch.stack(out).to(DTYPE), t(prefix + "norm.weight"), self.cfg["rms_norm_eps"])
        return self.ropes["compress"].rotate(pooled, torch.arange(w0, w1) * ratio)

    def attention(self, x: torch.Tensor, ids_start: int, layer: int, prior: V4Result | None, first: int, res: V4Result) -> torch.Tensor:
        """One layer's attention on its normed input ``x`` (tokens at positions ``ids_start ..``): the sliding
        window, plus the compressed entries (``prior``'s before ``first``) the layer's kind lets it see."""
        cfg, t = self.cfg, self.t
        p = f"layers.{layer}.attn."
        eps, nh, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["head_dim"]
        kind, ratio = cfg["layer_types"][layer], cfg["ratio"][layer]
        n = x.shape[0]
        positions = torch.arange(ids_start, ids_start + n)
        rope = self.ropes["main" if kind == SLIDING else "compress"]
        q_low = rms_norm(x @ t(p + "wq_a.weight").t(), t(p + "q_norm.weight"), eps)
        q = rms_norm((q_low @ t(p + "wq_b.weight").t()).view(n, nh, hd), None, eps)
        q = rope.rotate(q, positions)
        kv = self.kv_rows(rope.rotate(rms_norm(x @ t(p + "wkv.weight").t(), t(p + "kv_norm.weight"), eps), positions))
        i, j = positions[:, None], positions[None, :]
        allowed = (j <= i) & (i - j < cfg["sliding_window"])
        keys = kv
        if kind != SLIDING:
            cached = prior.entries[layer][: first // ratio] if prior is not None else torch.zeros(0, hd, dtype=DTYPE)
            new = self.kv_rows(self.compress(x, ids_start, first, p + "compressor.", ratio, hd, kind == CSA))
            entries = res.entries[layer] = torch.cat([cached, new])
            g = entries.shape[0]
            visible = (positions + 1) // ratio
            seen = torch.arange(g)[None, :] < visible[:, None]
            if kind == CSA:
                seen = self.indexer(x, q_low, positions, layer, prior, first, seen, res)
            keys = torch.cat([kv, entries])
            allowed = torch.cat([allowed, seen], dim=1)
        logits = torch.einsum("thd,sd->ths", q, keys) / math.sqrt(hd)
        logits = logits.masked_fill(~allowed[:, None, :], -math.inf)
        sink = t(p + "attn_sink")[None, :, None].expand(n, nh, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        out = rope.rotate(torch.einsum("ths,sd->thd", probs, keys), positions, inverse=True)
        groups = cfg["o_groups"]
        per = out.reshape(n, groups, -1)
        wa = t(p + "wo_a.weight").view(groups, -1, per.shape[-1])
        return torch.einsum("tgi,goi->tgo", per, wa).reshape(n, -1) @ t(p + "wo_b.weight").t()

    def indexer(self, x: torch.Tensor, q_low: torch.Tensor, positions: torch.Tensor, layer: int, prior: V4Result | None,
                first: int, seen: torch.Tensor, res: V4Result) -> torch.Tensor:
        """``[T, E]`` bool: the top ``index_topk`` visible entries of each query by the lightning indexer."""
        cfg, t = self.cfg, self.t
        p = f"layers.{layer}.attn.indexer."
        ih, ihd, ratio = cfg["index_n_heads"], cfg["index_head_dim"], cfg["ratio"][layer]
        cached = prior.index_keys[layer][: first // ratio] if prior is not None else torch.zeros(0, ihd, dtype=DTYPE)
        new = self.index_rows(self.compress(x, int(positions[0]), first, p + "compressor.", ratio, ihd, True))
        keys = res.index_keys[layer] = torch.cat([cached, new])
        q = self.ropes["compress"].rotate((q_low @ t(p + "wq_b.weight").t()).view(-1, ih, ihd), positions)
        q = self.index_rows(q)
        per_head = torch.relu(torch.einsum("thd,gd->thg", q, keys)) / math.sqrt(ihd)
        weights = (x @ t(p + "weights_proj.weight").t()) / math.sqrt(ih)
        scores = (per_head * weights[:, :, None]).sum(1).masked_fill(~seen, -math.inf)
        k = min(cfg["index_topk"], keys.shape[0])
        res.note(scores, k)
        order = scores.argsort(dim=-1, descending=True, stable=True)[:, :k]
        chosen = torch.zeros_like(seen)
        chosen.scatter_(1, order, scores.gather(1, order) > -math.inf)
        return chosen

    def expert(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """SwiGLU with the gate branch clamped to at most ``swiglu_limit`` and the up branch to ``±limit``."""
        t, limit = self.t, self.cfg.get("swiglu_limit")
        gate, up = x @ t(prefix + "w1.weight").t(), x @ t(prefix + "w3.weight").t()
        if limit:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (F.silu(gate) * up) @ t(prefix + "w2.weight").t()

    def moe(self, x: torch.Tensor, ids: torch.Tensor, layer: int, res: V4Result) -> torch.Tensor:
        """Routed experts (hash-chosen on the first layers, else by the biased scores), weighted by their
        normalised unbiased scores times ``routed_scaling_factor``, plus the shared expert."""
        cfg, t = self.cfg, self.t
        p = f"layers.{layer}.ffn."
        logits = x @ t(p + "gate.weight").t()
        fn = cfg["scoring_func"]
        scores = F.softplus(logits).sqrt() if fn == "sqrtsoftplus" else torch.sigmoid(logits) if fn == "sigmoid" else logits.softmax(-1)
        k = cfg["num_experts_per_tok"]
        if layer < cfg["hash_layers"]:
            chosen = t.raw(p + "gate.tid2eid")[ids].long()
        else:
            biased = scores + t(p + "gate.bias")
            res.note(biased, k)
            chosen = biased.topk(k, dim=-1).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * cfg["routed_scaling_factor"]
        out = torch.zeros_like(x)
        for e in range(cfg["n_routed_experts"]):
            rows, slot = torch.where(chosen == e)
            if rows.numel():
                out.index_add_(0, rows, weights[rows, slot, None] * self.expert(x[rows], f"{p}experts.{e}."))
        return out + self.expert(x, p + "shared_experts.")

    def forward(self, ids: list[int], start: int, prior: V4Result | None, first: int) -> V4Result:
        """The forward of ``ids[start:]`` at their positions, compressed windows before ``first`` from ``prior``."""
        cfg, t = self.cfg, self.t
        eps, hc = cfg["rms_norm_eps"], cfg["hc_mult"]
        hc_cfg = {"hc_mult": hc, "hc_eps": cfg["hc_eps"], "rms_norm_eps": eps, "hc_sinkhorn_iters": cfg["hc_sinkhorn_iters"]}
        tokens = torch.tensor(ids[start:], dtype=torch.long)
        res = V4Result(logits=torch.empty(0), start=start)
        streams = t("embed.weight")[tokens][:, None, :].expand(-1, hc, -1).clone()
        for layer in range(cfg["num_hidden_layers"]):
            p = f"layers.{layer}."
            for site in ("attn", "ffn"):
                pre, post, comb = hc_mixes(streams, t(f"{p}hc_{site}_fn"), t(f"{p}hc_{site}_scale"), t(f"{p}hc_{site}_base"), hc_cfg)
                x = rms_norm(hc_collapse(streams, pre), t(f"{p}{site}_norm.weight"), eps)
                y = self.attention(x, start, layer, prior, first, res) if site == "attn" else self.moe(x, tokens, layer, res)
                streams = hc_expand(y, streams, post, comb)
        flat = rms_norm(streams.flatten(1), None, eps)
        pre = torch.sigmoid(flat @ t("hc_head_fn").t() * t("hc_head_scale") + t("hc_head_base")) + cfg["hc_eps"]
        h = rms_norm(hc_collapse(streams, pre), t("norm.weight"), eps)
        res.logits = h @ t("head.weight").t()
        return res


def oracle_forward(directory: str | Path, ids: list[int], rounding: bool = False, hit: int = 0, replay: int = 0) -> V4Result:
    """The dense forward of ``ids`` from position 0 (with ``hit``: the bounded replay of a prefix hit of
    ``hit`` tokens that recomputes the last ``replay`` of them, logits from position ``hit - replay``)."""
    model = _Model(Path(directory), rounding)
    if not hit:
        return model.forward(ids, 0, None, 0)
    prior = model.forward(ids[:hit], 0, None, 0)
    res = model.forward(ids, hit - replay, prior, hit)
    res.min_margin, res.exact_ties = min(res.min_margin, prior.min_margin), res.exact_ties + prior.exact_ties
    return res

"""A dense, cache-free float64 oracle of DeepSeek V4.1's text forward, written from the published math.

The published description is transformers' main-branch ``deepseek_v41`` modelling
code; this module re-derives every step in plain PyTorch over one whole sequence
(no KV cache, no chunking) and imports nothing from ``deepinfer``: the config is
read from ``config.json``, the tensors from the ``*.safetensors`` files under
the release's names (FP8 / FP4 weights decoded by ``oracle_tensors``), the
tokenizer with ``tokenizers.Tokenizer.from_file``.

Covered: interleaved-pair partial RoPE (plain ``main`` rope on ratio-0 layers,
``compress`` rope, optionally YaRN, on compressed layers, the indexer and the
compressed entries); the shared-KV attention with sinks, a sliding window, the
inverse rope on the output and the grouped ``wo_a`` / ``wo_b``; the KV sources'
compressor (ratio 1: a normed per-token projection; ratio m: a softmax-gated
pooling of m tokens); indexer keys, scores, visibility, the two-level top-k and
the reuse of the last index source's selection; the MoE router and clamped
SwiGLU experts plus the shared expert; V4.1's mHC with Sinkhorn and its
one-site-late ``pre`` collapse; Engram (compressed vocabulary, prime bucket
layout, hash multipliers, n-gram hash, FP8 rows with UE8M0 scales, the gated
injection).

The QAT rounding of the published code, with ``rounding=True`` (``kv_rounding``),
the compressors' pooling state (their per-token projections) held in fp32:
after RoPE the window K=V, every channel, to FP8 e4m3 with ue8m0 scales per 32
channels; the compressed entries after pooling, norm and RoPE to FP4 e2m1 with
e4m3 scales per 16; the indexer keys (``k_norm(wk(latent))``, from the unrounded
latent, after RoPE) and queries (after RoPE) to FP4 e2m1 with ue8m0 scales per
32, not rotated. The published code skips a rounding whose channel count is not
a multiple of its block, so by default (``rounding=None``) the oracle refuses a
config whose ``head_dim`` is a multiple of 16 or whose ``index_head_dim`` is a
multiple of 32, and computes the unrounded math on any other; ``rounding=True``
needs both widths multiples of 32; ``rounding=False`` is the unrounded math on
any config (what a cache of plain rows computes).

``hit`` / ``replay`` give the bounded replay of a prefix hit: the entries and
indexer keys of windows before ``hit`` are those of a forward over
``ids[:hit]`` (the cached blocks), and only the tokens from ``hit - replay`` on
are computed, their sliding windows seeing no earlier token (Engram's n-grams
still read the earlier token ids).

Exact ties in a top-k choice (common on tiny configs: with few indexer heads
many entries score exactly 0 after the relu) are broken towards the lower index
(older entry, lower block), as a stable sort does; the published code leaves the
order to ``torch.topk``, so there it is unspecified.

``splice`` (``Splice``) puts images in the prompt: the rows replace the token
embeddings at the image positions, which choose experts with ``gate.bias_vl``
and are dead for Engram (``tests/helpers/v41_vision_oracle.py`` builds it).

The published code's cache-free path (``use_cache=False``) concatenates the
second KV source's entries onto the first source's; its cached path, the one
``forward`` takes by default, gives each KV source its own entries. The oracle
follows the cached path's semantics: each KV source replaces the shared entries.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .kv_rounding import e2m1_round, e4m3_round
from .oracle_math import DTYPE, Rope, fold_rope, hc_collapse, hc_expand, hc_mixes, rms_norm, rope_frequencies, top_k_margin
from .oracle_tensors import CheckpointTensors


# ----------------------------------------------------------------------------- config and tensors


@dataclass
class OracleResult:
    """The oracle's logits plus what a failing comparison needs to be explained."""

    #: ``[T, vocab]`` float64
    logits: torch.Tensor
    #: layer index -> ``[T, hidden]``: the attention input (normed collapse) of that layer
    attn_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    #: layer index -> ``[T, hc, hidden]``: the residual streams after that layer
    streams: dict[int, torch.Tensor] = field(default_factory=dict)
    #: the smallest gap, relative to the row's scale, between the last kept and the first dropped score
    #: of any discrete selection (indexer top-k, candidate blocks, expert routing), exact ties excluded:
    #: a tiny one means rounding could flip the choice
    min_margin: float = math.inf
    #: selections that fell inside an exact tie (e.g. several entries scoring exactly 0 after the relu);
    #: they are broken towards the lower index, as a stable sort does
    exact_ties: int = 0
    #: index source layer -> ``[T, G]`` its indexer scores (masked), for diagnosis
    index_scores: dict[int, torch.Tensor] = field(default_factory=dict)
    #: the position of the first row of ``logits`` (a bounded replay's start)
    start: int = 0
    #: KV source layer -> ``[G, head_dim]`` its compressed entries and ``[G, index_head_dim]`` indexer keys
    #: (rotated, rounded with ``rounding``)
    entries: dict[int, torch.Tensor] = field(default_factory=dict)
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class Splice:
    """Images in a prompt: which positions hold image tokens and the rows that replace their token embeddings."""

    #: ``[T]`` bool: the image positions
    mask: torch.Tensor
    #: ``[T, hidden]`` float64: the embedding of each image position (other rows are not read)
    rows: torch.Tensor

    def __getitem__(self, part: slice) -> "Splice":
        return Splice(self.mask[part], self.rows[part])


@dataclass
class _Run:
    """How one forward runs: the rounding, and for a bounded replay the first position it computes, the
    first position whose compressed windows it computes, and the forward over the cached prefix."""

    rounding: bool = False
    start: int = 0
    first: int = 0
    prior: OracleResult | None = None
    splice: Splice | None = None
    entries: dict[int, torch.Tensor] = field(default_factory=dict)
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)


def _load_text_config(directory: Path) -> dict[str, Any]:
    raw = json.loads((directory / "config.json").read_text())
    if raw.get("model_type") != "deepseek_v41":
        raise ValueError(f"{directory} is not a deepseek_v41 checkpoint")
    text = dict(raw["text_config"])
    text.setdefault("engram_pad_token_id", text.get("engram_pad_id", 2))
    text.setdefault("swiglu_limit", 10.0)
    text.setdefault("scoring_func", "sqrtsoftplus")
    text.setdefault("norm_topk_prob", True)
    text.setdefault("gate_temp", 1.0)
    text.setdefault("rms_norm_eps", 1e-20)
    text.setdefault("hc_eps", 1e-6)
    n = text["num_hidden_layers"]
    if text.get("candidate_source_layer_id") is None:
        kv = text["kv_source_layer_ids"]
        text["candidate_source_layer_id"] = kv[-1] if kv else -1
    text["compress_ratios"] = list(text["compress_ratios"][:n])
    return text


def _check_rounding(text: dict[str, Any], rounding: bool | None) -> bool:
    """Whether to round (see the module docstring), or a ``ValueError`` naming why the config does not fit."""
    hd, ihd = text["head_dim"], text["index_head_dim"]
    if rounding is None and (hd % 16 == 0 or ihd % 32 == 0):
        raise ValueError(
            f"head_dim={hd} / index_head_dim={ihd}: the published QAT fake quantization would apply (blocks of "
            "16 / 32 channels); pass rounding=True to model it or rounding=False for the unrounded math"
        )
    if rounding and (hd % 32 or ihd % 32):
        raise ValueError(f"rounding=True needs head_dim ({hd}) and index_head_dim ({ihd}) multiples of 32")
    return bool(rounding)


# ----------------------------------------------------------------------------- Engram


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def engram_primes(text: dict) -> list[list[list[int]]]:
    """``[layer][ngram - 2][head]`` bucket sizes: for each n-gram size the search restarts just above
    ``engram_vocab_size - 1``, taking the next prime not yet used anywhere."""
    used: set[int] = set()
    out = []
    for _ in text["engram_layer_ids"]:
        layer = []
        for _ in range(text["engram_max_ngram_size"] - 1):
            sizes, at = [], text["engram_vocab_size"] - 1
            for _ in range(text["engram_n_heads"]):
                at += 1
                while not _is_prime(at) or at in used:
                    at += 1
                used.add(at)
                sizes.append(at)
            layer.append(sizes)
        out.append(layer)
    return out


def hash_multipliers(layer_ids: list[int], max_ngram: int, vocab: int) -> np.ndarray:
    """``[layers, max_ngram]`` odd int64 multipliers from numpy's PCG64 seeded ``10007 · layer``,
    bounded so ``id · multiplier`` fits in int64."""
    bound = max(1, (np.iinfo(np.int64).max // vocab) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram,), dtype=np.int64) for layer in layer_ids]
    return np.stack(rows) * 2 + 1


def compressed_token_map(tokenizer_file: Path) -> tuple[list[int], int]:
    """Each token id's id in the compressed vocabulary: ids decoding to texts equal after NFKC, NFD,
    accent stripping, lowercasing, whitespace-run folding and stripping (a lone space survives) share
    one; a text holding U+FFFD (a partial UTF-8 byte) is keyed by its raw token string instead."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_file))
    keep_space = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), keep_space),
        normalizers.Strip(), normalizers.Replace(keep_space, " "),
    ])
    ids: dict[str, int] = {}
    lookup = []
    for token_id in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([token_id], skip_special_tokens=False)
        key = tok.id_to_token(token_id) if "\ufffd" in text else (norm.normalize_str(text) or text)
        lookup.append(ids.setdefault(key, len(ids)))
    return lookup, len(ids)


def engram_hash_ids(text: dict, token_ids: list[int], tokenizer_file: Path,
                    dead: list[bool] | None = None) -> dict[int, torch.Tensor]:
    """Layer -> ``[T, (N-1)·heads]`` table rows: for n = 2..N the XOR of the multiplied compressed ids
    of the n tokens ending at a position (the pad id before the start), modulo each head's prime, plus
    that (n, head) pair's offset in the layer's table. A ``dead`` position (an image token) cuts the
    n-grams reaching it as the start does: it and every older position read as the pad id."""
    lookup, size = compressed_token_map(tokenizer_file)
    if size != text["engram_compressed_vocab_size"]:
        raise ValueError(f"compressed vocabulary {size} != engram_compressed_vocab_size {text['engram_compressed_vocab_size']}")
    pad = lookup[text["engram_pad_token_id"]]
    n = text["engram_max_ngram_size"]
    layers = text["engram_layer_ids"]
    mult = hash_multipliers(layers, n, size)
    primes = engram_primes(text)
    comp = [lookup[t] for t in token_ids]
    out: dict[int, torch.Tensor] = {}
    for li, layer in enumerate(layers):
        flat = [p for sizes in primes[li] for p in sizes]
        offsets = np.concatenate([[0], np.cumsum(flat)[:-1]])
        rows = np.zeros((len(comp), len(flat)), dtype=np.int64)
        for pos in range(len(comp)):
            window, cut = [], False
            for s in range(n):
                cut = cut or pos - s < 0 or bool(dead and dead[pos - s])
                window.append(pad if cut else comp[pos - s])
            acc = int(window[0]) * int(mult[li, 0])
            col = 0
            for s in range(1, n):
                acc ^= int(window[s]) * int(mult[li, s])
                for p in primes[li][s - 1]:
                    rows[pos, col] = acc % p + offsets[col]
                    col += 1
        out[layer] = torch.from_numpy(rows)
    return out


def engram_rows(tensors: CheckpointTensors, layer: int, rows: torch.Tensor) -> torch.Tensor:
    """Dequantised table rows ``[..., head_dim]``: FP8 e4m3 codes times ``2^(e - 127)`` per 32 channels."""
    codes = tensors.raw(f"layers.{layer}.engram.embed.weight")[rows.flatten()]
    values = codes.to(torch.float32).to(DTYPE)
    if codes.dtype in (torch.float8_e4m3fn,):
        exps = tensors.raw(f"layers.{layer}.engram.embed.scale")[rows.flatten()].to(torch.int64)
        scales = torch.pow(torch.tensor(2.0, dtype=DTYPE), (exps - 127).to(DTYPE))
        values = (values.unflatten(-1, (-1, 32)) * scales[..., None]).flatten(-2)
    return values.view(*rows.shape, -1)


def engram(streams: torch.Tensor, rows: torch.Tensor, tensors: CheckpointTensors, layer: int, text: dict,
           image: torch.Tensor | None = None) -> torch.Tensor:
    """Adds one value per token to every stream, each stream gated by the sigmoid of the signed square
    root of its RMS-normalised, ``q_weight·k_weight``-weighted dot product with its own key; nothing at
    the ``image`` positions (``[T]`` bool)."""
    hc, d, eps = text["hc_mult"], text["hidden_size"], text["rms_norm_eps"]
    emb = engram_rows(tensors, layer, rows).flatten(1)
    kv = emb @ tensors(f"layers.{layer}.engram.wkv.weight").t()
    key, value = kv[:, : hc * d].view(-1, hc, d), kv[:, hc * d :]
    w = tensors(f"layers.{layer}.engram.q_weight") * tensors(f"layers.{layer}.engram.k_weight")
    inv = torch.rsqrt(streams.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (streams * w * key).sum(-1) * inv / math.sqrt(d)
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if image is not None:
        gate = gate.masked_fill(image[:, None], 0.0)
    return streams + gate[:, :, None] * value[:, None, :]


# ----------------------------------------------------------------------------- attention


@dataclass
class _Shared:
    """What a forward hands from layer to layer in a shared-KV group."""

    #: ``[G, head_dim]`` rotated compressed entries of the current group's KV source
    entries: torch.Tensor | None = None
    #: ``[G, index_head_dim]`` rotated indexer keys of the current group's KV source
    index_keys: torch.Tensor | None = None
    #: ``[T, G]`` bool: the compressed entries each query attends (the last index source's top-k)
    selected: torch.Tensor | None = None
    #: ``[T, G]`` bool: the candidate source's kept blocks
    candidates: torch.Tensor | None = None
    margin: float = math.inf
    ties: int = 0
    #: layer -> ``[T, G]`` indexer scores (after visibility and candidate masking), for diagnosis
    scores: dict[int, torch.Tensor] = field(default_factory=dict)

    def note(self, values: torch.Tensor, k: int) -> None:
        """Record how close a top-``k`` choice over ``values`` came to a different one."""
        margin, ties = top_k_margin(values, k)
        self.margin, self.ties = min(self.margin, margin), self.ties + ties


def compress(x: torch.Tensor, tensors: CheckpointTensors, layer: int, ratio: int, text: dict, start: int = 0,
             first: int = 0, state: torch.dtype = DTYPE) -> torch.Tensor:
    """``[G, head_dim]`` pre-rope latents of the groups ``[g·ratio, (g+1)·ratio)`` at or after position ``first``
    that the tokens ``x`` (at positions ``start ..``) complete: at ratio 1 ``norm(wkv x)`` per token, above it
    the per-channel softmax over each group's gates weighting their ``wkv x`` (held and pooled in ``state``,
    the dtype of the pooling state), normed."""
    p = f"layers.{layer}.attn.compressor."
    g0, g1 = -(-first // ratio), (start + x.shape[0]) // ratio
    rows = torch.arange(g0 * ratio, max(g1, g0) * ratio) - start
    kv = x[rows] @ tensors(p + "wkv.weight").t()
    if ratio > 1:
        groups = rows.shape[0] // ratio
        gate = (x[rows] @ tensors(p + "wgate.weight").t()).to(state).view(groups, ratio, -1)
        kv = (kv.to(state).view(groups, ratio, -1) * torch.softmax(gate, dim=1)).sum(1).to(DTYPE)
    return rms_norm(kv, tensors(p + "norm.weight"), text["rms_norm_eps"])


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int, shared: _Shared) -> torch.Tensor:
    """``[T, G]`` bool: per query, the ``topk_blocks`` blocks of ``block`` entries with the highest best
    score, the block holding its newest visible entry always among them, unreachable blocks never."""
    t, g = scores.shape
    nblocks = -(-g // block)
    padded = torch.full((t, nblocks * block), -math.inf, dtype=scores.dtype)
    padded[:, :g] = scores
    best = padded.view(t, nblocks, block).amax(-1)
    newest = (visible - 1).div(block, rounding_mode="floor")  # -1 when nothing is visible
    best = torch.where(torch.arange(nblocks)[None, :] == newest[:, None], math.inf, best)
    k = min(topk_blocks, nblocks)
    shared.note(best, k)
    order = best.argsort(dim=-1, descending=True, stable=True)
    keep = torch.zeros_like(best, dtype=torch.bool)
    keep.scatter_(1, order[:, :k], torch.ones(t, k, dtype=torch.bool))
    keep &= best > -math.inf
    return keep.repeat_interleave(block, dim=1)[:, :g]


def run_indexer(
    x: torch.Tensor, q_low: torch.Tensor, positions: torch.Tensor, tensors: CheckpointTensors, layer: int, text: dict,
    rope: Rope, shared: _Shared, is_candidate_source: bool, reads_candidates: bool, rounding: bool = False,
) -> None:
    """Scores every query against the group's indexer keys and publishes its top ``index_topk``
    visible entries (confined to the candidate blocks when this layer reads them)."""
    keys = shared.index_keys
    if keys is None or keys.shape[0] == 0:
        return
    p = f"layers.{layer}.attn.indexer."
    nh, hd, ratio = text["index_n_heads"], text["index_head_dim"], text["compress_ratios"][layer]
    q = (q_low @ tensors(p + "wq_b.weight").t()).view(-1, nh, hd)
    q = rope.rotate(q, positions)
    if rounding:
        q = e2m1_round(q, 32)
    per_head = torch.relu(torch.einsum("thd,gd->thg", q, keys)) / math.sqrt(hd)
    weights = (x @ tensors(p + "weights_proj.weight").t()) / math.sqrt(nh)
    scores = (per_head * weights[:, :, None]).sum(1)  # [T, G]
    g = keys.shape[0]
    visible = (positions + 1).div(ratio, rounding_mode="floor")
    scores = scores.masked_fill(torch.arange(g)[None, :] >= visible[:, None], -math.inf)
    if is_candidate_source:
        shared.candidates = candidate_blocks(scores, visible, text["candidate_topk_blocks"], text["candidate_block_size"], shared)
    elif reads_candidates and shared.candidates is not None:
        scores = scores.masked_fill(~shared.candidates, -math.inf)
    k = min(text["index_topk"], g)
    shared.note(scores, k)
    order = scores.argsort(dim=-1, descending=True, stable=True)[:, :k]
    selected = torch.zeros_like(scores, dtype=torch.bool)
    selected.scatter_(1, order, scores.gather(1, order) > -math.inf)
    shared.selected = selected
    shared.scores[layer] = scores


def attention(x: torch.Tensor, positions: torch.Tensor, tensors: CheckpointTensors, layer: int, text: dict,
              ropes: dict[str, Rope], shared: _Shared, run: _Run | None = None) -> torch.Tensor:
    """One layer's attention on its normed input ``x`` ``[T, D]`` (tokens at ``positions``)."""
    run = run or _Run()
    p = f"layers.{layer}.attn."
    eps = text["rms_norm_eps"]
    nh, hd, ratio = text["num_attention_heads"], text["head_dim"], text["compress_ratios"][layer]
    rope = ropes["compress" if ratio else "main"]
    q_low = rms_norm(x @ tensors(p + "wq_a.weight").t(), tensors(p + "q_norm.weight"), eps)
    q = rope.rotate((q_low @ tensors(p + "wq_b.weight").t()).view(-1, nh, hd), positions)
    kv = rope.rotate(rms_norm(x @ tensors(p + "wkv.weight").t(), tensors(p + "kv_norm.weight"), eps), positions)
    if run.rounding:
        kv = e4m3_round(kv, 32)

    t = x.shape[0]
    i, j = positions[:, None], positions[None, :]
    allowed = (j <= i) & (i - j < text["sliding_window"])
    keys = kv
    if ratio:
        if layer in text["kv_source_layer_ids"]:
            latent = compress(x, tensors, layer, ratio, text, run.start, run.first, torch.float32 if run.rounding else DTYPE)
            cached = -(-run.first // ratio)
            starts = ratio * (cached + torch.arange(latent.shape[0]))
            ik = latent @ tensors(p + "indexer.wk.weight").t()
            ik = ropes["compress"].rotate(rms_norm(ik, tensors(p + "indexer.k_norm.weight"), eps), starts)
            entries = ropes["compress"].rotate(latent, starts)
            if run.rounding:
                ik, entries = e2m1_round(ik, 32), e2m1_round(entries, 16, "e4m3")
            if run.prior is not None:
                ik = torch.cat([run.prior.index_keys[layer][:cached], ik])
                entries = torch.cat([run.prior.entries[layer][:cached], entries])
            shared.index_keys = run.index_keys[layer] = ik
            shared.entries = run.entries[layer] = entries
            shared.selected = None
        if layer in text["index_source_layer_ids"]:
            cand = text["candidate_source_layer_id"]
            run_indexer(x, q_low, positions, tensors, layer, text, ropes["compress"], shared,
                        is_candidate_source=layer == cand, reads_candidates=0 <= cand < layer, rounding=run.rounding)
        if shared.entries is not None and shared.entries.shape[0]:
            g = shared.entries.shape[0]
            sel = shared.selected if shared.selected is not None else torch.zeros(t, g, dtype=torch.bool)
            keys = torch.cat([kv, shared.entries])
            allowed = torch.cat([allowed, sel], dim=1)

    logits = torch.einsum("thd,sd->ths", q, keys) / math.sqrt(hd)
    logits = logits.masked_fill(~allowed[:, None, :], -math.inf)
    sink = tensors(p + "attn_sink")[None, :, None].expand(t, nh, 1)
    full = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(full, dim=-1)[..., :-1]
    out = torch.einsum("ths,sd->thd", probs, keys)
    out = rope.rotate(out, positions, inverse=True)
    groups = text["o_groups"]
    wo_a = tensors(p + "wo_a.weight")
    per = out.reshape(t, groups, -1)
    wa = wo_a.view(groups, -1, per.shape[-1])
    mid = torch.einsum("tgi,goi->tgo", per, wa).reshape(t, -1)
    return mid @ tensors(p + "wo_b.weight").t()


# ----------------------------------------------------------------------------- MoE


def expert(x: torch.Tensor, tensors: CheckpointTensors, prefix: str, limit: float | None) -> torch.Tensor:
    """SwiGLU with the up branch clamped to ``[-limit, limit]`` and the gate branch to at most ``limit``."""
    gate = x @ tensors(prefix + "w1.weight").t()
    up = x @ tensors(prefix + "w3.weight").t()
    if limit:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return (F.silu(gate) * up) @ tensors(prefix + "w2.weight").t()


def moe(x: torch.Tensor, tensors: CheckpointTensors, layer: int, text: dict, shared: _Shared,
        image: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts chosen by biased scores (``gate.bias_vl`` at the ``image`` positions, ``[T]`` bool),
    weighted by unbiased ones, plus the shared expert."""
    p = f"layers.{layer}.ffn."
    logits = x @ tensors(p + "gate.weight").t() / text["gate_temp"]
    fn = text["scoring_func"]
    if fn == "sqrtsoftplus":
        scores = F.softplus(logits).sqrt()
    elif fn == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    k = text["num_experts_per_tok"]
    bias = tensors(p + "gate.bias")
    if image is not None and bool(image.any()):
        bias = torch.where(image[:, None], tensors(p + "gate.bias_vl"), bias)
    biased = scores + bias
    shared.note(biased, k)
    chosen = biased.topk(k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if text["norm_topk_prob"] and k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * text["routed_scaling_factor"]
    out = torch.zeros_like(x)
    for e in range(text["n_routed_experts"]):
        rows, slot = torch.where(chosen == e)
        if rows.numel():
            y = expert(x[rows], tensors, f"{p}experts.{e}.", text["swiglu_limit"])
            out.index_add_(0, rows, weights[rows, slot, None] * y)
    return out + expert(x, tensors, p + "shared_experts.", text["swiglu_limit"])


# ----------------------------------------------------------------------------- the forward


def oracle_forward(directory: str | Path, token_ids: list[int], overrides: dict[str, torch.Tensor] | None = None,
                   swap_collapse: bool = False, rounding: bool | None = None, hit: int = 0, replay: int = 0,
                   splice: Splice | None = None) -> OracleResult:
    """The dense forward of one sequence at positions ``0..T-1``; with ``hit``, the bounded replay of a
    prefix hit of ``hit`` tokens recomputing the last ``replay`` of them (logits from ``hit - replay``).

    ``rounding``: see the module docstring. ``splice``: images in the prompt (``Splice``, over all ``T``).
    ``overrides`` replaces checkpoint tensors by name; ``swap_collapse`` collapses each site with its OWN ``pre``
    instead of the previous site's (both exist only to show the comparison can fail)."""
    directory = Path(directory)
    text = _load_text_config(directory)
    tensors = CheckpointTensors(directory)
    tensors.overrides = dict(overrides or {})
    rnd = _check_rounding(text, rounding)
    if splice is not None and splice.mask.shape[0] != len(token_ids):
        raise ValueError(f"a splice of {splice.mask.shape[0]} positions for {len(token_ids)} tokens")
    if not hit:
        return _forward(directory, text, tensors, token_ids, swap_collapse, _Run(rnd, splice=splice))
    prior = _forward(directory, text, tensors, token_ids[:hit], swap_collapse,
                     _Run(rnd, splice=None if splice is None else splice[:hit]))
    result = _forward(directory, text, tensors, token_ids, swap_collapse, _Run(rnd, hit - replay, hit, prior, splice))
    result.min_margin, result.exact_ties = min(result.min_margin, prior.min_margin), result.exact_ties + prior.exact_ties
    return result


def _forward(directory: Path, text: dict, tensors: CheckpointTensors, token_ids: list[int], swap_collapse: bool,
             run: _Run) -> OracleResult:
    """The forward of ``token_ids[run.start:]`` at their positions."""
    rd, maxpos = text.get("qk_rope_head_dim", 64), text.get("max_position_embeddings", 1048576)
    main, comp = fold_rope(text)
    ropes = {name: Rope(*rope_frequencies(params, rd, maxpos)) for name, params in (("main", main), ("compress", comp))}
    eps, hc = text["rms_norm_eps"], text["hc_mult"]

    ids = torch.tensor(token_ids[run.start:], dtype=torch.long)
    positions = torch.arange(run.start, len(token_ids))
    image = None if run.splice is None else run.splice[run.start:]
    dead = None if run.splice is None else run.splice.mask.tolist()
    hashes = engram_hash_ids(text, token_ids, directory / "tokenizer.json", dead) if text.get("engram_layer_ids") else {}
    if image is None:
        embeddings = tensors("embed.weight")[ids]
    else:  # an image position's id (the placeholder) need not be a row of the vocabulary
        embeddings = torch.where(image.mask[:, None], image.rows, tensors("embed.weight")[ids.masked_fill(image.mask, 0)])
    streams = embeddings[:, None, :].expand(-1, hc, -1).clone()
    image_mask = None if image is None else image.mask
    pre = torch.zeros(len(ids), hc, dtype=DTYPE)
    pre[:, 0] = 1.0
    shared = _Shared()
    result = OracleResult(logits=torch.empty(0), start=run.start)
    for layer in range(text["num_hidden_layers"]):
        p = f"layers.{layer}."
        if layer in hashes:
            streams = engram(streams, hashes[layer][run.start:], tensors, layer, text, image_mask)
        a_pre, a_post, a_comb = hc_mixes(streams, tensors(p + "hc_attn_fn"), tensors(p + "hc_attn_scale"),
                                         tensors(p + "hc_attn_base"), text)
        x = rms_norm(hc_collapse(streams, a_pre if swap_collapse else pre), tensors(p + "attn_norm.weight"), eps)
        result.attn_inputs[layer] = x
        streams = hc_expand(attention(x, positions, tensors, layer, text, ropes, shared, run), streams, a_post, a_comb)
        f_pre, f_post, f_comb = hc_mixes(streams, tensors(p + "hc_ffn_fn"), tensors(p + "hc_ffn_scale"),
                                         tensors(p + "hc_ffn_base"), text)
        x = rms_norm(hc_collapse(streams, f_pre if swap_collapse else a_pre), tensors(p + "ffn_norm.weight"), eps)
        streams = hc_expand(moe(x, tensors, layer, text, shared, image_mask), streams, f_post, f_comb)
        result.streams[layer] = streams
        pre = f_pre
    h = rms_norm(hc_collapse(streams, pre), tensors("norm.weight"), eps)
    result.logits = h @ tensors("head.weight").t()
    result.min_margin, result.exact_ties = shared.margin, shared.ties
    result.index_scores = shared.scores
    result.entries, result.index_keys = run.entries, run.index_keys
    return result


def oracle_logits(directory: str | Path, token_ids: list[int]) -> torch.Tensor:
    """``[T, vocab]`` float64 logits of ``token_ids`` (one sequence from position 0), dense and cache-free."""
    return oracle_forward(directory, token_ids).logits

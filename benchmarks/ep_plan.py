"""Analytic cost model of DeepSeek-V4-Flash under expert parallelism (EP): prefill's MoE layer and a whole decode
step, per EP degree; and V4-Flash and V4.1-Flash deployed disaggregated (prefill and decode pools) or colocated.

Deployment modelled: attention data-parallel (every rank attends over its own sequences), routed experts sharded
over N ranks (256/N each), every other weight -- attention, compressors, indexer, routers, hyper-connections,
shared expert, embeddings and head -- replicated on every rank, so it never shrinks with EP.

Prefill (one MoE layer; attention, the same work on every degree at a given batch per rank, is left out, and
with it whatever it could hide of the communication).
Per layer, on the busiest rank, for T tokens per rank (global batch N*T, as in DP-attention):

- weights read: the local experts that the global batch's N*T*6 routings hit, expected
  ``E_local * (1 - (1 - 1/256)^(N*T*6))`` (all of them at prefill), each read once per micro-batch, plus the
  shared expert; routed experts FP4 e2m1 with 1x32 UE8M0 scales (0.53 B/param), the rest FP8 e4m3 with
  128x128 scales;
- FLOPs: ``2*3*D*I`` per GEMM row: T*6 routed (token, expert) pairs with balanced routing, times the busiest
  rank's load imbalance, plus T shared-expert rows; each expert's rows padded to the grouped GEMM's row tile
  (the expected tile count of a Poisson-plus-skew row count). Run at the dense FP8 tensor-core peak times
  GEMM_EFFICIENCY: FP4 weights meet FP8 activations, which Blackwell's mixed-precision MMA runs at the FP8
  rate (assumed alike on Ascend); ``--fp4-math`` uses the FP4 peak instead;
- roofline per micro-batch: ``max(compute, memory)``;
- communication, as DeepEP does it: dispatch sends FP8 activations with one UE8M0 scale per 128 values,
  combine sends bf16, ``T*6*(N-1)/N*D*(1+1/128 + 2)`` bytes received per rank (times the imbalance), over the
  scale-up link for peers inside the scale-up domain and the scale-out NIC for the others (both at once),
  plus a fixed latency per collective (the scale-out one once any peer is outside the domain) and a cost per
  peer. No per-node deduplication (DeepEP's low-latency decode kernels send one copy per expert);
- schedule: the cheaper of one batch (work, then communication) and two overlapped micro-batches
  (DeepSeek's serving scheme): ``max(work, comm) + OVERLAP_RESIDUAL * min(work, comm)``, where each
  micro-batch streams its experts' weights again and pays its own collective latencies;
- load imbalance: the step waits for the busiest rank. A rank's routed rows sum its 256/N experts' loads,
  each with a coefficient of variation EXPERT_LOAD_CV (the popularity spread EPLB leaves) plus Poisson noise;
  the busiest of N ranks is ~ ``mean * (1 + cv_rank * sqrt(2 ln N))``. It scales compute, activation traffic
  and received bytes, not weight reads.

Decode (a whole step of one rank: 43 layers of attention and MoE, then the LM head; one new token per sequence,
MTP off). Every sequence is at the stated context length L (``--context``), the cache laid out as the engine's
``kv_cache_dtype fp8`` holds it (``--kv-format fp8``: DeepSeek's serving layout of FP8 K=V rows and FP4 indexer keys,
fp32 compressor state; the bytes come from deepinfer's record formats) or as its plain bf16 rows (``bf16``).

- KV read per token and layer: the 128-entry sliding window in every layer; in CSA layers (ratio 4) the
  lightning indexer scores all L/4 compressed keys (64 heads x 128) and core attention reads the top 512
  entries; in HCA layers (ratio 128) core attention reads all L/128 entries. Core attention is MQA over one
  K=V head of 512 with 64 query heads: ``4*64*512`` FLOPs per entry and query, in bf16;
- replicated weights: every projection (q low-rank pair, kv, compressors, indexer, grouped output pair,
  router, hyper-connection mixes, the head) streamed once per micro-batch, with its FP8 or bf16 activations in
  and bf16 out; each kernel is a roofline ``max(FLOPs / rate, bytes / HBM)`` and a part's kernels add up;
- the MoE parts (shared expert, routed experts, dispatch, combine) as in prefill, at the decode batch;
- schedule, per row the cheaper of: one batch, ``attn + max(shared, dispatch) + routed + combine`` per layer
  (the shared expert runs while dispatch is in flight); or DeepSeek's decode pipeline of two micro-batches
  (open-infra-index day 6 figure; profile-data decode): the compute stream runs
  ``SHARED(a) ATTN-0(b) | MLP(a) | ATTN-1(b) | SHARED(b) ATTN-0(a) | MLP(b) | ATTN-1(a)`` while the
  communication stream, which takes no SMs, runs dispatch(a), combine(a), dispatch(b), combine(b) under the
  1st, 3rd, 4th and 6th slots, so a layer is
  ``sum over a != b of max(SHARED(a) + ATTN-0(b), DISPATCH(a)) + MLP(a) + max(ATTN-1(b), COMBINE(a))``.
  ATTN-0 is everything before core attention (hyper-connection mixes, q/kv projections, compressors, the
  indexer's projections); ATTN-1 is the indexer's scoring, core attention, the output projection and the
  router. Routed-expert MLPs are never overlapped with communication in this structure;
- batch per rank: the largest B whose KV cache fits what HBM leaves after this rank's weights (local experts
  plus every replicated tensor) and DECODE_HBM_RESERVE, and whose whole step takes at most
  DECODE_STEP_SLO_S. Fewer experts per rank at larger EP leave more HBM for KV, so B can grow with EP;
  tokens/s per GPU is B over the step.

Objectives. Prefill: minimise GPU-seconds per token, i.e. maximise tokens/s per GPU, among the degrees whose
weights fit in HBM_WEIGHT_FRACTION of HBM. Decode: maximise tokens/s per GPU at the chosen batch. A phase's plan
is every degree whose worst throughput ratio to the best degree, over that phase's columns (batch sizes for
prefill, context lengths for decode), is within PLAN_TOLERANCE of the best such ratio; the knee is the first
degree whose doubling gains less than PLAN_TOLERANCE.

Left out of decode: sampling, scheduling and launch overheads, the MTP draft, attention load imbalance between
DP ranks (DeepSeek's decode balancer evens KV use), redundant experts, and elementwise passes under 1 % of a
layer's bytes (norms, RoPE, cache writes, the compressors' pooling). The DSpark draft pass is priced on its own
(``draft_pass``: its three SWA stages with the target's MoE, the LM head over its block positions, the context
projection), for ``benchmarks/spec_decode.py``; the tables here do not use it.

What decode finds, and why it is not DeepSeek's V3 plan everywhere. V4-Flash's routed experts are 147 GB in FP4
and its cache ~3.5 KB per token (V3's MLA: ~70 KB), so on 180 GB B200s the weights leave most of HBM to KV at
any EP >= 4: from EP 8 to EP 64 the KV budget, and with it the KV-bound batch, grows by ~12 %, not the
several-fold it grows for V3 on 80 GB H800s. What larger EP buys is fewer local experts to stream per step, and
that pays only while dispatch and combine stay on the scale-up link: a token's 6 routings move ~74 KB per layer,
up to 1.7 us on a 50 GB/s NIC once most peers are off the node, against ~0.25 us of its attention work per layer
at 4K on a B200 (V4's compressed attention is cheap), so the other micro-batch's attention cannot hide the NIC.
Decode therefore stays inside the NVLink domain: EP 8 on B200 HGX (with ConnectX-8 too), EP 16-64 on GB200 NVL72
(EP 128 leaves the rack); on the Ascend 950 SuperPoD, whose UnifiedBus domain spans every degree, throughput is
flat within 10 % from EP 8-16 up to 128-256, best at EP 16-64. Only there does the plan reach the seed's
"decode at 64-128".

Disaggregated deployment (prefill and decode pools, each at its own EP degree, the cache moved between them),
for V4-Flash and V4.1-Flash (``Model``: the same cost functions read either model's shapes; V4.1 shares each
ratio's compressed KV and indexer keys from its KV sources, CSA2, and has 384 experts, so only the degrees that
divide them), at a workload of ``--prompt-len`` + ``--output-len`` tokens per request (4K + 1K by default):

- prefill: a whole step of ``PREFILL_TOKENS_PER_RANK[0]`` prompt tokens per rank, every layer the MoE as above
  with the layer's attention (its projections, and core attention and the indexer at the prompts' mean position,
  a prompt's cache read once) added to the work that hides dispatch and combine, then the head over the prompts'
  last positions. Its degree is the narrowest within PLAN_TOLERANCE of the best tokens/s per card;
- decode: the decode rows above at the mean context ``prompt + output/2`` under the TPOT bound, the best degree;
- the cache one request moves, in the engine's bf16 (``--pd-kv-format``; ``fp8`` moves the packed records, as the
  engine's transfer does under ``kv_cache_dtype fp8``): every layer's window, the compressor
  states, the Engram token history, and ``prompt_len x`` the compressed entries and indexer keys per token (the
  figure ``CacheGeometry.bytes_per_token`` gives), over the link of each card (``KV_LINKS``: 400 Gb/s RDMA per
  GPU; 400 Gb/s RoCE per Ascend NPU assumed); against the decode step, the TTFT and each link's sustained load;
- pools in the ratio that makes the prefill pool's prompt tokens/s meet the decode pool's demand, and on 128
  cards: the seed's 64 + 64 (at its degrees: prefill EP 2-8, decode EP 64; and at the model's), the best
  balanced split, against colocated (every card runs both phases at one degree, steps alternating, so TPOT is
  the decode step over decode's share of time). On Ascend 950, prefill runs on 950PR and decode on 950DT,
  colocated on 950DT.

Left out there: queueing, prefix-cache hits, V4.1's Engram table look-ups (the tables are memory-mapped on the
host), its prefill fast path (off under EP, as in the engine) and the draft models.

Hardware: NVIDIA B200 in an 8-GPU HGX node (NVLink domain 8, ConnectX-7 400G; ``b200-cx8`` with 800G) and
in GB200 NVL72 (NVLink domain 72); Huawei Ascend 950PR and 950DT (PR is pitched at prefill, DT at decode;
``ascend950`` runs both) in an Atlas 950 SuperPoD UnifiedBus domain. Each figure is a named constant below
with its source.

    .venv/bin/python benchmarks/ep_plan.py [--hardware b200,gb200-nvl72,ascend950] [--expert-load-cv 0.2]
                                           [--fp4-math] [--context 4096,32768,131072] [--kv-format fp8|bf16]
                                           [--prompt-len 4096] [--output-len 1024] [--pd-kv-format bf16|fp8]
                                           [--kv-link-gbps 400] [--json]

Tables: one block per prefill batch or decode context, side by side, then the disaggregated tables; ``--json``
adds one JSON object (every row, the assumptions, the plan per hardware, and under "disaggregated" every model
on every system) as the last line of stdout. Pure Python but for the cache's row bytes, which come from deepinfer's
formats at the releases' configs (tests/helpers/published.py); a few seconds.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property, lru_cache

# ---- DeepSeek-V4-Flash, from its config.json ---------------------------------------------------------------

HIDDEN = 4096  # hidden_size
MOE_INTERMEDIATE = 2048  # moe_intermediate_size
ROUTED_EXPERTS = 256  # n_routed_experts
TOP_K = 6  # num_experts_per_tok
SHARED_EXPERTS = 1  # n_shared_experts
LAYERS = 43  # num_hidden_layers
VOCAB = 129280  # vocab_size
HEADS = 64  # num_attention_heads (one shared K=V head: num_key_value_heads 1)
HEAD_DIM = 512  # head_dim
ROPE_DIM = 64  # qk_rope_head_dim
Q_LORA_RANK = 1024  # q_lora_rank
O_LORA_RANK = 1024  # o_lora_rank
O_GROUPS = 8  # o_groups
INDEX_HEADS = 64  # index_n_heads
INDEX_HEAD_DIM = 128  # index_head_dim
INDEX_TOPK = 512  # index_topk: compressed entries each CSA query attends to
SLIDING_WINDOW = 128  # sliding_window: every layer also attends to its last 128 tokens
MAX_CONTEXT = 1048576  # max_position_embeddings
HC_MULT = 4  # hc_mult (hyper-connection streams)
HASH_LAYERS = 3  # num_hash_layers (router is a token-id hash table there)
COMPRESS_RATIOS = [0, 0] + [4 if i % 2 else 128 for i in range(1, 42)] + [0]  # compress_ratios
CSA_RATIO = 4  # compressed sparse attention, with the indexer; the 128 layers are heavily compressed (HCA)
LAYER_RATIOS = tuple(COMPRESS_RATIOS[:LAYERS])  # the trailing entry is the MTP draft layer, not modelled
FP8_BLOCK = 128  # quantization_config.weight_block_size, scales UE8M0 (1 byte)
FP4_GROUP = 32  # e2m1 weights, one UE8M0 scale per 32

FP4_BYTES_PER_PARAM = 0.5 + 1 / FP4_GROUP  # 0.53125
#: DeepEP quantises dispatched activations to FP8 with one UE8M0 scale per 128 values, whatever the weights' tile
ACTIVATION_SCALE_GROUP = 128

# ---- DeepSeek-V4.1-Flash, from its config.json -------------------------------------------------------------
# deepseek-ai/DeepSeek-V4.1-Flash, revision dba1be0a, text_config (tests/helpers/published.py keeps a copy). The
# same vocabulary, heads (64 x 512, RoPE 64), o_lora_rank / o_groups, top-6 of routed experts plus one shared,
# index_head_dim, index_topk, sliding window and hc_mult as V4-Flash; what differs is below. No hash-routed
# layers; every layer keeps its own window, and the compressed KV and indexer keys of each ratio are owned by
# its KV sources and shared with the layers after them (CSA2; deepinfer/models/deepseek_v41/text_config.py).
V41_HIDDEN = 5120  # hidden_size
V41_MOE_INTERMEDIATE = 2304  # moe_intermediate_size
V41_ROUTED_EXPERTS = 384  # n_routed_experts
V41_Q_LORA_RANK = 1280  # q_lora_rank
V41_INDEX_HEADS = 32  # index_n_heads
#: compress_ratios without the three trailing entries of the DSpark draft layers (not modelled)
V41_COMPRESS_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
V41_KV_SOURCES = (2, 8, 14, 20)  # kv_source_layer_ids: compress, own the entries and indexer keys, index
V41_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)  # index_source_layer_ids: run the indexer
V41_CANDIDATE_SOURCE = 20  # candidate_source_layer_id: later index sources score only inside its kept blocks
V41_CANDIDATE_ENTRIES = 2048 * 8  # candidate_topk_blocks x candidate_block_size entries per query
V41_ENGRAM_LAYERS = (1, 14)  # engram_layer_ids; the tables (~203 GB) are memory-mapped on the host, not in HBM
V41_ENGRAM_MAX_NGRAM = 4  # engram_max_ngram_size: 2- to 4-grams
V41_ENGRAM_HEADS = 8  # engram_n_heads
V41_ENGRAM_HEAD_DIM = 256  # engram_head_dim
V41_WEIGHT_BLOCK = 32  # quantization_config.weight_block_size [32, 32], scales UE8M0


# ---- the models as data --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerKind:
    """What one layer computes and keeps, as far as its cost tells layers apart.

    V4 keeps a cache per layer: sliding (ratio 0), CSA (ratio 4: overlapping windows, an indexer with its own
    compressor, scoring every compressed key, attending the top-k) and HCA (ratio 128: attending every entry).
    V4.1 (CSA2) shares them: a KV source owns its ratio's entries and the indexer keys derived from them and runs
    the indexer, a reindexing layer scores its source's keys (inside the candidate blocks after the candidate
    source), a reusing layer attends what its index source picked.
    """

    ratio: int = 0  # source tokens per compressed entry it attends over; 0: its sliding window only
    hashed: bool = False  # the router is a token-id hash table
    owns_entries: bool = False  # compresses its input and keeps the entries
    overlap: int = 1  # windows each entry pools (2: V4's CSA)
    index_keys: bool = False  # keeps indexer keys beside its entries
    index_compressor: bool = False  # those keys come from a compressor of their own (V4), not from the entries
    scores: str = ""  # the indexer's query side and its scope: "all" keys, the "candidates", "" (none)
    topk: bool = False  # core attention reads the indexer's top-k entries (else every entry)
    engram: bool = False  # an Engram n-gram module feeds the layer


@dataclass(frozen=True, eq=False)
class Model:
    """One model's shapes as the cost model reads them: dimensions, experts, weight formats, each layer's kind.
    Each model is one object, compared (and cached on) by identity."""

    name: str
    hidden: int
    moe_intermediate: int
    routed_experts: int
    top_k: int
    shared_experts: int
    vocab: int
    heads: int
    head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    hc_mult: int
    weight_block: int  # FP8 weights' scale tile, weight_block x weight_block
    layers: tuple[LayerKind, ...]
    hc_head: bool = True  # a hyper-connection mix collapses the streams before the head (V4.1 folds it away)
    compressor_bias: bool = True  # compressors add a learned per-slot bias (V4's ape)
    router_biases: int = 1  # float32 bias vectors of a learned router (V4.1 keeps a second, for image tokens)
    candidate_entries: int = 0  # entries per query the candidate blocks hold (0: no two-level top-k)
    engram_cols: int = 0  # input width of an Engram projection: n-gram orders x heads x head dim
    history_tokens: int = 0  # raw token ids a sequence keeps for the Engram n-gram hashes (n - 1 and the new one)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def expert_bytes(self) -> float:
        """One routed expert's w1, w3 (I x D) and w2 (D x I) in FP4 e2m1 with 1x32 UE8M0 scales."""
        return 3 * self.hidden * self.moe_intermediate * FP4_BYTES_PER_PARAM

    @property
    def flops_per_pair(self) -> int:
        """One token through one expert's three projections."""
        return 2 * 3 * self.hidden * self.moe_intermediate

    @property
    def shared_expert_bytes(self) -> float:
        return self.shared_experts * 3 * fp8_bytes(self.hidden, self.moe_intermediate, self.weight_block)

    @property
    def dispatch_bytes_per_pair(self) -> float:
        """On the wire per (token, expert) routing: FP8 activations with their scales."""
        return self.hidden * (1 + 1 / ACTIVATION_SCALE_GROUP)

    @property
    def combine_bytes_per_pair(self) -> float:
        """On the wire per (token, expert) routing back: the bf16 expert output."""
        return self.hidden * 2

    @property
    def activation_bytes_per_row(self) -> float:
        """HBM traffic per GEMM row besides weights: FP8 input, FP8 SwiGLU intermediate written and read, bf16
        output."""
        return self.hidden * (1 + 1 / ACTIVATION_SCALE_GROUP) + 2 * self.moe_intermediate + 2 * self.hidden

    @property
    def hc_apply_bytes_per_token(self) -> float:
        """One hyper-connection site per token, besides its mixing GEMM: pre-mix reads the hc_mult bf16 streams
        and writes the layer input, post-mix reads the streams and the layer output and writes the streams."""
        return (3 * self.hc_mult * self.hidden + 2 * self.hidden) * 2

    @property
    def routed_bytes(self) -> float:
        """Every layer's routed experts: what expert parallelism splits."""
        return self.n_layers * self.routed_experts * self.expert_bytes

    @cached_property
    def layer_kinds(self) -> dict[LayerKind, int]:
        """The layers' distinct kinds, counted, in order of first appearance."""
        kinds: dict[LayerKind, int] = {}
        for kind in self.layers:
            kinds[kind] = kinds.get(kind, 0) + 1
        return kinds

    @property
    def degrees(self) -> tuple[int, ...]:
        """The EP degrees of DEGREES that split the routed experts evenly."""
        return tuple(n for n in DEGREES if self.routed_experts % n == 0)


def fp8_bytes(rows: int, cols: int, block: int) -> float:
    """An FP8 e4m3 weight with one UE8M0 scale per ``block x block`` tile."""
    return float(rows * cols + math.ceil(rows / block) * math.ceil(cols / block))


def v4_layers() -> tuple[LayerKind, ...]:
    """V4-Flash's layers from compress_ratios and num_hash_layers."""
    kinds = []
    for layer, ratio in enumerate(LAYER_RATIOS):
        csa = ratio == CSA_RATIO
        kinds.append(LayerKind(ratio, layer < HASH_LAYERS, owns_entries=bool(ratio), overlap=2 if csa else 1,
                               index_keys=csa, index_compressor=csa, scores="all" if csa else "", topk=csa))
    return tuple(kinds)


def v41_layers() -> tuple[LayerKind, ...]:
    """V4.1-Flash's layers: each one's CSA2 role as V41TextConfig.layers() derives it from the source lists."""
    kinds = []
    for layer, ratio in enumerate(V41_COMPRESS_RATIOS):
        engram = layer in V41_ENGRAM_LAYERS
        if not ratio:
            kinds.append(LayerKind(engram=engram))
            continue
        owns = layer in V41_KV_SOURCES
        scores = ""
        if layer in V41_INDEX_SOURCES:
            scores = "candidates" if layer > V41_CANDIDATE_SOURCE else "all"
        kinds.append(LayerKind(ratio, owns_entries=owns, index_keys=owns, scores=scores, topk=True, engram=engram))
    return tuple(kinds)


V4_FLASH = Model("DeepSeek-V4-Flash", HIDDEN, MOE_INTERMEDIATE, ROUTED_EXPERTS, TOP_K, SHARED_EXPERTS, VOCAB, HEADS,
                 HEAD_DIM, Q_LORA_RANK, O_LORA_RANK, O_GROUPS, INDEX_HEADS, INDEX_HEAD_DIM, INDEX_TOPK,
                 SLIDING_WINDOW, HC_MULT, FP8_BLOCK, v4_layers())
V41_FLASH = Model("DeepSeek-V4.1-Flash", V41_HIDDEN, V41_MOE_INTERMEDIATE, V41_ROUTED_EXPERTS, TOP_K,
                  SHARED_EXPERTS, VOCAB, HEADS, HEAD_DIM, V41_Q_LORA_RANK, O_LORA_RANK, O_GROUPS, V41_INDEX_HEADS,
                  INDEX_HEAD_DIM, INDEX_TOPK, SLIDING_WINDOW, HC_MULT, V41_WEIGHT_BLOCK, v41_layers(),
                  hc_head=False, compressor_bias=False, router_biases=2, candidate_entries=V41_CANDIDATE_ENTRIES,
                  engram_cols=(V41_ENGRAM_MAX_NGRAM - 1) * V41_ENGRAM_HEADS * V41_ENGRAM_HEAD_DIM,
                  history_tokens=V41_ENGRAM_MAX_NGRAM)
MODELS: dict[str, Model] = {"v4-flash": V4_FLASH, "v41-flash": V41_FLASH}
EXPERT_BYTES = V4_FLASH.expert_bytes  # 13.4 MB per routed expert
SHARED_EXPERT_BYTES = V4_FLASH.shared_expert_bytes

# ---- the KV cache ------------------------------------------------------------------------------------------
# DeepSeek's serving layout for V4 ("MODEL1" in github.com/deepseek-ai/FlashMLA): csrc/api/sparse_decode.h checks
# ``448 + 64*2 + 448/64 + 1`` bytes per cached token -- tests/quant.py lays it out as 448 e4m3 values, the 64
# RoPE values in bf16, 7 UE8M0 scales (one per 64) and a pad byte -- and requires the same layout for the
# sliding-window cache and the compressed ("extra") cache. Its sparse decode kernel dequantises to bf16 and
# runs the attention math in bf16 (FlashMLA README).
# Indexer keys in FP4 with a 4-byte scale each: github.com/deepseek-ai/DeepGEMM tests/test_attention.py counts
# ``head_dim / 2 + 4`` bytes per key for fp8_fp4_paged_mqa_logits with FP4 (README news 2026.04.16: "FP4
# Indexer"); its logits are float32, written by the scoring kernel and read back by the top-k selection.
# The ``fp8`` figures are deepinfer's own records (``kv_cache_dtype fp8``: the family's ``KVFormat``s in
# deepinfer/models/<family>/cache.py, read from each release's config.json), which hold DeepSeek's byte counts
# for V4 (584 and 68) and V4.1's trained layouts (FP8 window rows, FP4 entries), with the compressors' pooling
# state in fp32 as the engine keeps it beside packed rows.
INDEX_LOGIT_BYTES = 4


@dataclass(frozen=True)
class KvRows:
    """Bytes of one cached row of each kind, for one model in one format."""

    window_bytes: float  # a sliding-window K=V row
    entry_bytes: float  # a compressed K=V entry
    index_key_bytes: float  # a CSA indexer key
    state_element_bytes: int  # one element of the compressors' pooling state


@dataclass(frozen=True)
class KvFormat:
    """How the cache stores rows: per model (by name) the bytes of each kind of row."""

    key: str
    index_fp4: bool  # the indexer scores at the FP4 tensor-core rate (else bf16)
    description: str
    rows: dict[str, KvRows]

    def of(self, model: "Model") -> KvRows:
        return self.rows[model.name]


def _release_configs() -> dict[str, dict]:
    """Each modelled release's published config.json (tests/helpers/published.py), by model name."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.published import V4_FLASH as V4_CONFIG, V41_FLASH as V41_CONFIG

    return {V4_FLASH.name: V4_CONFIG, V41_FLASH.name: V41_CONFIG}


def engine_rows(config: dict, kv_cache_dtype: str) -> KvRows:
    """The rows deepinfer's cache keeps for ``config`` under ``kv_cache_dtype`` (plain rows in bf16 for ``model``)."""
    import torch

    from deepinfer.models.registry import parse_config

    mc = parse_config(dict(config))
    f = mc.kv_cache_formats(kv_cache_dtype)
    bf16 = torch.bfloat16
    state = torch.empty((), dtype=f.state_dtype or bf16).element_size()
    return KvRows(f.row_bytes(f.window, mc.head_dim, bf16), f.row_bytes(f.entry, mc.head_dim, bf16),
                  f.row_bytes(f.index, mc.index_head_dim, bf16), state)


def kv_formats() -> dict[str, KvFormat]:
    """The two layouts modelled: deepinfer's packed records (fp8) and its plain bf16 rows."""
    configs = _release_configs()
    fp8 = {name: engine_rows(c, "fp8") for name, c in configs.items()}
    v4, v41 = fp8[V4_FLASH.name], fp8[V41_FLASH.name]
    return {
        "fp8": KvFormat("fp8", True,
                        f"deepinfer's kv_cache_dtype fp8 (DeepSeek's layouts): V4-Flash FP8 K=V rows ({v4.entry_bytes:.0f} B), FP4 indexer "
                        f"keys ({v4.index_key_bytes:.0f} B); V4.1-Flash FP8 window rows ({v41.window_bytes:.0f} B), FP4 entries "
                        f"({v41.entry_bytes:.0f} B) and keys ({v41.index_key_bytes:.0f} B); fp32 compressor state", fp8),
        "bf16": KvFormat("bf16", False,
                         f"bf16 K=V rows ({2 * HEAD_DIM:,} B) and indexer keys ({2 * INDEX_HEAD_DIM} B), deepinfer's kv_cache_dtype model",
                         {name: engine_rows(c, "model") for name, c in configs.items()}),
    }


KV_FORMATS: dict[str, KvFormat] = kv_formats()
#: DeepSeek's serving layout's bytes (above), as deepinfer's V4 records hold them
FP8_KV_ENTRY_BYTES = KV_FORMATS["fp8"].of(V4_FLASH).entry_bytes  # 584
FP4_INDEX_KEY_BYTES = KV_FORMATS["fp8"].of(V4_FLASH).index_key_bytes  # 68


def compressor_state_bytes(kind: LayerKind, model: Model = V4_FLASH, element_bytes: int = 2) -> float:
    """Per sequence and layer: the compressor's not-yet-pooled windows, kv and gate projections of each token.

    Sized as deepinfer/models/common/cache_spec.py sizes its state rings for one-token steps: ``overlap * ratio`` rows of
    width ``overlap * head_dim`` (V4's CSA entries also pool the previous window, overlap 2) plus, where the
    indexer keys have a compressor of their own (V4's CSA), its ``overlap * index_head_dim``; ``element_bytes``
    each (bf16, or fp32 beside a packed cache). A layer that owns no entries, or pools nothing (V4.1's ratio 1),
    keeps none.
    """
    if not (kind.owns_entries and kind.ratio > 1):
        return 0.0
    width = kind.overlap * model.head_dim + (kind.overlap * model.index_head_dim if kind.index_compressor else 0)
    return 2.0 * kind.overlap * kind.ratio * width * element_bytes


def kv_bytes_per_token(fmt: KvFormat, model: Model = V4_FLASH) -> float:
    """Cache one more token of context adds over all layers: the compressed entries and indexer keys of the layers
    that own them (deepinfer's ``CacheGeometry.bytes_per_token`` counts the same)."""
    rows = fmt.of(model)
    total = 0.0
    for kind in model.layers:
        if kind.owns_entries:
            total += (rows.entry_bytes + (rows.index_key_bytes if kind.index_keys else 0.0)) / kind.ratio
    return total


def kv_ring_bytes(fmt: KvFormat, model: Model = V4_FLASH) -> float:
    """Cache one sequence holds whatever its length, once past a window: every layer's sliding window, the
    compressors' states and the Engram token history (int64 ids)."""
    rows = fmt.of(model)
    total = sum(model.sliding_window * rows.window_bytes + compressor_state_bytes(kind, model, rows.state_element_bytes)
                for kind in model.layers)
    return total + model.history_tokens * 8


def kv_bytes_per_sequence(context: float, fmt: KvFormat, model: Model = V4_FLASH) -> float:
    """Cache one sequence of ``context`` tokens holds over all layers: windows, compressor states, entries."""
    return kv_ring_bytes(fmt, model) + context * kv_bytes_per_token(fmt, model)


GB = 1e9
TB = 1e12
PFLOPS = 1e15
GBIT = 1e9 / 8  # bytes per second in one Gb/s

# ---- published hardware figures ------------------------------------------------------------------------------
# NVIDIA B200, HGX/DGX B200 (8 GPUs, 1,000 W). nvidia.com/en-us/data-center/hgx/ and the DGX B200 datasheet
# (nvidia.com/en-us/data-center/dgx-b200/) publish per 8-GPU board: 1,440 GB HBM3e, 72 PFLOPS FP8 and 144
# PFLOPS FP4 Tensor Core (both "with sparsity"), fifth-generation NVLink at 1.8 TB/s per GPU, and 8 single-port
# ConnectX-7 400 Gb/s for the compute fabric. Per GPU that is 180 GB, 8 TB/s, 4.5 PF dense FP8, 9 PF dense FP4.
# Cross-checked against MLCommons Inference v6.0 (closed/Nebius/systems/nebius_b200_n1.json: "NVIDIA
# B200-SXM-180GB", "8x ConnectX-7 IB NDR 400Gb/s") and glennklockwood.com/garden/processors/B200 (HGX B200 at
# 1,000 W: FP8 4,500 / FP4 9,000 dense TFLOPS).
B200_HBM_BYTES = 180 * GB  # HBM3e per GPU as HGX/DGX B200 list it (192 GB is quoted for the bare B200 elsewhere)
B200_HBM_BW = 8 * TB  # "8 TB/s" HBM3e bandwidth per GPU
B200_FP8_DENSE = 4.5 * PFLOPS  # 9 PFLOPS FP8 with 2:4 sparsity per GPU, halved
B200_FP4_DENSE = 9 * PFLOPS  # 18 PFLOPS FP4 with sparsity per GPU, halved
NVLINK5_PER_DIRECTION = 900 * GB  # "1.8 TB/s" bidirectional NVLink 5 per GPU
HGX_NVLINK_DOMAIN = 8  # GPUs on one HGX B200 NVSwitch baseboard
CONNECTX7_BW = 400 * GBIT  # ConnectX-7 400 Gb/s per GPU (DGX B200 datasheet) = 50 GB/s; also assumed for GB200
# NVIDIA ConnectX-8 SuperNIC user manual (docs.nvidia.com/networking/display/connectx8supernic/introduction):
# InfiniBand or Ethernet at up to 800 Gb/s = 100 GB/s; GB300-class systems ship it.
CONNECTX8_BW = 800 * GBIT
# NVIDIA GB200 NVL72 (nvidia.com/en-us/data-center/gb200-nvl72/): 72 Blackwell GPUs in one NVLink domain,
# 130 TB/s NVLink in all (1.8 TB/s per GPU), 1,440 PFLOPS FP4 / 720 PFLOPS FP8 with sparsity per rack
# (= 10 / 5 PF dense per GPU at 1,200 W), ~13.4 TB HBM3e. MLCommons Inference v6.1
# (closed/Crusoe/systems/GB200-NVL72_GB200-186GB_aarch64x16_Dynamo.json) lists 186 GB per GPU.
GB200_HBM_BYTES = 186 * GB
GB200_FP8_DENSE = 5 * PFLOPS
GB200_FP4_DENSE = 10 * PFLOPS
NVL72_DOMAIN = 72

# Huawei Ascend 950 series, as announced at Huawei Connect 2025 (Shanghai, 18 Sep 2025, rotating chairman's
# keynote), as reported by a Huawei executive (pc.schihei.de/new-paradigms-for-ai-infrastructure),
# cloudnews.tech (huawei-shows-muscle-with-its-ai-chip-roadmap...) and lucaberton.com
# (blog/huawei-atlas-950-superpod-ai-infrastructure): both chips 1 PFLOPS FP8/MXFP8/HiF8 and 2 PFLOPS MXFP4,
# "2 TB/s interconnect"; 950PR with HiBL 1.0 HBM, 128 GB at 1.6 TB/s (Q1 2026); 950DT with HiZQ 2.0 HBM,
# 144 GB at 4 TB/s (Q4 2026). The CANN docs' own table (gitcode.com/cann/ops-transformer/issues/5487, from the
# Ascend 950 architecture white paper) gives 865 TFLOPS FP8 / 1,730 TFLOPS MXFP4 for the 950PR server SKU:
# the announced round figures are used here, not verified against shipping parts.
ASCEND950_FP8_DENSE = 1 * PFLOPS  # as announced
ASCEND950_FP4_DENSE = 2 * PFLOPS  # MXFP4, as announced
ASCEND950PR_HBM_BYTES = 128 * GB  # HiBL 1.0, as announced
ASCEND950PR_HBM_BW = 1.6 * TB  # HiBL 1.0, as announced
ASCEND950DT_HBM_BYTES = 144 * GB  # HiZQ 2.0, as announced
ASCEND950DT_HBM_BW = 4 * TB  # HiZQ 2.0, as announced
#: "2 TB/s interconnect" per chip, read as bidirectional (like NVLink's 1.8 TB/s): 1 TB/s each way
ASCEND950_UB_PER_DIRECTION = 1 * TB
# Atlas 950 SuperPoD (same reports): 8,192 Ascend 950DT in one UnifiedBus domain, 16 PB/s interconnect in all
# (~2 TB/s per chip), 2.1 us UB hardware latency (notebookcheck.info, Atlas 950 SuperCluster report). The PR
# also ships in SuperPoD servers; that it gets the same domain is an assumption.
ATLAS950_SUPERPOD_DOMAIN = 8192
#: beyond the SuperPoD: RoCE / UBoE; 400 Gb/s per chip assumed (never reached at N <= 256)
ASCEND950_SCALE_OUT_BW = 400 * GBIT

# ---- collective latency (software + hardware), not a datasheet figure -----------------------------------
# Dispatch/combine kernels have a fixed cost per collective (launch, barrier/flag round trips) well above the
# link's hardware latency: DeepEP's low-latency kernels (github.com/deepseek-ai/DeepEP README, H800 + CX7
# 400 Gb/s, 128 tokens) take 77 us dispatch / 114 us combine at EP 8 and 173 / 314 us at EP 64, rising with the
# peer count. Modelled as a fixed latency per collective plus a cost per peer.
SCALE_UP_COLLECTIVE_LATENCY_S = 15e-6  # NVLink / UnifiedBus all-to-all, fixed part
SCALE_OUT_COLLECTIVE_LATENCY_S = 30e-6  # RDMA all-to-all, fixed part (once any peer is off the domain)
PER_PEER_LATENCY_S = 0.1e-6  # per peer and collective: one write + one flag poll per destination

# ---- efficiency and serving assumptions ------------------------------------------------------------------------
GEMM_EFFICIENCY = 0.6  # of tensor-core peak, large grouped GEMMs
HBM_EFFICIENCY = 0.8  # of HBM peak, streaming expert weights
#: of link peak: DeepEP's README reports 153-158 GB/s on ~160 GB/s H800 NVLink and 39-46 GB/s on ~50 GB/s CX7 RDMA
LINK_EFFICIENCY = 0.85
#: rows per M block of a grouped GEMM; each expert's rows are padded to whole blocks (DeepGEMM's contiguous
#: layout aligns experts to 128 rows, its masked decode layout to its block M); one value for every phase
GEMM_ROW_TILE = 64
EXPERT_LOAD_CV = 0.2  # per-expert load variation within a step after EPLB re-placement (assumption)
MICRO_BATCHES = 2  # DeepSeek-style two-micro-batch overlap (prefill and decode)
OVERLAP_RESIDUAL = 0.1  # prefill: share of the shorter of work/comm that two micro-batches leave exposed
HBM_WEIGHT_FRACTION = 0.7  # prefill: weights may take this much of HBM; the rest is KV cache and activations
#: bf16 dense tensor-core peak over FP8's: HGX B200 lists 36 / 72 PFLOPS (FP16/BF16 / FP8, with sparsity, 8
#: GPUs) and GB200 NVL72 360 / 720 per rack; the Ascend 950 announcements give no bf16 figure, assumed alike
BF16_PER_FP8 = 0.5
#: of the bf16 (FP4 for FP4 indexer keys) peak, core attention and indexer scoring: FlashMLA's README has its
#: FP8-KV sparse decode kernel at 410 TFLOPS compute-bound on H800 SXM5, of 989 dense bf16 (NVIDIA H100/H800
#: datasheet, 1,979 with sparsity); assumed for the indexer too
ATTENTION_EFFICIENCY = 0.41
#: decode: HBM kept back from weights and KV for activations, DeepEP buffers, graphs and fragmentation (vLLM's
#: default gpu_memory_utilization of 0.9 leaves the same share to what its profiler cannot see)
DECODE_HBM_RESERVE = 0.10
DECODE_STEP_SLO_S = 0.050  # a whole decode step (43 layers + head): 20 tokens/s per sequence
#: decode contexts: 4K is DeepSeek's decode profile (github.com/deepseek-ai/profile-data: EP128, 4K prompts,
#: 128 requests per GPU; their V3/R1 service averaged 4,989 cached tokens per output token, open-infra-index
#: day 6); 32K and 128K stand for long-context and agentic use of V4's 1M window
DECODE_CONTEXTS = (4096, 32768, 131072)
PLAN_TOLERANCE = 0.10  # a degree is in the plan within 10 % of the best objective
# For scale: DeepSeek's own V3/R1 service (github.com/deepseek-ai/open-infra-index, 202502OpenSourceWeek,
# day_6_one_more_thing_deepseekV3R1_inference_system_overview.md) runs prefill at routed-expert EP32 over
# 4 nodes and decode at EP144 over 18 nodes of 8 x H800, with 32 redundant experts; V3's FP8 experts are 3.3x
# V4-Flash's FP4 ones, its MLA cache is ~70 KB per token (61 layers x 576 dims, bf16) against V4-Flash's
# ~3.5 KB, and H800 HBM is 80 GB at 3.35 TB/s, so weights and KV weigh far more there.

DEGREES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS_PER_RANK = (8192, 16384)


@dataclass(frozen=True)
class Hardware:
    key: str
    name: str
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    fp8_flops: float  # dense tensor-core peak
    fp4_flops: float
    scale_up_bw: float  # bytes/s per direction per device
    scale_up_domain: int  # devices in one scale-up domain
    scale_out_bw: float  # bytes/s per direction per device
    interconnect: str


HARDWARE: dict[str, Hardware] = {
    "b200": Hardware("b200", "B200, HGX 8-GPU NVLink domain, ConnectX-7 400G", B200_HBM_BYTES, B200_HBM_BW,
                     B200_FP8_DENSE, B200_FP4_DENSE, NVLINK5_PER_DIRECTION, HGX_NVLINK_DOMAIN, CONNECTX7_BW,
                     "NVLink 5 900 GB/s/dir in 8; 50 GB/s NIC beyond"),
    "b200-cx8": Hardware("b200-cx8", "B200, HGX 8-GPU NVLink domain, ConnectX-8 800G", B200_HBM_BYTES, B200_HBM_BW,
                         B200_FP8_DENSE, B200_FP4_DENSE, NVLINK5_PER_DIRECTION, HGX_NVLINK_DOMAIN, CONNECTX8_BW,
                         "NVLink 5 900 GB/s/dir in 8; 100 GB/s NIC beyond"),
    "gb200-nvl72": Hardware("gb200-nvl72", "GB200 NVL72, 72-GPU NVLink domain", GB200_HBM_BYTES, B200_HBM_BW,
                            GB200_FP8_DENSE, GB200_FP4_DENSE, NVLINK5_PER_DIRECTION, NVL72_DOMAIN, CONNECTX7_BW,
                            "NVLink 5 900 GB/s/dir in 72; 50 GB/s NIC beyond"),
    "ascend950pr": Hardware("ascend950pr", "Ascend 950PR (HiBL 1.0), Atlas 950 SuperPoD UB domain",
                            ASCEND950PR_HBM_BYTES, ASCEND950PR_HBM_BW, ASCEND950_FP8_DENSE, ASCEND950_FP4_DENSE,
                            ASCEND950_UB_PER_DIRECTION, ATLAS950_SUPERPOD_DOMAIN, ASCEND950_SCALE_OUT_BW,
                            "UB 1 TB/s/dir in 8192"),
    "ascend950dt": Hardware("ascend950dt", "Ascend 950DT (HiZQ 2.0), Atlas 950 SuperPoD UB domain",
                            ASCEND950DT_HBM_BYTES, ASCEND950DT_HBM_BW, ASCEND950_FP8_DENSE, ASCEND950_FP4_DENSE,
                            ASCEND950_UB_PER_DIRECTION, ATLAS950_SUPERPOD_DOMAIN, ASCEND950_SCALE_OUT_BW,
                            "UB 1 TB/s/dir in 8192"),
}
ALIASES = {"ascend950": ("ascend950pr", "ascend950dt")}


@dataclass
class Row:
    """One prefill MoE layer on the busiest rank, for one EP degree and per-rank batch."""

    hardware: str
    phase: str
    tokens_per_rank: int
    ep: int
    micro_batches: int  # 1: work then communication; 2: overlapped
    experts_per_rank: float
    experts_hit: float  # per micro-batch
    rows_per_expert: float  # per micro-batch: mean routed rows per expert (its global batch over 256 experts)
    imbalance: float  # busiest rank's routed rows over the mean, per micro-batch
    weight_read_mb: float  # per layer, all micro-batches: hit experts + shared expert
    weights_held_gb: float  # all layers' local experts + replicated tensors
    fits: bool
    compute_ms: float  # per step: summed over the 43 MoE layers
    memory_ms: float
    comm_ms: float
    layer_us: float  # one layer after overlap
    step_ms: float
    meets_slo: bool
    feasible: bool
    tokens_per_s_per_gpu: float  # 0 when infeasible
    tokens_per_s_system: float
    speedup_vs_prev: float | None  # tokens/s per GPU over the previous degree's (None when either is infeasible)
    best: bool = False


@dataclass
class DecodeRow:
    """One decode step on the busiest rank, for one EP degree and context, at the batch chosen for it."""

    hardware: str
    phase: str
    context: int
    ep: int
    micro_batches: int  # 1: one batch; 2: DeepSeek's two-micro-batch decode pipeline
    experts_per_rank: float
    weights_held_gb: float  # all layers' local experts + replicated tensors
    kv_budget_gb: float  # HBM left for KV after the weights and DECODE_HBM_RESERVE
    kv_mb_per_sequence: float
    batch_kv_max: int  # sequences per rank whose KV fits
    batch: int  # sequences per rank chosen: the largest that fits and meets the step bound (0: none)
    bound: str  # what stops the batch growing: "kv" (HBM), "slo" (step time) or "none" (infeasible)
    imbalance: float  # busiest rank's routed rows over the mean, per micro-batch
    attention_ms: float  # per step, summed over layers and micro-batches: ATTN-0 + ATTN-1 kernels
    moe_ms: float  # shared + routed expert kernels
    comm_ms: float  # dispatch + combine, as issued (hidden or not)
    head_ms: float  # the LM head
    layer_us: float  # one layer after overlap, mean over the 43
    step_ms: float
    meets_slo: bool
    feasible: bool
    tokens_per_s_per_gpu: float  # 0 when infeasible
    tokens_per_s_system: float
    tokens_per_s_per_sequence: float
    speedup_vs_prev: float | None  # tokens/s per GPU over the previous degree's (None when either is infeasible)
    best: bool = False


@dataclass
class PhasePlan:
    phase: str
    objective: str
    degrees: list[int]
    low: int
    high: int
    knee: int | None  # first degree past which doubling gains < 10 % (geometric mean over the columns)
    best_by_column: dict[str, int] = field(default_factory=dict)  # each batch / context's best degree


# ---- replicated weights ------------------------------------------------------------------------------------

BYTES_PER = {"bf16": 2, "f32": 4, "i64": 8}


@dataclass(frozen=True)
class Tensor:
    """One replicated weight, and the decode part that streams it.

    part: "pre" (before core attention), "post" (output projection, router, FFN mix), "head" (once per step),
    "gathered" (only the rows a token picks are read: embeddings, the hash-layer routing table).
    """

    name: str
    part: str
    rows: int
    cols: int
    fmt: str  # "fp8" (e4m3 with block x block UE8M0 scales), "bf16", "f32", "i64"
    gemm: bool = True  # tokens multiply through it (else a vector applied elementwise, or a table)
    groups: int = 1  # a grouped GEMM's input is groups * cols wide
    block: int = FP8_BLOCK  # an FP8 weight's scale tile

    @property
    def bytes(self) -> float:
        if self.fmt == "fp8":
            return fp8_bytes(self.rows, self.cols, self.block)
        return float(self.rows * self.cols * BYTES_PER[self.fmt])


def global_tensors(model: Model = V4_FLASH) -> list[Tensor]:
    """Tensors outside the layers: embeddings, the head's hyper-connection mix (V4), final norm, LM head."""
    d, hc = model.hidden, model.hc_mult
    mix = [Tensor("hc_head", "head", hc, hc * d, "f32"),
           Tensor("hc_head_base", "head", 1, hc + 1, "f32", gemm=False)] if model.hc_head else []
    return [Tensor("embed", "gathered", model.vocab, d, "bf16", gemm=False), *mix,
            Tensor("norm", "head", 1, d, "bf16", gemm=False),
            Tensor("head", "head", model.vocab, d, "bf16")]


@lru_cache(maxsize=None)
def layer_tensors(model: Model, kind: LayerKind) -> tuple[Tensor, ...]:
    """One layer's replicated tensors but the shared expert, for its kind."""
    d, hc, hd, q, b = model.hidden, model.hc_mult, model.head_dim, model.q_lora_rank, model.weight_block
    heads, groups, o_rank, experts = model.heads, model.o_groups, model.o_lora_rank, model.routed_experts
    mix = (2 + hc) * hc
    t = [Tensor("attn_norm", "pre", 1, d, "bf16", gemm=False),
         Tensor("hc_attn", "pre", mix, hc * d, "f32"),
         Tensor("hc_attn_base", "pre", 1, mix + 3, "f32", gemm=False),
         Tensor("wq_a", "pre", q, d, "fp8", block=b),
         Tensor("q_norm", "pre", 1, q, "bf16", gemm=False),
         Tensor("wq_b", "pre", heads * hd, q, "fp8", block=b),
         Tensor("wkv", "pre", hd, d, "fp8", block=b),
         Tensor("kv_norm", "pre", 1, hd, "bf16", gemm=False),
         Tensor("attn_sink", "post", 1, heads, "f32", gemm=False),
         Tensor("wo_a", "post", groups * o_rank, heads * hd // groups, "fp8", groups=groups, block=b),
         Tensor("wo_b", "post", d, groups * o_rank, "fp8", block=b),
         Tensor("ffn_norm", "post", 1, d, "bf16", gemm=False),
         Tensor("hc_ffn", "post", mix, hc * d, "f32"),
         Tensor("hc_ffn_base", "post", 1, mix + 3, "f32", gemm=False),
         Tensor("gate", "post", experts, d, "bf16")]
    gated = 2 if kind.ratio > 1 else 1  # kv and gate projections; a ratio-1 compressor pools nothing
    if kind.owns_entries:
        width = kind.overlap * hd
        t.append(Tensor("compressor.wkv_wgate", "pre", gated * width, d, "bf16"))
        if model.compressor_bias:
            t.append(Tensor("compressor.ape", "pre", kind.ratio, width, "f32", gemm=False))
        t.append(Tensor("compressor.norm", "pre", 1, hd, "bf16", gemm=False))
    if kind.scores:  # the lightning indexer's query side
        t += [Tensor("indexer.wq_b", "pre", model.index_heads * model.index_head_dim, q, "fp8", block=b),
              Tensor("indexer.weights_proj", "pre", model.index_heads, d, "bf16")]
    if kind.index_keys and kind.index_compressor:
        iwidth = kind.overlap * model.index_head_dim
        t.append(Tensor("indexer.compressor.wkv_wgate", "pre", gated * iwidth, d, "bf16"))
        if model.compressor_bias:
            t.append(Tensor("indexer.compressor.ape", "pre", kind.ratio, iwidth, "f32", gemm=False))
        t.append(Tensor("indexer.compressor.norm", "pre", 1, model.index_head_dim, "bf16", gemm=False))
    elif kind.index_keys:  # V4.1: the keys are a projection of each new entry
        t += [Tensor("indexer.wk", "pre", model.index_head_dim, hd, "bf16"),
              Tensor("indexer.k_norm", "pre", 1, model.index_head_dim, "bf16", gemm=False)]
    if kind.engram:
        t += [Tensor("engram.wkv", "pre", d * (hc + 1), model.engram_cols, "fp8", block=b),
              Tensor("engram.q_weight", "pre", hc, d, "bf16", gemm=False),
              Tensor("engram.k_weight", "pre", hc, d, "bf16", gemm=False)]
    if kind.hashed:
        t.append(Tensor("hash_table", "gathered", model.vocab, model.top_k, "i64", gemm=False))
    else:
        t.append(Tensor("gate_bias", "post", 1, model.router_biases * experts, "f32", gemm=False))
    return tuple(t)


@lru_cache(maxsize=None)
def replicated_weight_bytes(model: Model = V4_FLASH) -> float:
    """Bytes every rank holds whatever N: embeddings, head, attention, compressors, routers, shared experts."""
    total = sum(t.bytes for t in global_tensors(model))
    for kind, count in model.layer_kinds.items():
        total += count * (sum(t.bytes for t in layer_tensors(model, kind)) + model.shared_expert_bytes)
    return float(total)


def held_bytes(model: Model, n: int) -> float:
    """Weights one rank of EP degree ``n`` holds: its share of the routed experts and every replicated tensor."""
    return model.routed_bytes / n + replicated_weight_bytes(model)


#: V4-Flash's layers by (compress ratio, hash-routed), counted
LAYER_KINDS = {(kind.ratio, kind.hashed): count for kind, count in V4_FLASH.layer_kinds.items()}
REPLICATED_BYTES = replicated_weight_bytes(V4_FLASH)
ROUTED_BYTES = V4_FLASH.routed_bytes


# ---- the MoE layer -------------------------------------------------------------------------------------------

def load_imbalance(n: int, rows_per_expert: float, load_cv: float, experts: int = ROUTED_EXPERTS) -> float:
    """Expected busiest-rank routed rows over the mean, for ``experts``/N experts per rank."""
    if n == 1:
        return 1.0
    local = experts / n
    cv_rank = math.sqrt((load_cv**2 + 1 / rows_per_expert) / local)
    return 1 + cv_rank * math.sqrt(2 * math.log(n))


def padded_rows(rows: float, experts: float, load_cv: float) -> float:
    """Expected grouped-GEMM rows once each of ``experts`` groups sharing ``rows`` is padded to the row tile.

    An expert's rows are ~ Normal(m, sqrt(m + (cv*m)^2)) (Poisson arrivals on top of popularity spread), at least
    one row since it was hit; the expected tile count is ``1 + sum_k P(rows > k*tile)``.
    """
    if experts <= 0 or rows <= 0:
        return 0.0
    mean = rows / experts
    sd = math.sqrt(mean + (load_cv * mean) ** 2)
    tiles, k = 1.0, 1
    while True:
        tail = 0.5 * math.erfc((k * GEMM_ROW_TILE - mean) / (sd * math.sqrt(2)))
        if tail < 1e-6 and k * GEMM_ROW_TILE > mean:
            break
        tiles += tail
        k += 1
    return experts * GEMM_ROW_TILE * tiles


@dataclass
class MicroBatch:
    """One micro-batch's MoE layer on the busiest rank: its own grouped GEMMs (weights streamed again) and its
    own dispatch and combine. ``compute_s``, ``memory_s`` and ``comm_s`` sum the parts."""

    tokens: float
    experts_hit: float
    rows_per_expert: float
    imbalance: float
    weight_bytes: float
    routed_compute_s: float
    routed_memory_s: float
    shared_compute_s: float
    shared_memory_s: float
    dispatch_s: float
    combine_s: float

    @property
    def compute_s(self) -> float:
        return self.routed_compute_s + self.shared_compute_s

    @property
    def memory_s(self) -> float:
        return self.routed_memory_s + self.shared_memory_s

    @property
    def comm_s(self) -> float:
        return self.dispatch_s + self.combine_s


def collective_s(hw: Hardware, n: int, received_pairs: float, bytes_per_pair: float) -> float:
    """One all-to-all that delivers ``received_pairs`` routings to this rank: scale-up and scale-out links at
    once, plus the fixed and per-peer latency."""
    if n == 1:
        return 0.0
    in_domain = min(n, hw.scale_up_domain)
    up_bytes = received_pairs * (in_domain - 1) / (n - 1) * bytes_per_pair
    out_bytes = received_pairs * (n - in_domain) / (n - 1) * bytes_per_pair
    transfer = max(up_bytes / (hw.scale_up_bw * LINK_EFFICIENCY), out_bytes / (hw.scale_out_bw * LINK_EFFICIENCY))
    fixed = SCALE_OUT_COLLECTIVE_LATENCY_S if n > in_domain else SCALE_UP_COLLECTIVE_LATENCY_S
    return transfer + fixed + PER_PEER_LATENCY_S * (n - 1)


def micro_batch(hw: Hardware, n: int, tokens: float, *, load_cv: float, fp4_math: bool,
                model: Model = V4_FLASH) -> MicroBatch:
    """One micro-batch of ``tokens`` tokens per rank through one MoE layer on the busiest rank."""
    experts = model.routed_experts
    pairs = tokens * model.top_k
    local = experts / n
    rows_per_expert = n * pairs / experts
    hit = local * (1 - (1 - 1 / experts) ** (n * pairs))
    imbalance = load_imbalance(n, rows_per_expert, load_cv, experts)
    routed_rows = pairs * imbalance

    peak = (hw.fp4_flops if fp4_math else hw.fp8_flops) * GEMM_EFFICIENCY
    bw = hw.hbm_bw * HBM_EFFICIENCY
    routed_compute = padded_rows(routed_rows, hit, load_cv) * model.flops_per_pair / peak
    shared_compute = padded_rows(tokens, model.shared_experts, 0.0) * model.flops_per_pair / peak
    routed_memory = (hit * model.expert_bytes + routed_rows * model.activation_bytes_per_row) / bw
    shared_memory = (model.shared_expert_bytes + tokens * model.activation_bytes_per_row) / bw
    received = routed_rows * (n - 1) / n  # the busiest rank receives the most
    dispatch = collective_s(hw, n, received, model.dispatch_bytes_per_pair)
    combine = collective_s(hw, n, received, model.combine_bytes_per_pair)
    return MicroBatch(tokens, hit, rows_per_expert, imbalance, hit * model.expert_bytes + model.shared_expert_bytes,
                      routed_compute, routed_memory, shared_compute, shared_memory, dispatch, combine)


def layer_time(parts: list[MicroBatch], attention_s: float = 0.0) -> float:
    """Prefill: one micro-batch runs its work and communication back to back; two overlap one's communication
    with the other's work, leaving OVERLAP_RESIDUAL of the shorter side exposed. ``attention_s``: the layer's
    attention work over all micro-batches, which hides communication as the experts' work does."""
    work = sum(max(p.compute_s, p.memory_s) for p in parts) + attention_s
    comm = sum(p.comm_s for p in parts)
    if len(parts) == 1:
        return work + comm
    return max(work, comm) + OVERLAP_RESIDUAL * min(work, comm)


def moe_schedules(hw: Hardware, n: int, tokens: float, *, load_cv: float, fp4_math: bool,
                  model: Model = V4_FLASH) -> list[list[MicroBatch]]:
    """Prefill's two ways to run ``tokens`` tokens per rank through a MoE layer: one batch, or MICRO_BATCHES
    overlapped micro-batches (only where there is communication to hide)."""
    schedules = [[micro_batch(hw, n, tokens, load_cv=load_cv, fp4_math=fp4_math, model=model)]]
    if n > 1:
        part = micro_batch(hw, n, tokens / MICRO_BATCHES, load_cv=load_cv, fp4_math=fp4_math, model=model)
        schedules.append([part] * MICRO_BATCHES)
    return schedules


def weights_fit(hw: Hardware, model: Model, n: int) -> bool:
    """Prefill: the weights leave HBM_WEIGHT_FRACTION of HBM or more to KV cache and activations."""
    return held_bytes(model, n) <= HBM_WEIGHT_FRACTION * hw.hbm_bytes


def moe_layer(hw: Hardware, n: int, tokens: int, *, load_cv: float, fp4_math: bool, model: Model = V4_FLASH) -> Row:
    """Prefill: the cheaper of one batch and MICRO_BATCHES overlapped micro-batches (the engine picks)."""
    parts = min(moe_schedules(hw, n, tokens, load_cv=load_cv, fp4_math=fp4_math, model=model), key=layer_time)
    layer = layer_time(parts)
    first = parts[0]
    step = model.n_layers * layer
    held = held_bytes(model, n)
    fits = weights_fit(hw, model, n)
    per_gpu = tokens / step if fits else 0.0
    total = len(parts)
    layers = model.n_layers
    return Row(hw.key, "prefill", tokens, n, total, model.routed_experts / n, first.experts_hit,
               first.rows_per_expert, first.imbalance, total * first.weight_bytes / 1e6, held / GB, fits,
               layers * total * first.compute_s * 1e3, layers * total * first.memory_s * 1e3,
               layers * total * first.comm_s * 1e3, layer * 1e6, step * 1e3, True, fits, per_gpu,
               per_gpu * n, None)


def table(hw: Hardware, tokens: int, *, load_cv: float, fp4_math: bool, model: Model = V4_FLASH) -> list[Row]:
    return mark_best([moe_layer(hw, n, tokens, load_cv=load_cv, fp4_math=fp4_math, model=model)
                      for n in model.degrees])


def mark_best(rows: list) -> list:
    """Fill in each row's gain over the previous degree and flag the best feasible one."""
    for prev, row in zip(rows, rows[1:]):
        if prev.feasible and row.feasible:
            row.speedup_vs_prev = row.tokens_per_s_per_gpu / prev.tokens_per_s_per_gpu
    best = max(rows, key=lambda r: r.tokens_per_s_per_gpu)
    if best.feasible:
        best.best = True
    return rows


# ---- the decode step -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rates:
    """What one rank's kernels run at: FLOP/s per precision (peak x efficiency) and HBM bytes/s."""

    fp8: float
    bf16: float
    attention_bf16: float
    indexer: float
    hbm: float

    @classmethod
    def of(cls, hw: Hardware, fmt: KvFormat) -> Rates:
        bf16 = hw.fp8_flops * BF16_PER_FP8
        indexer = (hw.fp4_flops if fmt.index_fp4 else bf16) * ATTENTION_EFFICIENCY
        return cls(hw.fp8_flops * GEMM_EFFICIENCY, bf16 * GEMM_EFFICIENCY, bf16 * ATTENTION_EFFICIENCY, indexer,
                   hw.hbm_bw * HBM_EFFICIENCY)


def roofline(flops: float, rate: float, nbytes: float, hbm: float) -> float:
    """One kernel: bound by its FLOPs or by its HBM traffic, whichever takes longer."""
    return max(flops / rate, nbytes / hbm)


def tensor_s(t: Tensor, tokens: float, r: Rates) -> float:
    """One weight's kernel for ``tokens`` rows: the weight streamed once, FP8 (for FP8 weights) or bf16
    activations in, bf16 out."""
    if not t.gemm:
        return t.bytes / r.hbm
    act_in = 1 if t.fmt == "fp8" else 2
    nbytes = t.bytes + tokens * (t.groups * t.cols * act_in + t.rows * 2)
    return roofline(2.0 * t.rows * t.cols * tokens, r.fp8 if t.fmt == "fp8" else r.bf16, nbytes, r.hbm)


def attended_entries(kind: LayerKind, context: float, model: Model = V4_FLASH) -> float:
    """K=V entries one query at ``context`` reads: the window plus the top-k or every compressed entry."""
    window = min(context, model.sliding_window)
    if not kind.ratio:
        return window
    entries = context / kind.ratio
    return window + (min(model.index_topk, entries) if kind.topk else entries)


def scored_keys(kind: LayerKind, context: float, model: Model = V4_FLASH) -> float:
    """Indexer keys one query at ``context`` scores: every compressed key, or those of the candidate blocks."""
    if not kind.scores:
        return 0.0
    keys = context / kind.ratio
    return min(model.candidate_entries, keys) if kind.scores == "candidates" else keys


#: positions a prompt's attention is averaged over (evenly spaced midpoints)
PROMPT_POSITION_SAMPLES = 64


def mean_over_prompt(f: Callable[[float], float], prompt_len: float) -> float:
    """The mean of ``f(position)`` over a prompt's positions, at PROMPT_POSITION_SAMPLES evenly spaced midpoints."""
    k = PROMPT_POSITION_SAMPLES
    return sum(f((i + 0.5) * prompt_len / k) for i in range(k)) / k


def core_attention_s(kind: LayerKind, tokens: float, context: float, fmt: KvFormat, r: Rates,
                     model: Model = V4_FLASH, *, prompt: bool = False) -> float:
    """Core attention (MQA, 64 heads over one 512-wide K=V head) plus the indexer's scoring where the layer runs it.

    Decode: every query sits at ``context`` and reads its entries and keys from HBM itself. ``prompt``: the
    queries of prompts ``context`` tokens long, spread over their positions; a prompt's queries share each read
    of its cache (kept on chip), so only queries, outputs and indexer logits move.
    """
    if prompt:
        entries = mean_over_prompt(lambda p: attended_entries(kind, p, model), context)
        keys = mean_over_prompt(lambda p: scored_keys(kind, p, model), context)
    else:
        entries, keys = attended_entries(kind, context, model), scored_keys(kind, context, model)
    q_bytes = model.heads * model.head_dim * 2  # bf16 query in, bf16 output out
    rows = fmt.of(model)
    window = min(context, model.sliding_window)  # the window rows among the entries read
    kv_read = 0.0 if prompt else window * rows.window_bytes + (entries - window) * rows.entry_bytes
    seconds = roofline(4.0 * model.heads * model.head_dim * entries * tokens, r.attention_bf16,
                       tokens * (kv_read + 2 * q_bytes), r.hbm)
    if kind.scores:
        ih, ihd = model.index_heads, model.index_head_dim
        iq_bytes = ih * ihd * (0.5 if fmt.index_fp4 else 2)
        key_read = 0.0 if prompt else rows.index_key_bytes
        nbytes = tokens * (keys * (key_read + 2 * INDEX_LOGIT_BYTES) + iq_bytes)
        seconds += roofline(2.0 * ih * ihd * keys * tokens, r.indexer, nbytes, r.hbm)
    return seconds


@dataclass(frozen=True)
class DecodeParts:
    """One micro-batch's layer on the busiest rank, in seconds, cut where DeepSeek's decode pipeline cuts it."""

    attn_pre_s: float  # ATTN-0: hyper-connection mixes, q/kv projections, compressors, indexer projections
    attn_core_s: float  # ATTN-1: indexer scoring, core attention, output projection, FFN mix, router
    shared_s: float
    routed_s: float
    dispatch_s: float
    combine_s: float

    @property
    def compute_s(self) -> float:
        return self.attn_pre_s + self.attn_core_s + self.shared_s + self.routed_s

    @property
    def comm_s(self) -> float:
        return self.dispatch_s + self.combine_s


def projections_s(kind: LayerKind, tokens: float, r: Rates, model: Model = V4_FLASH) -> tuple[float, float]:
    """One layer's hyper-connection passes and replicated-weight kernels for ``tokens`` tokens, before core
    attention (ATTN-0) and after it (the output projection, the FFN mix, the router)."""
    hc_bytes = model.hc_apply_bytes_per_token
    pre = post = tokens * hc_bytes / r.hbm  # attention pre-mix / attention post-mix
    pre += tokens * hc_bytes / r.hbm  # the previous FFN's post-mix, after combine
    post += tokens * hc_bytes / r.hbm  # the FFN pre-mix, before the router
    for t in layer_tensors(model, kind):
        if t.part == "pre":
            pre += tensor_s(t, tokens, r)
        elif t.part == "post":
            post += tensor_s(t, tokens, r)
    return pre, post


def attention_s(kind: LayerKind, tokens: float, context: int, fmt: KvFormat, r: Rates,
                model: Model = V4_FLASH) -> tuple[float, float]:
    """ATTN-0 and ATTN-1 of one layer for one micro-batch of ``tokens`` decode tokens."""
    pre, post = projections_s(kind, tokens, r, model)
    return pre, post + core_attention_s(kind, tokens, context, fmt, r, model)


def serial_layer_s(p: DecodeParts) -> float:
    """One batch: attention, then the shared expert while dispatch is in flight, routed experts, combine."""
    return p.attn_pre_s + p.attn_core_s + max(p.shared_s, p.dispatch_s) + p.routed_s + p.combine_s


def overlapped_layer_s(a: DecodeParts, b: DecodeParts) -> float:
    """Two micro-batches in DeepSeek's decode pipeline: each one's dispatch runs under its shared expert and the
    other's ATTN-0, its routed experts run alone, its combine runs under the other's ATTN-1."""

    def half(x: DecodeParts, y: DecodeParts) -> float:
        return (max(x.shared_s + y.attn_pre_s, x.dispatch_s) + x.routed_s
                + max(y.attn_core_s, x.combine_s))

    return half(a, b) + half(b, a)


def head_s(tokens: float, r: Rates, model: Model = V4_FLASH) -> float:
    """Final hyper-connection mix (V4), norm and the bf16 LM head for one micro-batch."""
    return sum(tensor_s(t, tokens, r) for t in global_tensors(model) if t.part == "head")


@dataclass(frozen=True)
class DecodeStep:
    """A whole decode step of B sequences on one rank, under one schedule."""

    micro_batches: int
    moe: MicroBatch
    step_s: float
    attention_s: float  # kernels, summed over layers and micro-batches
    moe_s: float
    comm_s: float
    head_s: float


def decode_step(hw: Hardware, n: int, batch: int, context: int, micro_batches: int, fmt: KvFormat, *,
                load_cv: float, fp4_math: bool, model: Model = V4_FLASH) -> DecodeStep:
    """Step time of ``batch`` sequences split into ``micro_batches`` equal micro-batches."""
    r = Rates.of(hw, fmt)
    tokens = batch / micro_batches
    moe = micro_batch(hw, n, tokens, load_cv=load_cv, fp4_math=fp4_math, model=model)
    shared = max(moe.shared_compute_s, moe.shared_memory_s)
    routed = max(moe.routed_compute_s, moe.routed_memory_s)
    step = attn = 0.0
    for kind, count in model.layer_kinds.items():
        pre, core = attention_s(kind, tokens, context, fmt, r, model)
        parts = DecodeParts(pre, core, shared, routed, moe.dispatch_s, moe.combine_s)
        layer = serial_layer_s(parts) if micro_batches == 1 else overlapped_layer_s(parts, parts)
        step += count * layer
        attn += count * micro_batches * (pre + core)
    head = micro_batches * head_s(tokens, r, model)
    moe_s = model.n_layers * micro_batches * (shared + routed)
    comm = model.n_layers * micro_batches * moe.comm_s
    return DecodeStep(micro_batches, moe, step + head, attn, moe_s, comm, head)


def best_decode_step(hw: Hardware, n: int, batch: int, context: int, fmt: KvFormat, *, load_cv: float,
                     fp4_math: bool, model: Model = V4_FLASH) -> DecodeStep:
    """The cheaper of one batch and two overlapped micro-batches (two only when there is communication)."""
    options = [decode_step(hw, n, batch, context, 1, fmt, load_cv=load_cv, fp4_math=fp4_math, model=model)]
    if n > 1 and batch >= MICRO_BATCHES:
        options.append(decode_step(hw, n, batch, context, MICRO_BATCHES, fmt, load_cv=load_cv, fp4_math=fp4_math,
                                   model=model))
    return min(options, key=lambda s: s.step_s)


# ---- the DSpark draft pass -----------------------------------------------------------------------------------
# DeepSeek-V4-Flash-DSpark (the release's config.json and inference/config.json; deepinfer/models/common/dspark.py lays
# it out): three draft stages mtp.0..mtp.2 (n_mtp_layers; the config's two extra compress_ratios entries are
# those uncompressed SWA-128 blocks), dspark_block_size 5, dspark_target_layer_ids [40, 41, 42],
# dspark_markov_rank 256; each stage's routed MoE has the target's expert count, expert shape and top-k.
DRAFT_STAGES = 3
DRAFT_BLOCK = 5  # gamma: positions one pass proposes per request
DRAFT_TARGET_LAYERS = 3  # main_proj is [HIDDEN, 3 * HIDDEN]
DRAFT_MARKOV_RANK = 256
DRAFT_CONTEXT_WINDOW = 128  # dspark_context_window: context rows each stage's ring keeps per request
#: a ring row: one bf16 K=V row of HEAD_DIM, as deepinfer's DSparkRing holds it
DRAFT_RING_ENTRY_BYTES = 2 * HEAD_DIM
#: a draft stage's block: sliding window only (no compressor, no indexer), a learned router
DRAFT_STAGE_KIND = LayerKind()


@dataclass(frozen=True)
class DraftPass:
    """One DSpark draft pass on one rank, in seconds."""

    micro_batches: int  # of the stages' schedule (1 or 2, as the decode step chooses)
    stages_s: float  # the DRAFT_STAGES blocks, after overlap
    head_s: float  # stream collapse, final norm, LM head over every position, Markov bias per position
    context_s: float  # main_proj and each stage's K=V rows of the newly committed positions
    step_s: float


def draft_global_tensors() -> list[Tensor]:
    """The draft's weights outside its stages that a pass streams (the LM head is the target's)."""
    d = HIDDEN
    return [Tensor("main_proj", "context", d, DRAFT_TARGET_LAYERS * d, "fp8"),
            Tensor("main_norm", "context", 1, d, "bf16", gemm=False),
            Tensor("hc_head", "head", HC_MULT, HC_MULT * d, "f32"),
            Tensor("norm", "head", 1, d, "bf16", gemm=False),
            Tensor("head", "head", VOCAB, d, "bf16"),
            Tensor("markov_w2", "markov", VOCAB, DRAFT_MARKOV_RANK, "bf16"),
            Tensor("confidence_head", "head", 1, d + DRAFT_MARKOV_RANK, "f32")]


def draft_stage_parts(hw: Hardware, n: int, requests: float, r: Rates, *, load_cv: float,
                      fp4_math: bool) -> DecodeParts:
    """One draft stage for ``requests`` requests (``requests * DRAFT_BLOCK`` block positions) on one rank of EP
    degree ``n``, cut as the decode step cuts a target layer.

    ATTN-0: the hyper-connection pre-mixes (attention, and the previous block's FFN post-mix) and the
    projections before attention; ATTN-1: core attention (each position over its request's ring of
    DRAFT_CONTEXT_WINDOW rows plus the block's DRAFT_BLOCK rows, MQA with 64 heads; the ring read once per
    request, its rows bf16), the output projection, the FFN pre-mix and the router. The MoE is the target's at
    these tokens: the same expert shapes, top-k, sharding over the EP ranks, dispatch and combine.
    """
    tokens = requests * DRAFT_BLOCK
    pre, post = projections_s(DRAFT_STAGE_KIND, tokens, r)
    entries = DRAFT_CONTEXT_WINDOW + DRAFT_BLOCK
    q_bytes = HEADS * HEAD_DIM * 2
    kv_bytes = (requests * DRAFT_CONTEXT_WINDOW + tokens) * DRAFT_RING_ENTRY_BYTES  # the ring, the block's rows
    post += roofline(4.0 * HEADS * HEAD_DIM * entries * tokens, r.attention_bf16, kv_bytes + tokens * 2 * q_bytes,
                     r.hbm)
    moe = micro_batch(hw, n, tokens, load_cv=load_cv, fp4_math=fp4_math)
    return DecodeParts(pre, post, max(moe.shared_compute_s, moe.shared_memory_s),
                       max(moe.routed_compute_s, moe.routed_memory_s), moe.dispatch_s, moe.combine_s)


def draft_pass(hw: Hardware, n: int, requests: int, fmt: KvFormat, *, load_cv: float, fp4_math: bool) -> DraftPass:
    """Seconds of one DSpark draft pass proposing DRAFT_BLOCK tokens for each of ``requests`` requests on one rank
    of V4-Flash decode at EP degree ``n`` (0 requests: no pass).

    Priced like the decode step, with the same rates, rooflines and MoE model:

    - the DRAFT_STAGES stages over ``requests * DRAFT_BLOCK`` tokens (``draft_stage_parts``), each a V4 block
      with sliding-window attention only, mHC and a routed MoE sharded over the EP ranks like the target's (so
      its MoE costs what one target MoE layer costs at those tokens, dispatch and combine included, and its
      load imbalance is the target's), under the cheaper of one batch and two overlapped micro-batches;
    - the head over every block position at once: the last stage's stream collapse and norm, the target's bf16
      LM head (VOCAB x HIDDEN, bf16 logits out), the confidence head; plus the Markov bias
      (``markov_w2 . markov_w1[previous token]``), one GEMM of ``requests`` rows per position since each needs
      the token drafted before it (markov_w2 streamed DRAFT_BLOCK times; markov_w1 is a gathered table);
    - the context: main_proj (FP8, HIDDEN x 3*HIDDEN) and each stage's wkv over the positions the last
      verification committed, counted at their most (DRAFT_BLOCK + 1 per request).

    Left out, as the decode step leaves them out: sampling the drafted tokens, launches and elementwise passes
    (norms, RoPE, ring writes, the embedding gather). The EP ranks run the pass together (its MoE is a
    collective), so every rank is assumed to draft alike. The weights are streamed once per pass whatever
    ``requests`` is, so a pass for a few requests still costs the head's ~1 GB read.
    """
    if requests <= 0:
        return DraftPass(0, 0.0, 0.0, 0.0, 0.0)
    r = Rates.of(hw, fmt)
    tokens = requests * DRAFT_BLOCK
    schedules = []
    for micro_batches in (1, MICRO_BATCHES) if n > 1 and tokens >= MICRO_BATCHES else (1,):
        parts = draft_stage_parts(hw, n, requests / micro_batches, r, load_cv=load_cv, fp4_math=fp4_math)
        stage = serial_layer_s(parts) if micro_batches == 1 else overlapped_layer_s(parts, parts)
        schedules.append((DRAFT_STAGES * stage, micro_batches))
    stages, micro_batches = min(schedules)
    tensors = draft_global_tensors()
    head = sum(tensor_s(t, tokens, r) for t in tensors if t.part == "head")
    head += DRAFT_BLOCK * sum(tensor_s(t, requests, r) for t in tensors if t.part == "markov")
    committed = requests * (DRAFT_BLOCK + 1)
    wkv = next(t for t in layer_tensors(V4_FLASH, DRAFT_STAGE_KIND) if t.name == "wkv")
    context = sum(tensor_s(t, committed, r) for t in tensors if t.part == "context")
    context += DRAFT_STAGES * tensor_s(wkv, committed, r)
    return DraftPass(micro_batches, stages, head, context, stages + head + context)


def largest_batch(meets: Callable[[int], bool], limit: int) -> int:
    """The largest B in [1, limit] with ``meets(B)``, 0 if none; ``meets`` holds up to some B and not past it."""
    if limit < 1 or not meets(1):
        return 0
    if meets(limit):
        return limit
    lo, hi = 1, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo


def kv_budget_bytes(hw: Hardware, model: Model, n: int) -> float:
    """Decode: HBM left for KV after this rank's weights and DECODE_HBM_RESERVE (negative: the weights alone
    do not fit)."""
    return hw.hbm_bytes * (1 - DECODE_HBM_RESERVE) - held_bytes(model, n)


def kv_batch_limit(hw: Hardware, model: Model, n: int, context: float, fmt: KvFormat) -> int:
    """Decode: the most sequences of ``context`` tokens whose KV fits one rank's budget."""
    return max(0, math.floor(kv_budget_bytes(hw, model, n) / kv_bytes_per_sequence(context, fmt, model)))


def decode_row(hw: Hardware, n: int, context: int, fmt: KvFormat, *, load_cv: float, fp4_math: bool,
               model: Model = V4_FLASH, step_slo_s: float = DECODE_STEP_SLO_S) -> DecodeRow:
    """Decode at the largest batch per rank whose KV fits and whose step meets ``step_slo_s``."""
    held = held_bytes(model, n)
    budget = kv_budget_bytes(hw, model, n)
    per_seq = kv_bytes_per_sequence(context, fmt, model)
    kv_max = kv_batch_limit(hw, model, n, context, fmt)

    def step_of(batch: int) -> DecodeStep:
        return best_decode_step(hw, n, batch, context, fmt, load_cv=load_cv, fp4_math=fp4_math, model=model)

    batch = largest_batch(lambda b: step_of(b).step_s <= step_slo_s, kv_max)
    feasible = batch > 0
    bound = "none" if not feasible else ("kv" if batch == kv_max else "slo")
    step = step_of(max(batch, 1))
    per_gpu = batch / step.step_s if feasible else 0.0
    return DecodeRow(hw.key, "decode", context, n, step.micro_batches, model.routed_experts / n, held / GB,
                     max(budget, 0.0) / GB, per_seq / 1e6, kv_max, batch, bound, step.moe.imbalance,
                     step.attention_s * 1e3, step.moe_s * 1e3, step.comm_s * 1e3, step.head_s * 1e3,
                     (step.step_s - step.head_s) / model.n_layers * 1e6, step.step_s * 1e3,
                     step.step_s <= step_slo_s, feasible, per_gpu, per_gpu * n,
                     1 / step.step_s if feasible else 0.0, None)


def decode_table(hw: Hardware, context: int, fmt: KvFormat, *, load_cv: float, fp4_math: bool,
                 model: Model = V4_FLASH, step_slo_s: float = DECODE_STEP_SLO_S) -> list[DecodeRow]:
    return mark_best([decode_row(hw, n, context, fmt, load_cv=load_cv, fp4_math=fp4_math, model=model,
                                 step_slo_s=step_slo_s) for n in model.degrees])


# ---- disaggregated prefill and decode ------------------------------------------------------------------------
# DeepSeek serves V3/R1 with prefill and decode apart (open-infra-index day 6): each pool at its own EP degree,
# narrow for prefill (enough tokens per expert, less all-to-all), wide for decode (few experts to read per card
# per step), each request's cache moved from its prefill card to a decode card over RDMA (Mooncake's transfer
# engine). The seed's smallest efficient deployment: 64 prefill cards + 64 decode cards.

@dataclass(frozen=True)
class KvLink:
    """The link a card sends (prefill) or receives (decode) requests' caches over, per direction."""

    bw: float  # bytes/s
    name: str
    assumed: bool  # no published figure for this system: the value is an assumption


KV_LINKS: dict[str, KvLink] = {
    "b200": KvLink(CONNECTX7_BW, "ConnectX-7 400 Gb/s RDMA per GPU (DGX B200 datasheet)", False),
    "b200-cx8": KvLink(CONNECTX8_BW, "ConnectX-8 800 Gb/s RDMA per GPU", False),
    "gb200-nvl72": KvLink(CONNECTX7_BW, "400 Gb/s RDMA per GPU, as for B200 (pools span more than one rack)", True),
    # Huawei's CloudMatrix384 (Ascend 910C) gives each NPU up to 400 Gb/s of RoCE on its RDMA plane, the plane it
    # moves KV caches over between prefill and decode; nothing is published for the Atlas 950 SuperPoD's.
    "ascend950pr": KvLink(ASCEND950_SCALE_OUT_BW, "400 Gb/s RoCE per NPU, as CloudMatrix384's RDMA plane", True),
    "ascend950dt": KvLink(ASCEND950_SCALE_OUT_BW, "400 Gb/s RoCE per NPU, as CloudMatrix384's RDMA plane", True),
}


@dataclass(frozen=True)
class Workload:
    """Requests of one shape, framed as the phase tables frame them: prompt and output lengths, the prompt tokens
    a rank prefills per step, and the decode step bound (TPOT)."""

    prompt_len: int
    output_len: int
    prefill_tokens_per_rank: int = PREFILL_TOKENS_PER_RANK[0]
    tpot_slo_s: float = DECODE_STEP_SLO_S

    @property
    def decode_context(self) -> int:
        """Mean context over a request's decode steps."""
        return self.prompt_len + self.output_len // 2

    @property
    def prefill_steps(self) -> int:
        """Prefill steps one prompt takes (chunks of ``prefill_tokens_per_rank``; several prompts share one)."""
        return math.ceil(self.prompt_len / self.prefill_tokens_per_rank)


#: 4K prompts as in DeepSeek's decode profile; outputs a quarter of that, as their V3/R1 service read 608B input
#: tokens and wrote 168B a day (3.6 : 1, day 6); the TPOT bound of the decode tables
SEED_WORKLOAD = Workload(4096, 1024)
SEED_POOL_CARDS = 64  # cards per pool in the seed's 64 + 64
SEED_PREFILL_DEGREES = (2, 4, 8)  # the seed's narrow prefill groups
SEED_DECODE_DEGREE = 64  # the seed's wide decode group: one EP group of the whole 64-card pool


@dataclass(frozen=True)
class PdSystem:
    """Which cards each pool runs on, and the colocated deployment it is compared with."""

    key: str
    prefill: str  # hardware key
    decode: str
    colocated: str


def pd_systems(keys: list[str]) -> list[PdSystem]:
    """One system per hardware; with both Ascend 950 parts, Huawei's pairing (prefill on 950PR, decode on 950DT,
    colocated on 950DT) instead of each alone."""
    pair = "ascend950pr" in keys and "ascend950dt" in keys
    systems = [PdSystem(k, k, k, k) for k in keys if not (pair and k in ALIASES["ascend950"])]
    if pair:
        systems.append(PdSystem("ascend950", "ascend950pr", "ascend950dt", "ascend950dt"))
    return systems


@dataclass(frozen=True)
class PdScenario:
    """What every figure of one model on one system is computed under."""

    model: Model
    system: PdSystem
    workload: Workload
    fmt: KvFormat
    link: KvLink  # the decode side's (prefill sends at the same rate)
    load_cv: float
    fp4_math: bool


@dataclass
class PrefillStep:
    """One prefill step of one rank at EP degree ``ep``: ``tokens`` prompt tokens through every layer and the LM
    head over the prompts' last positions, at the cheaper of one batch and two overlapped micro-batches."""

    hardware: str
    phase: str
    ep: int
    tokens: int
    micro_batches: int
    attention_ms: float  # projections, hyper-connections, core attention and indexer, summed over layers
    moe_ms: float  # shared and routed experts' kernels (roofline), summed over layers and micro-batches
    comm_ms: float  # dispatch + combine, as issued (hidden or not)
    head_ms: float
    step_ms: float  # after overlap, with the head
    weights_held_gb: float
    feasible: bool  # the weights fit (HBM_WEIGHT_FRACTION)
    tokens_per_s_per_gpu: float  # 0 when infeasible
    speedup_vs_prev: float | None
    best: bool = False


def prefill_step(hw: Hardware, n: int, wl: Workload, fmt: KvFormat, *, load_cv: float, fp4_math: bool,
                 model: Model = V4_FLASH) -> PrefillStep:
    """A whole prefill step: each layer is the MoE of ``moe_layer`` with the layer's attention (projections and
    core attention over the prompts' positions) added to the work that hides dispatch and combine."""
    r = Rates.of(hw, fmt)
    tokens = wl.prefill_tokens_per_rank
    best = None
    for parts in moe_schedules(hw, n, tokens, load_cv=load_cv, fp4_math=fp4_math, model=model):
        per = tokens / len(parts)
        step = attention = 0.0
        for kind, count in model.layer_kinds.items():
            pre, post = projections_s(kind, per, r, model)
            core = core_attention_s(kind, per, wl.prompt_len, fmt, r, model, prompt=True)
            layer_attention = len(parts) * (pre + post + core)
            step += count * layer_time(parts, layer_attention)
            attention += count * layer_attention
        if best is None or step < best[0]:
            best = (step, attention, parts)
    step, attention, parts = best
    head = head_s(tokens / wl.prompt_len, r, model)
    fits = weights_fit(hw, model, n)
    total = step + head
    layers_mb = model.n_layers * len(parts)
    return PrefillStep(hw.key, "prefill", n, tokens, len(parts), attention * 1e3,
                       layers_mb * max(parts[0].compute_s, parts[0].memory_s) * 1e3, layers_mb * parts[0].comm_s * 1e3,
                       head * 1e3, total * 1e3, held_bytes(model, n) / GB, fits, tokens / total if fits else 0.0,
                       None)


def prefill_table(sc: PdScenario) -> list[PrefillStep]:
    """The whole prefill step at every degree the model allows, on the prefill pool's hardware."""
    hw = HARDWARE[sc.system.prefill]
    return mark_best([prefill_step(hw, n, sc.workload, sc.fmt, load_cv=sc.load_cv, fp4_math=sc.fp4_math,
                                   model=sc.model) for n in sc.model.degrees])


def pd_decode_table(sc: PdScenario) -> list[DecodeRow]:
    """Decode at the workload's mean context under its TPOT bound, per degree."""
    return decode_table(HARDWARE[sc.system.decode], sc.workload.decode_context, sc.fmt, load_cv=sc.load_cv,
                        fp4_math=sc.fp4_math, model=sc.model, step_slo_s=sc.workload.tpot_slo_s)


def best_row(rows: list, degrees: tuple[int, ...] | None = None):
    """Decode's degree: the feasible row (among ``degrees`` if given) of most tokens/s per GPU; None if none."""
    fit = [r for r in rows if r.feasible and (degrees is None or r.ep in degrees)]
    return max(fit, key=lambda r: r.tokens_per_s_per_gpu, default=None)


def narrowest_near_best(rows: list, degrees: tuple[int, ...] | None = None):
    """Prefill's degree: the narrowest feasible row (among ``degrees`` if given) within PLAN_TOLERANCE of the most
    tokens/s per GPU there; None if none. Prefill's tokens/s per card hardly moves with the degree (a prefill
    batch hits every expert whatever it is), so the smallest group that keeps up is the better unit: fewer
    all-to-all peers, a pool that grows in finer steps, a failure that takes fewer cards."""
    top = best_row(rows, degrees)
    if top is None:
        return None
    near = [r for r in rows if r.feasible and (degrees is None or r.ep in degrees)
            and r.tokens_per_s_per_gpu >= (1 - PLAN_TOLERANCE) * top.tokens_per_s_per_gpu]
    return min(near, key=lambda r: r.ep)


def prefill_time_s(wl: Workload, prefill: PrefillStep) -> float:
    """Seconds from a prompt's first prefill step to its last."""
    return prefill.step_ms / 1e3 * wl.prefill_steps


def disaggregated_ttft_s(wl: Workload, prefill: PrefillStep, transfer_s: float, decode_step_s: float) -> float:
    """Prefill, the cache's transfer, then the decode step that emits the next token; queueing left out."""
    return prefill_time_s(wl, prefill) + transfer_s + decode_step_s


def prefill_cards_per_decode_card(wl: Workload, prefill: PrefillStep, decode: DecodeRow) -> float:
    """A balanced pipeline's pool ratio: a request's prefill card-seconds over its decode card-seconds, so that
    the prefill pool's prompt tokens/s meet what the decode pool's requests need."""
    return (wl.prompt_len / prefill.tokens_per_s_per_gpu) / (wl.output_len / decode.tokens_per_s_per_gpu)


@dataclass
class KvTransfer:
    """One request's cache moved from its prefill card to its decode card, and what the link makes of it.

    Mooncake moves it while the prefill card runs its next step and the decode card keeps stepping, so the
    transfer delays only this request's first decode step (``transfer_ms`` against ``decode_step_ms``) and adds
    to its TTFT (``ttft_share``), as long as each card's link keeps up with the caches it sends or receives
    (``*_link_load`` below 1).
    """

    prompt_len: int
    per_token_bytes: float  # compressed entries and indexer keys of every layer, per prompt token
    entry_bytes: float  # prompt_len x per_token_bytes
    ring_bytes: float  # windows, compressor states, token history: what any sequence holds
    total_bytes: float
    link_gbps: float
    link: str
    link_assumed: bool
    transfer_ms: float
    decode_step_ms: float
    ttft_share: float  # of the TTFT (prefill, transfer, first decode step)
    prefill_link_load: float  # a prefill card's sustained cache output over its link
    decode_link_load: float  # a decode card's sustained cache intake over its link
    overlaps: bool  # within one decode step and both links keep up


def kv_transfer(sc: PdScenario, prefill: PrefillStep, decode: DecodeRow) -> KvTransfer:
    """The workload's prompt cache over the system's link, against the pools' steps and request rates."""
    wl, link = sc.workload, sc.link
    per_token = kv_bytes_per_token(sc.fmt, sc.model)
    ring = kv_ring_bytes(sc.fmt, sc.model)
    total = kv_bytes_per_sequence(wl.prompt_len, sc.fmt, sc.model)
    rate = link.bw * LINK_EFFICIENCY
    seconds = total / rate
    decode_step_s = decode.step_ms / 1e3
    prefill_load = prefill.tokens_per_s_per_gpu / wl.prompt_len * total / rate
    decode_load = decode.tokens_per_s_per_gpu / wl.output_len * total / rate
    ttft = disaggregated_ttft_s(wl, prefill, seconds, decode_step_s)
    return KvTransfer(wl.prompt_len, per_token, wl.prompt_len * per_token, ring, total, link.bw / GBIT, link.name,
                      link.assumed, seconds * 1e3, decode.step_ms, seconds / ttft, prefill_load, decode_load,
                      seconds <= decode_step_s and prefill_load < 1 and decode_load < 1)


@dataclass
class Deployment:
    """One way to run a model on a system's cards, and what it serves."""

    model: str
    system: str
    label: str
    prefill_ep: int
    decode_ep: int
    prefill_cards: int  # colocated: every card, both phases
    decode_cards: int
    cards: int
    bound: str  # the pool that limits ("prefill", "decode"), "colocated", or "none" (infeasible)
    requests_per_s: float
    output_tokens_per_s_per_card: float
    prompt_tokens_per_s_per_card: float
    decode_batch: int  # sequences per decode card
    ttft_ms: float  # prefill steps, the cache transfer, the first decode step; queueing left out
    tpot_ms: float  # mean time per output token
    gap_ms: float  # longest wait between two tokens: a decode step, plus a prefill step where they alternate
    vs_colocated: float | None = None


def split_deployment(sc: PdScenario, label: str, prefill: PrefillStep | None, decode: DecodeRow | None,
                     prefill_cards: int, decode_cards: int) -> Deployment:
    """Two pools: requests flow at the slower pool's rate; a decode pool fed less than it can take runs a
    proportionally smaller batch, and so a shorter step."""
    m, wl = sc.model, sc.workload
    cards = prefill_cards + decode_cards
    if prefill is None or decode is None or not prefill_cards or not decode_cards:
        return Deployment(m.name, sc.system.key, label, prefill.ep if prefill else 0, decode.ep if decode else 0,
                          prefill_cards, decode_cards, cards, "none", 0.0, 0.0, 0.0, 0, 0.0, 0.0, 0.0)
    supply = prefill_cards * prefill.tokens_per_s_per_gpu / wl.prompt_len
    demand = decode_cards * decode.tokens_per_s_per_gpu / wl.output_len
    rate = min(supply, demand)
    batch = decode.batch if demand <= supply else max(1, math.ceil(decode.batch * supply / demand))
    step = best_decode_step(HARDWARE[sc.system.decode], decode.ep, batch, wl.decode_context, sc.fmt,
                            load_cv=sc.load_cv, fp4_math=sc.fp4_math, model=m).step_s
    ttft = disaggregated_ttft_s(wl, prefill, kv_transfer(sc, prefill, decode).transfer_ms / 1e3, step)
    return Deployment(m.name, sc.system.key, label, prefill.ep, decode.ep, prefill_cards, decode_cards, cards,
                      "decode" if demand <= supply else "prefill", rate, rate * wl.output_len / cards,
                      rate * wl.prompt_len / cards, batch, ttft * 1e3, step * 1e3, step * 1e3)


def balanced_pools(sc: PdScenario, prefill: PrefillStep, decode: DecodeRow, total: int) -> tuple[int, int]:
    """(prefill cards, decode cards) within ``total``, in whole EP groups: the largest decode pool whose prefill
    pool, the fewest groups whose prompt tokens/s meet the decode pool's demand, still fits. (0, 0): none does."""
    ratio = prefill_cards_per_decode_card(sc.workload, prefill, decode)
    for decode_cards in range(total // decode.ep * decode.ep, 0, -decode.ep):
        need = decode_cards * ratio
        prefill_cards = math.ceil(need / prefill.ep) * prefill.ep
        if prefill_cards + decode_cards <= total:
            return prefill_cards, decode_cards
    return 0, 0


def colocated_deployment(sc: PdScenario, n: int, cards: int) -> Deployment:
    """Every card runs both phases at EP degree ``n``: each EP group alternates prefill steps and decode steps
    (with DP attention and DeepEP one phase runs per step: normal kernels for prefill, low-latency for decode),
    so a card's time splits between them in the workload's proportion, and a sequence's TPOT is the decode step
    over the share of time left to decode. The batch is the largest whose KV fits and whose TPOT meets the bound.
    """
    m, wl = sc.model, sc.workload
    hw = HARDWARE[sc.system.colocated]
    label = f"colocated {cards}"
    pf = prefill_step(hw, n, wl, sc.fmt, load_cv=sc.load_cv, fp4_math=sc.fp4_math, model=m)
    kv_max = kv_batch_limit(hw, m, n, wl.decode_context, sc.fmt)
    if not pf.feasible or not kv_max:
        return Deployment(m.name, sc.system.key, label, n, n, cards, cards, cards, "none", 0.0, 0.0, 0.0, 0, 0.0,
                          0.0, 0.0)
    prompt_s = wl.prompt_len / pf.tokens_per_s_per_gpu  # card-seconds of prefill per request

    def served(batch: int) -> tuple[float, float]:
        """(decode step, requests/s per card) at ``batch`` sequences per card."""
        step = best_decode_step(hw, n, batch, wl.decode_context, sc.fmt, load_cv=sc.load_cv,
                                fp4_math=sc.fp4_math, model=m).step_s
        return step, 1 / (prompt_s + wl.output_len * step / batch)

    def tpot(batch: int) -> float:
        step, rate = served(batch)
        return step / (1 - rate * prompt_s)

    batch = largest_batch(lambda b: tpot(b) <= wl.tpot_slo_s, kv_max)
    if not batch:
        return Deployment(m.name, sc.system.key, label, n, n, cards, cards, cards, "none", 0.0, 0.0, 0.0, 0, 0.0,
                          0.0, 0.0)
    step, rate = served(batch)
    ttft = prefill_time_s(wl, pf) + step  # then waits out the decode step in flight
    return Deployment(m.name, sc.system.key, label, n, n, cards, cards, cards, "colocated", rate * cards,
                      rate * wl.output_len, rate * wl.prompt_len, batch, ttft * 1e3, tpot(batch) * 1e3,
                      (step + pf.step_ms / 1e3) * 1e3)


def best_colocated(sc: PdScenario, cards: int) -> Deployment:
    """The colocated deployment at the degree (whole EP groups of ``cards``) that serves the most per card."""
    options = [colocated_deployment(sc, n, cards) for n in sc.model.degrees if n <= cards and cards % n == 0]
    return max(options, key=lambda d: d.output_tokens_per_s_per_card)


@dataclass
class PdChoice:
    """Each phase's EP degree chosen on its own, and the pipeline they make."""

    prefill_ep: int
    decode_ep: int
    prefill_tokens_per_s_per_card: float
    decode_tokens_per_s_per_card: float
    decode_batch: int
    prefill_cards_per_decode_card: float  # a balanced pipeline's pool ratio
    output_tokens_per_s_per_card: float  # of that pipeline, over both pools' cards
    ttft_ms: float
    tpot_ms: float


def pd_choice(sc: PdScenario, prefill: PrefillStep, decode: DecodeRow, transfer: KvTransfer) -> PdChoice:
    """The balanced pipeline of the chosen degrees, pools in the ratio that feeds decode exactly, and what each
    card of it serves."""
    wl = sc.workload
    ratio = prefill_cards_per_decode_card(wl, prefill, decode)
    per_decode_card = decode.tokens_per_s_per_gpu  # output tokens/s, over 1 + ratio cards
    ttft = disaggregated_ttft_s(wl, prefill, transfer.transfer_ms / 1e3, decode.step_ms / 1e3)
    return PdChoice(prefill.ep, decode.ep, prefill.tokens_per_s_per_gpu, decode.tokens_per_s_per_gpu, decode.batch,
                    ratio, per_decode_card / (1 + ratio), ttft * 1e3, decode.step_ms)


@dataclass
class PdResult:
    """One model on one system: the per-degree phases, the choice, the cache transfer and the deployments."""

    model: str
    system: PdSystem
    prefill: list[PrefillStep]
    decode: list[DecodeRow]
    choice: PdChoice | None
    kv_transfer: KvTransfer | None
    deployments: list[Deployment]


def best_balanced(sc: PdScenario, prefill: PrefillStep, decode_rows: list[DecodeRow], cards: int) -> Deployment:
    """At most ``cards`` split into balanced pools, prefill at its chosen degree, decode at the degree whose split
    serves the most requests (decode's own best may need more prefill cards than are left)."""
    label = f"balanced {cards}"
    options = [split_deployment(sc, label, prefill, d, *balanced_pools(sc, prefill, d, cards))
               for d in decode_rows if d.feasible]
    return max(options, key=lambda d: d.requests_per_s,
               default=split_deployment(sc, label, prefill, None, 0, 0))


def pd_result(sc: PdScenario, cards: int = 2 * SEED_POOL_CARDS) -> PdResult:
    """Choose each phase's degree, size the pools, and set the seed's 64 + 64 (at the seed's degrees and at the
    model's) and a balanced split of ``cards`` against the best colocated deployment on the same cards."""
    prefill_rows, decode_rows = prefill_table(sc), pd_decode_table(sc)
    prefill, decode = narrowest_near_best(prefill_rows), best_row(decode_rows)
    pool = tuple(n for n in sc.model.degrees if n <= SEED_POOL_CARDS)
    seed = f"{SEED_POOL_CARDS}+{SEED_POOL_CARDS}"
    colocated = best_colocated(sc, cards)
    seed_prefill = narrowest_near_best(prefill_rows, SEED_PREFILL_DEGREES)
    seed_decode = best_row(decode_rows, (SEED_DECODE_DEGREE,))
    deployments = [colocated,
                   split_deployment(sc, f"{seed}, seed's degrees", seed_prefill, seed_decode, SEED_POOL_CARDS,
                                    SEED_POOL_CARDS),
                   split_deployment(sc, f"{seed}, model's degrees", narrowest_near_best(prefill_rows, pool),
                                    best_row(decode_rows, pool), SEED_POOL_CARDS, SEED_POOL_CARDS)]
    choice = transfer = None
    if prefill is not None and decode is not None:
        transfer = kv_transfer(sc, prefill, decode)
        choice = pd_choice(sc, prefill, decode, transfer)
        deployments.append(best_balanced(sc, prefill, decode_rows, cards))
    for d in deployments:
        if colocated.output_tokens_per_s_per_card > 0:
            d.vs_colocated = d.output_tokens_per_s_per_card / colocated.output_tokens_per_s_per_card
    return PdResult(sc.model.name, sc.system, prefill_rows, decode_rows, choice, transfer, deployments)


# ---- plans and printing --------------------------------------------------------------------------------------

def plan(phase: str, tables: list[list], columns: list[str]) -> PhasePlan:
    """Degrees whose worst throughput ratio to each column's best is within PLAN_TOLERANCE of the best such ratio."""
    degrees_here = [r.ep for r in tables[0]]
    score: dict[int, float] = {}
    for i, n in enumerate(degrees_here):
        ratios = []
        for rows in tables:
            top = max(r.tokens_per_s_per_gpu for r in rows)
            ratios.append(rows[i].tokens_per_s_per_gpu / top if top else 0.0)
        score[n] = min(ratios)
    top_score = max(score.values())
    degrees = [n for n in degrees_here if top_score > 0 and score[n] >= (1 - PLAN_TOLERANCE) * top_score]
    knee = None
    for i in range(len(degrees_here) - 1):
        gains = [rows[i + 1].speedup_vs_prev for rows in tables]
        if all(g is not None for g in gains) and math.prod(gains) ** (1 / len(gains)) < 1 + PLAN_TOLERANCE:
            if all(rows[i].feasible for rows in tables):
                knee = degrees_here[i]
                break
    objective = ("min GPU-seconds per token (max tokens/s per GPU), weights fit" if phase == "prefill" else
                 f"max tokens/s per GPU at the largest batch whose KV fits HBM after the weights and whose step "
                 f"(attention + MoE + head) <= {DECODE_STEP_SLO_S * 1e3:.0f} ms")
    best = {col: next((r.ep for r in rows if r.best), 0) for col, rows in zip(columns, tables)}
    return PhasePlan(phase, objective, degrees, min(degrees) if degrees else 0, max(degrees) if degrees else 0,
                     knee, best)


def _fmt_rate(x: float) -> str:
    if x <= 0:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def _fmt_context(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens:,}"


def _gain(row) -> str:
    return f"{row.speedup_vs_prev:.2f}" if row.speedup_vs_prev is not None else "-"


def _mark(row) -> str:
    return "*" if row.best else ("x" if not row.feasible else " ")


BLOCK_HEAD = (f"{'mb':>2} {'read MB':>7} {'cmp ms':>6} {'mem ms':>6} {'comm ms':>7} {'layer us':>8} {'tok/s/GPU':>10} "
              f"{'tok/s sys':>9} {'x prev':>6}")


def _block(row: Row) -> str:
    return (f"{row.micro_batches:>2} {row.weight_read_mb:>7.0f} {row.compute_ms:>6.2f} {row.memory_ms:>6.2f} "
            f"{row.comm_ms:>7.2f} {row.layer_us:>8.1f} {_fmt_rate(row.tokens_per_s_per_gpu):>9}{_mark(row)} "
            f"{_fmt_rate(row.tokens_per_s_system):>9} {_gain(row):>6}")


def print_phase(tables: list[list[Row]]) -> None:
    """The prefill batch sizes' tables side by side, sharing the per-degree columns on the left."""
    left = f"{'EP':>4} {'exp/rk':>6} {'held GB':>7} {'imbal':>5}"
    heads = [f"T={rows[0].tokens_per_rank} tokens/rank".center(len(BLOCK_HEAD)) for rows in tables]
    print(f"{'':>{len(left)}} | " + " | ".join(heads))
    print(left + " | " + " | ".join(BLOCK_HEAD for _ in tables))
    for i, first in enumerate(tables[0]):
        n = first.ep
        imbalance = tables[-1][i].imbalance
        fit = "" if first.fits else "!"
        print(f"{n:>4} {first.experts_per_rank:>6.0f} {first.weights_held_gb:>6.1f}{fit or ' '} {imbalance:>5.2f} | "
              + " | ".join(_block(rows[i]) for rows in tables))


DECODE_HEAD = (f"{'B/GPU':>6} {'bind':>4} {'mb':>2} {'attn ms':>7} {'moe ms':>6} {'comm ms':>7} {'step ms':>7} "
               f"{'tok/s/GPU':>10} {'tok/s sys':>9} {'x prev':>6}")


def _decode_block(row: DecodeRow) -> str:
    if not row.feasible:
        return f"{'-':>6} {row.bound:>4} " + " " * (len(DECODE_HEAD) - 13) + "x"
    return (f"{row.batch:>6} {row.bound:>4} {row.micro_batches:>2} {row.attention_ms:>7.2f} {row.moe_ms:>6.2f} "
            f"{row.comm_ms:>7.2f} {row.step_ms:>7.2f} {_fmt_rate(row.tokens_per_s_per_gpu):>9}{_mark(row)} "
            f"{_fmt_rate(row.tokens_per_s_system):>9} {_gain(row):>6}")


def print_decode(tables: list[list[DecodeRow]]) -> None:
    """The decode contexts' tables side by side, sharing the per-degree columns on the left."""
    left = f"{'EP':>4} {'exp/rk':>6} {'held GB':>7} {'KV GB':>6}"
    heads = [f"context {_fmt_context(rows[0].context)}: {rows[0].kv_mb_per_sequence:.1f} MB KV/seq"
             .center(len(DECODE_HEAD)) for rows in tables]
    print(f"{'':>{len(left)}} | " + " | ".join(heads))
    print(left + " | " + " | ".join(DECODE_HEAD for _ in tables))
    for i, first in enumerate(tables[0]):
        n = first.ep
        print(f"{n:>4} {first.experts_per_rank:>6.0f} {first.weights_held_gb:>7.1f} {first.kv_budget_gb:>6.1f} | "
              + " | ".join(_decode_block(rows[i]) for rows in tables))


def _span(p: PhasePlan) -> str:
    return f"EP {p.low}" if p.low == p.high else f"EP {p.low}–{p.high}"


def plan_line(label: str, prefill: PhasePlan, decode: PhasePlan, decode_tables: list[list[DecodeRow]]) -> str:
    knee = f"past EP {decode.knee}" if decode.knee else "nowhere"
    best = []
    for rows in decode_tables:
        top = next((r for r in rows if r.best), None)
        if top is not None:
            best.append(f"{_fmt_context(top.context)} EP {top.ep} at B={top.batch}/GPU ({top.bound}-bound)")
    return (f"plan ({label}): prefill {_span(prefill)}, decode {_span(decode)} "
            f"(gains < {PLAN_TOLERANCE:.0%} per doubling {knee}; best: {', '.join(best) or 'none'})")


def _short(name: str) -> str:
    return name.removeprefix("DeepSeek-")


def _system_line(system: PdSystem) -> str:
    if system.prefill == system.decode == system.colocated:
        return system.key
    return f"{system.key}: prefill on {system.prefill}, decode on {system.decode}, colocated on {system.colocated}"


def print_pd_degrees(results: list[PdResult]) -> None:
    """Each phase's tokens/s per card at every degree, model by model and system by system, side by side."""
    left = f"{'model':<11} {'system':<12} {'phase':<7}"
    print(left + " | " + " ".join(f"{n:>7}" for n in DEGREES))
    for res in results:
        chosen = {"prefill": res.choice.prefill_ep if res.choice else 0,
                  "decode": res.choice.decode_ep if res.choice else 0}
        for phase, rows in (("prefill", res.prefill), ("decode", res.decode)):
            by_degree = {r.ep: r for r in rows}
            cells = []
            for n in DEGREES:
                r = by_degree.get(n)
                if r is None:
                    cells.append(f"{'':>7}")
                elif not r.feasible:
                    cells.append(f"{'x':>7}")
                else:
                    mark = "*" if n == chosen[phase] else " "
                    cells.append(f"{_fmt_rate(r.tokens_per_s_per_gpu):>6}{mark}")
            name, system = (_short(res.model), res.system.key) if phase == "prefill" else ("", "")
            print(f"{name:<11} {system:<12} {phase:<7} | " + " ".join(cells))


PD_CHOICE_HEAD = (f"{'P EP':>4} {'P tok/s':>7} {'P ms':>6} | {'D EP':>4} {'B/card':>6} {'D ms':>5} {'D tok/s':>7} | "
                  f"{'P:D':>4} {'out/card':>8} {'TTFT ms':>7} | {'KV MB':>5} {'B/tok':>5} {'xfer ms':>7} "
                  f"{'/step':>5} {'/TTFT':>5} {'link P':>6} {'link D':>6}")


def print_pd_choices(results: list[PdResult]) -> None:
    """Each phase's degree, the balanced pipeline they make, and the cache each request moves."""
    print(f"{'model':<11} {'system':<12} | {PD_CHOICE_HEAD}")
    for res in results:
        c, t = res.choice, res.kv_transfer
        if c is None or t is None:
            print(f"{_short(res.model):<11} {res.system.key:<12} | no feasible degree for a phase")
            continue
        prefill = next(r for r in res.prefill if r.ep == c.prefill_ep)
        print(f"{_short(res.model):<11} {res.system.key:<12} | {c.prefill_ep:>4} "
              f"{_fmt_rate(c.prefill_tokens_per_s_per_card):>7} {prefill.step_ms:>6.1f} | {c.decode_ep:>4} "
              f"{c.decode_batch:>6} {c.tpot_ms:>5.1f} {_fmt_rate(c.decode_tokens_per_s_per_card):>7} | "
              f"{c.prefill_cards_per_decode_card:>4.2f} {_fmt_rate(c.output_tokens_per_s_per_card):>8} "
              f"{c.ttft_ms:>7.0f} | {t.total_bytes / 1e6:>5.1f} {t.per_token_bytes:>5.0f} {t.transfer_ms:>7.2f} "
              f"{t.transfer_ms / t.decode_step_ms:>5.3f} {t.ttft_share:>5.1%} {t.prefill_link_load:>6.2%} "
              f"{t.decode_link_load:>6.2%}")


DEPLOYMENT_HEAD = (f"{'deployment':<22} {'P EP':>4} {'D EP':>4} {'P+D cards':>9} {'bound':>9} {'req/s':>6} "
                   f"{'out/card':>8} {'B/card':>6} {'TTFT ms':>7} {'TPOT ms':>7} {'gap ms':>6} {'x coloc':>7}")


def print_pd_deployments(results: list[PdResult]) -> None:
    """The deployments of each model on each system's cards, against the colocated one."""
    print(f"{'model':<11} {'system':<12} | {DEPLOYMENT_HEAD}")
    for res in results:
        for i, d in enumerate(res.deployments):
            colocated = d.prefill_cards == d.decode_cards == d.cards
            cards = f"{d.cards} both" if colocated else f"{d.prefill_cards}+{d.decode_cards}"
            name, system = (_short(res.model), res.system.key) if i == 0 else ("", "")
            ratio = f"{d.vs_colocated:>6.2f}x" if d.vs_colocated is not None else f"{'-':>7}"
            if d.bound == "none":
                print(f"{name:<11} {system:<12} | {d.label:<22} {d.prefill_ep:>4} {d.decode_ep:>4} {cards:>9} "
                      f"{'none':>9}")
                continue
            print(f"{name:<11} {system:<12} | {d.label:<22} {d.prefill_ep:>4} {d.decode_ep:>4} {cards:>9} "
                  f"{d.bound:>9} {d.requests_per_s:>6.0f} {_fmt_rate(d.output_tokens_per_s_per_card):>8} "
                  f"{d.decode_batch:>6} {d.ttft_ms:>7.0f} {d.tpot_ms:>7.1f} {d.gap_ms:>6.1f} {ratio}")


def pd_summary_line(res: PdResult) -> str:
    """One model on one system in a line: the degrees, the pool ratio, 64 + 64 and a balanced split against
    colocated, the cache moved."""
    c, t = res.choice, res.kv_transfer
    colocated, seed, own, *balanced = res.deployments
    head = f"disaggregated ({_short(res.model)}, {res.system.key}): "
    if c is None or t is None:
        return head + "no feasible degree for a phase"

    def ratio(d: Deployment) -> str:
        return f"{d.vs_colocated:.2f}x" if d.vs_colocated else "-"

    split = (f", {balanced[0].label} as {balanced[0].prefill_cards}+{balanced[0].decode_cards} "
             f"{ratio(balanced[0])}" if balanced else "")
    return (f"{head}prefill EP {c.prefill_ep}, decode EP {c.decode_ep}, {c.prefill_cards_per_decode_card:.1f} "
            f"prefill cards per decode card; {seed.label} {ratio(seed)} colocated (EP {colocated.prefill_ep}), "
            f"{own.label} {ratio(own)}{split}; KV {t.total_bytes / 1e6:.1f} MB/request in {t.transfer_ms:.2f} ms")


def run_disaggregated(keys: list[str], *, load_cv: float, fp4_math: bool, workload: Workload, fmt: KvFormat,
                      link_bw: float | None = None) -> tuple[dict, list[str]]:
    """Print the disaggregated tables for every model on every system of ``keys``; return the figures for
    ``--json`` and the summary lines."""
    systems = pd_systems(keys)
    links = {}
    for system in systems:
        link = KV_LINKS[system.decode]
        links[system.key] = link if link_bw is None else KvLink(link_bw, f"{link_bw / GBIT:.0f} Gb/s per card, as "
                                                                           "given (--kv-link-gbps)", False)
    results = [pd_result(PdScenario(model, system, workload, fmt, links[system.key], load_cv, fp4_math))
               for system in systems for model in MODELS.values()]
    wl = workload
    print(f"\n== disaggregated prefill and decode: {', '.join(_short(m.name) for m in MODELS.values())}; prompt "
          f"{wl.prompt_len:,} + output {wl.output_len:,} tokens per request; KV cache {fmt.description}")
    print(f"prefill: the whole step (MoE, attention, head) at {wl.prefill_tokens_per_rank} prompt tokens per rank; "
          f"its degree the narrowest within {PLAN_TOLERANCE:.0%} of the best\n  tokens/s per card (prefill's "
          f"hardly moves with EP); decode: at the mean context {wl.decode_context:,}, TPOT <= "
          f"{wl.tpot_slo_s * 1e3:.0f} ms, the best degree; * chosen, x infeasible")
    for system in systems:
        link = links[system.key]
        print(f"  {_system_line(system)}; KV link {link.bw / GBIT:.0f} Gb/s per card, {link.name}"
              + (" -- ASSUMPTION" if link.assumed else ""))
    print("-- tokens/s per card by EP degree")
    print_pd_degrees(results)
    print("-- each phase's degree on its own; P:D prefill cards per decode card in a balanced pipeline; out/card: "
          "output tokens/s per card\n  over both pools; KV: per request (B/tok: per prompt token); xfer: over the "
          f"link at {LINK_EFFICIENCY:.0%}, /step of a decode step, /TTFT its share;\n  link P / D: the sustained "
          "cache traffic of a prefill / decode card over its link")
    print_pd_choices(results)
    print(f"-- {2 * SEED_POOL_CARDS} cards: the seed's {SEED_POOL_CARDS}+{SEED_POOL_CARDS} (seed's degrees: "
          f"prefill EP {'/'.join(map(str, SEED_PREFILL_DEGREES))}, decode EP {SEED_DECODE_DEGREE}) against colocated "
          "(both phases on every card at one EP degree,\n  the best; prefill and decode steps alternate, so TPOT is "
          "the decode step over decode's share of time, gap a decode step plus a prefill step)")
    print_pd_deployments(results)
    lines = [pd_summary_line(res) for res in results]
    figures = {"workload": {**asdict(wl), "decode_context": wl.decode_context, "prefill_steps": wl.prefill_steps},
               "kv_format": asdict(fmt),
               "prefill_degree": f"the narrowest within {PLAN_TOLERANCE:.0%} of the best tokens/s per card",
               "decode_degree": "the best tokens/s per card under the TPOT bound",
               "colocated_degree": "the best output tokens/s per card",
               "links": {k: asdict(v) for k, v in links.items()},
               "systems": {}}
    for res in results:
        entry = figures["systems"].setdefault(res.system.key, {**asdict(res.system), "models": {}})
        entry["models"][res.model] = {
            "prefill": [asdict(r) for r in res.prefill], "decode": [asdict(r) for r in res.decode],
            "choice": asdict(res.choice) if res.choice else None,
            "kv_transfer": asdict(res.kv_transfer) if res.kv_transfer else None,
            "deployments": [asdict(d) for d in res.deployments],
            "seed_vs_colocated": res.deployments[1].vs_colocated,
            "summary": pd_summary_line(res)}
    return figures, lines


def run(keys: list[str], *, load_cv: float, fp4_math: bool, contexts: tuple[int, ...], fmt: KvFormat,
        workload: Workload = SEED_WORKLOAD, pd_fmt: KvFormat = KV_FORMATS["bf16"],
        link_bw: float | None = None) -> dict:
    """Print every hardware's tables and plan, then the disaggregated deployment's; return the figures for
    ``--json``."""
    out: dict = {
        "model": {"name": "DeepSeek-V4-Flash", "hidden": HIDDEN, "moe_intermediate": MOE_INTERMEDIATE,
                  "routed_experts": ROUTED_EXPERTS, "top_k": TOP_K, "shared_experts": SHARED_EXPERTS, "layers": LAYERS,
                  "expert_bytes": EXPERT_BYTES, "shared_expert_bytes": SHARED_EXPERT_BYTES,
                  "routed_bytes_all_layers": ROUTED_BYTES, "replicated_bytes": REPLICATED_BYTES,
                  "layer_kinds": {f"ratio{r}{'_hash' if h else ''}": c for (r, h), c in LAYER_KINDS.items()},
                  "kv_format": asdict(fmt),
                  "kv_bytes_per_sequence": {str(c): kv_bytes_per_sequence(c, fmt) for c in contexts}},
        "assumptions": {"gemm_efficiency": GEMM_EFFICIENCY, "hbm_efficiency": HBM_EFFICIENCY,
                        "link_efficiency": LINK_EFFICIENCY, "gemm_row_tile": GEMM_ROW_TILE, "expert_load_cv": load_cv,
                        "overlap_residual": OVERLAP_RESIDUAL, "hbm_weight_fraction": HBM_WEIGHT_FRACTION,
                        "bf16_per_fp8": BF16_PER_FP8, "attention_efficiency": ATTENTION_EFFICIENCY,
                        "decode_hbm_reserve": DECODE_HBM_RESERVE, "decode_contexts": list(contexts),
                        "decode_step_slo_s": DECODE_STEP_SLO_S, "plan_tolerance": PLAN_TOLERANCE,
                        "scale_up_collective_latency_s": SCALE_UP_COLLECTIVE_LATENCY_S,
                        "scale_out_collective_latency_s": SCALE_OUT_COLLECTIVE_LATENCY_S,
                        "per_peer_latency_s": PER_PEER_LATENCY_S, "math": "fp4" if fp4_math else "fp8"},
        "hardware": {},
    }
    print(f"DeepSeek-V4-Flash under EP: routed experts {ROUTED_BYTES / GB:.1f} GB (FP4), replicated "
          f"{REPLICATED_BYTES / GB:.2f} GB, {EXPERT_BYTES / 1e6:.1f} MB per expert, shared expert "
          f"{SHARED_EXPERT_BYTES / 1e6:.1f} MB (FP8) per layer\n  KV cache: {fmt.description}")
    print(f"prefill, the MoE layer only: ms columns summed over the {LAYERS} layers of one step; layer us: one "
          "layer after overlap;\n  mb: micro-batches (2 = overlapped); read MB: weights read per layer; imbal: "
          "busiest rank's routed rows over the mean\n  (largest batch); * best, x infeasible, ! weights over "
          f"{HBM_WEIGHT_FRACTION:.0%} of HBM")
    print(f"decode, the whole step: B/GPU sequences per rank, bound by kv (KV GB: HBM left after the weights and a "
          f"{DECODE_HBM_RESERVE:.0%} reserve)\n  or slo (a {DECODE_STEP_SLO_S * 1e3:.0f} ms step); attn / moe / comm "
          "ms: kernel time summed over layers and micro-batches, before\n  overlap; step ms: after overlap, with "
          "the head")
    lines = []
    found: dict[str, tuple[dict[str, PhasePlan], list[list[DecodeRow]]]] = {}
    for key in keys:
        hw = HARDWARE[key]
        print(f"\n== {hw.name}: {hw.hbm_bytes / GB:.0f} GB at {hw.hbm_bw / TB:.1f} TB/s, "
              f"{(hw.fp4_flops if fp4_math else hw.fp8_flops) / PFLOPS:.1f} PF {'FP4' if fp4_math else 'FP8'} "
              f"dense, {hw.interconnect}")
        prefill_tables = [table(hw, t, load_cv=load_cv, fp4_math=fp4_math) for t in PREFILL_TOKENS_PER_RANK]
        decode_tables = [decode_table(hw, c, fmt, load_cv=load_cv, fp4_math=fp4_math) for c in contexts]
        plans = {"prefill": plan("prefill", prefill_tables, [str(t) for t in PREFILL_TOKENS_PER_RANK]),
                 "decode": plan("decode", decode_tables, [str(c) for c in contexts])}
        print(f"-- prefill ({plans['prefill'].objective})")
        print_phase(prefill_tables)
        print(f"-- decode ({plans['decode'].objective})")
        print_decode(decode_tables)
        found[key] = (plans, decode_tables)
        line = plan_line(hw.key, plans["prefill"], plans["decode"], decode_tables)
        lines.append(line)
        print(line)
        rows = [asdict(r) for rows in prefill_tables + decode_tables for r in rows]
        out["hardware"][key] = {"spec": asdict(hw), "rows": rows, "plan": {k: asdict(v) for k, v in plans.items()},
                                "plan_line": line}
    if "ascend950pr" in found and "ascend950dt" in found:  # Huawei's pairing
        pr, dt = found["ascend950pr"][0], found["ascend950dt"]
        combined = plan_line("ascend950: prefill on 950PR, decode on 950DT", pr["prefill"], dt[0]["decode"], dt[1])
        lines.append(combined)
        out["plan_ascend950"] = {"prefill_on": "ascend950pr", "decode_on": "ascend950dt",
                                 "prefill": asdict(pr["prefill"]), "decode": asdict(dt[0]["decode"]),
                                 "plan_line": combined}
    out["disaggregated"], pd_lines = run_disaggregated(keys, load_cv=load_cv, fp4_math=fp4_math, workload=workload,
                                                       fmt=pd_fmt, link_bw=link_bw)
    print()
    for line in lines + pd_lines:
        print(line)
    return out


def parse_contexts(text: str) -> tuple[int, ...]:
    contexts = tuple(int(part) for part in text.split(",") if part.strip())
    if not contexts or any(not 1 <= c <= MAX_CONTEXT for c in contexts):
        raise ValueError(f"contexts must be 1..{MAX_CONTEXT} tokens")
    return contexts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="b200,gb200-nvl72,ascend950",
                    help=f"comma-separated among {', '.join([*HARDWARE, *ALIASES])}")
    ap.add_argument("--expert-load-cv", type=float, default=EXPERT_LOAD_CV,
                    help="per-expert load coefficient of variation within a step (imbalance model)")
    ap.add_argument("--fp4-math", action="store_true", help="run the routed-expert GEMMs at the FP4 peak, not FP8")
    ap.add_argument("--context", default=",".join(map(str, DECODE_CONTEXTS)),
                    help="comma-separated decode context lengths in tokens, one table block each")
    ap.add_argument("--kv-format", choices=sorted(KV_FORMATS), default="fp8",
                    help="fp8: DeepSeek's serving layout; bf16: this engine's cache today")
    ap.add_argument("--prompt-len", type=int, default=SEED_WORKLOAD.prompt_len,
                    help="disaggregated: prompt tokens per request")
    ap.add_argument("--output-len", type=int, default=SEED_WORKLOAD.output_len,
                    help="disaggregated: output tokens per request")
    ap.add_argument("--pd-kv-format", choices=sorted(KV_FORMATS), default="bf16",
                    help="disaggregated: the cache decode holds and prefill sends (bf16: this engine's today)")
    ap.add_argument("--kv-link-gbps", type=float, default=None,
                    help="disaggregated: one link rate per card for every system, Gb/s (default: each system's own)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = ap.parse_args()
    keys: list[str] = []
    for key in args.hardware.split(","):
        key = key.strip()
        if key not in HARDWARE and key not in ALIASES:
            ap.error(f"unknown hardware {key!r}; choose among {', '.join([*HARDWARE, *ALIASES])}")
        keys += ALIASES.get(key, (key,))
    try:
        contexts = parse_contexts(args.context)
    except ValueError as exc:
        ap.error(str(exc))
    if not 1 <= args.prompt_len <= MAX_CONTEXT or args.output_len < 1 or (args.kv_link_gbps or 1) <= 0:
        ap.error(f"--prompt-len must be 1..{MAX_CONTEXT}, --output-len and --kv-link-gbps positive")
    out = run(keys, load_cv=args.expert_load_cv, fp4_math=args.fp4_math, contexts=contexts,
              fmt=KV_FORMATS[args.kv_format], workload=Workload(args.prompt_len, args.output_len),
              pd_fmt=KV_FORMATS[args.pd_kv_format],
              link_bw=args.kv_link_gbps * GBIT if args.kv_link_gbps else None)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()

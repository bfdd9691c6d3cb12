"""Analytic cost model of one DeepSeek-V4-Flash MoE layer under expert parallelism (EP), per EP degree.

What it models: one rank of a deployment whose attention is data-parallel (every rank attends over its own
sequences) and whose routed experts are sharded over N ranks (256/N each), the shared expert replicated.
Only the MoE layer is modelled -- dispatch, the routed and shared expert GEMMs, combine. Attention, KV-cache
reads, the router, sampling and the draft model are left out, so step times are the MoE share of a step and
nothing else can hide communication.

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

Objectives. Prefill: minimise GPU-seconds per token, i.e. maximise tokens/s per GPU, among the degrees whose
weights fit. Decode: maximise tokens/s per GPU at each per-rank batch, among the degrees whose weights (all
43 layers' local experts plus every replicated tensor) fit in HBM_WEIGHT_FRACTION of HBM, the rest being
left for KV cache, and whose 43 MoE layers take at most DECODE_STEP_SLO_S. A phase's plan is every degree
whose worst throughput ratio to the best degree, over that phase's batch sizes, is within PLAN_TOLERANCE of
the best such ratio; the knee is the first degree whose doubling gains less than PLAN_TOLERANCE.

Hardware: NVIDIA B200 in an 8-GPU HGX node (NVLink domain 8, ConnectX-7 400G; ``b200-cx8`` with 800G) and
in GB200 NVL72 (NVLink domain 72); Huawei Ascend 950PR and 950DT (PR is pitched at prefill, DT at decode;
``ascend950`` runs both) in an Atlas 950 SuperPoD UnifiedBus domain. Each figure is a named constant below
with its source.

    .venv/bin/python benchmarks/ep_plan.py [--hardware b200,gb200-nvl72,ascend950] [--expert-load-cv 0.2]
                                           [--fp4-math] [--json]

Tables: one block per per-rank batch, side by side; ``--json`` adds one JSON object (every row, the
assumptions and the plan per hardware) as the last line of stdout. Pure Python, well under a second.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

# ---- DeepSeek-V4-Flash, from its config.json ---------------------------------------------------------------

HIDDEN = 4096  # hidden_size
MOE_INTERMEDIATE = 2048  # moe_intermediate_size
ROUTED_EXPERTS = 256  # n_routed_experts
TOP_K = 6  # num_experts_per_tok
SHARED_EXPERTS = 1  # n_shared_experts
LAYERS = 43  # num_hidden_layers
VOCAB = 129280  # vocab_size
HEADS = 64  # num_attention_heads
HEAD_DIM = 512  # head_dim
Q_LORA_RANK = 1024  # q_lora_rank
O_LORA_RANK = 1024  # o_lora_rank
O_GROUPS = 8  # o_groups
INDEX_HEADS = 64  # index_n_heads
INDEX_HEAD_DIM = 128  # index_head_dim
HC_MULT = 4  # hc_mult (hyper-connection streams)
HASH_LAYERS = 3  # num_hash_layers (router is a token-id hash table there)
COMPRESS_RATIOS = [0, 0] + [4 if i % 2 else 128 for i in range(1, 42)] + [0]  # compress_ratios
FP8_BLOCK = 128  # quantization_config.weight_block_size, scales UE8M0 (1 byte)
FP4_GROUP = 32  # e2m1 weights, one UE8M0 scale per 32

FP4_BYTES_PER_PARAM = 0.5 + 1 / FP4_GROUP  # 0.53125
EXPERT_PARAMS = 3 * HIDDEN * MOE_INTERMEDIATE  # w1, w3 (I x D) and w2 (D x I)
EXPERT_BYTES = EXPERT_PARAMS * FP4_BYTES_PER_PARAM  # 13.4 MB per routed expert
SHARED_EXPERT_BYTES = SHARED_EXPERTS * 3 * (HIDDEN * MOE_INTERMEDIATE
                                           + (HIDDEN // FP8_BLOCK) * (MOE_INTERMEDIATE // FP8_BLOCK))
FLOPS_PER_PAIR = 2 * EXPERT_PARAMS  # one token through one expert's three projections
#: bytes on the wire per (token, expert) routing: FP8 dispatch with one UE8M0 scale per 128, bf16 combine
DISPATCH_BYTES_PER_PAIR = HIDDEN * (1 + 1 / FP8_BLOCK)
COMBINE_BYTES_PER_PAIR = HIDDEN * 2
#: HBM traffic per GEMM row besides weights: FP8 input, FP8 SwiGLU intermediate written and read, bf16 output
ACTIVATION_BYTES_PER_ROW = HIDDEN * (1 + 1 / FP8_BLOCK) + 2 * MOE_INTERMEDIATE + 2 * HIDDEN

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
OVERLAP_RESIDUAL = 0.1  # share of the shorter of work/comm that two micro-batches leave exposed
HBM_WEIGHT_FRACTION = 0.7  # weights may take this much of HBM; the rest is KV cache and activations
DECODE_STEP_SLO_S = 0.050  # 43 MoE layers per decode step (20 tokens/s per sequence)
PLAN_TOLERANCE = 0.10  # a degree is in the plan within 10 % of the best objective
# For scale: DeepSeek's own V3/R1 service (github.com/deepseek-ai/open-infra-index, 202502OpenSourceWeek,
# day_6_one_more_thing_deepseekV3R1_inference_system_overview.md) runs prefill at routed-expert EP32 over
# 4 nodes and decode at EP144 over 18 nodes of 8 x H800, with 32 redundant experts; V3's FP8 experts are 3.3x
# V4-Flash's FP4 ones and H800 HBM is 80 GB at 3.35 TB/s, so weights weigh far more there.

DEGREES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS_PER_RANK = (8192, 16384)
DECODE_TOKENS_PER_RANK = (32, 64, 128)


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
    """One MoE layer on the busiest rank, for one EP degree and per-rank batch."""

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
class PhasePlan:
    phase: str
    objective: str
    degrees: list[int]
    low: int
    high: int
    knee: int | None  # first degree past which doubling gains < 10 % (geometric mean over batches)


def replicated_weight_bytes() -> float:
    """Bytes every rank holds whatever N: embeddings, head, attention, compressors, routers, shared experts."""

    def fp8(rows: int, cols: int) -> int:
        return rows * cols + math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK)

    bf16, f32 = 2, 4
    mix = (2 + HC_MULT) * HC_MULT
    total = 2 * VOCAB * HIDDEN * bf16 + HIDDEN * bf16 + (HC_MULT * HC_MULT * HIDDEN + HC_MULT + 1) * f32
    for layer in range(LAYERS):
        total += 2 * HIDDEN * bf16 + 2 * (mix * HC_MULT * HIDDEN + mix + 3) * f32  # norms, hyper-connections
        total += fp8(Q_LORA_RANK, HIDDEN) + Q_LORA_RANK * bf16 + fp8(HEADS * HEAD_DIM, Q_LORA_RANK)
        total += fp8(HEAD_DIM, HIDDEN) + HEAD_DIM * bf16 + HEADS * f32
        total += fp8(O_GROUPS * O_LORA_RANK, HEADS * HEAD_DIM // O_GROUPS) + fp8(HIDDEN, O_GROUPS * O_LORA_RANK)
        ratio = COMPRESS_RATIOS[layer]
        if ratio:
            width = 2 * HEAD_DIM if ratio == 4 else HEAD_DIM
            total += 2 * width * HIDDEN * bf16 + ratio * width * f32 + HEAD_DIM * bf16
            if ratio == 4:  # the lightning indexer
                total += fp8(INDEX_HEADS * INDEX_HEAD_DIM, Q_LORA_RANK) + INDEX_HEADS * HIDDEN * bf16
                iwidth = 2 * INDEX_HEAD_DIM
                total += 2 * iwidth * HIDDEN * bf16 + ratio * iwidth * f32 + INDEX_HEAD_DIM * bf16
        total += ROUTED_EXPERTS * HIDDEN * bf16
        total += ROUTED_EXPERTS * f32 if layer >= HASH_LAYERS else VOCAB * TOP_K * 8
        total += SHARED_EXPERT_BYTES
    return float(total)


REPLICATED_BYTES = replicated_weight_bytes()
ROUTED_BYTES = LAYERS * ROUTED_EXPERTS * EXPERT_BYTES


def load_imbalance(n: int, rows_per_expert: float, load_cv: float) -> float:
    """Expected busiest-rank routed rows over the mean, for 256/N experts per rank."""
    if n == 1:
        return 1.0
    local = ROUTED_EXPERTS / n
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
    own dispatch and combine."""

    tokens: float
    experts_hit: float
    rows_per_expert: float
    imbalance: float
    weight_bytes: float
    compute_s: float
    memory_s: float
    comm_s: float


def micro_batch(hw: Hardware, n: int, tokens: float, *, load_cv: float, fp4_math: bool) -> MicroBatch:
    pairs = tokens * TOP_K
    local = ROUTED_EXPERTS / n
    rows_per_expert = n * pairs / ROUTED_EXPERTS
    hit = local * (1 - (1 - 1 / ROUTED_EXPERTS) ** (n * pairs))
    imbalance = load_imbalance(n, rows_per_expert, load_cv)
    routed_rows = pairs * imbalance

    weight_bytes = hit * EXPERT_BYTES + SHARED_EXPERT_BYTES
    gemm_rows = padded_rows(routed_rows, hit, load_cv) + padded_rows(tokens, SHARED_EXPERTS, 0.0)
    peak = hw.fp4_flops if fp4_math else hw.fp8_flops
    compute = gemm_rows * FLOPS_PER_PAIR / (peak * GEMM_EFFICIENCY)
    memory = (weight_bytes + (routed_rows + tokens) * ACTIVATION_BYTES_PER_ROW) / (hw.hbm_bw * HBM_EFFICIENCY)
    comm = 0.0
    if n > 1:
        in_domain = min(n, hw.scale_up_domain)
        off_rank = routed_rows * (n - 1) / n  # the busiest rank receives the most
        per_pair = DISPATCH_BYTES_PER_PAIR + COMBINE_BYTES_PER_PAIR
        up_bytes = off_rank * (in_domain - 1) / (n - 1) * per_pair
        out_bytes = off_rank * (n - in_domain) / (n - 1) * per_pair
        comm = max(up_bytes / (hw.scale_up_bw * LINK_EFFICIENCY), out_bytes / (hw.scale_out_bw * LINK_EFFICIENCY))
        fixed = SCALE_OUT_COLLECTIVE_LATENCY_S if n > in_domain else SCALE_UP_COLLECTIVE_LATENCY_S
        comm += 2 * (fixed + PER_PEER_LATENCY_S * (n - 1))  # dispatch and combine
    return MicroBatch(tokens, hit, rows_per_expert, imbalance, weight_bytes, compute, memory, comm)


def layer_time(parts: list[MicroBatch]) -> float:
    """One micro-batch runs its work and communication back to back; two overlap one's communication with the
    other's work, leaving OVERLAP_RESIDUAL of the shorter side exposed."""
    work = sum(max(p.compute_s, p.memory_s) for p in parts)
    comm = sum(p.comm_s for p in parts)
    if len(parts) == 1:
        return work + comm
    return max(work, comm) + OVERLAP_RESIDUAL * min(work, comm)


def moe_layer(hw: Hardware, phase: str, n: int, tokens: int, *, load_cv: float, fp4_math: bool) -> Row:
    """The cheaper of one batch and MICRO_BATCHES overlapped micro-batches (the engine picks its schedule)."""
    schedules = [[micro_batch(hw, n, tokens, load_cv=load_cv, fp4_math=fp4_math)]]
    if n > 1:
        part = micro_batch(hw, n, tokens / MICRO_BATCHES, load_cv=load_cv, fp4_math=fp4_math)
        schedules.append([part] * MICRO_BATCHES)
    parts = min(schedules, key=layer_time)
    layer = layer_time(parts)
    first = parts[0]
    step = LAYERS * layer
    held = ROUTED_BYTES / n + REPLICATED_BYTES
    fits = held <= HBM_WEIGHT_FRACTION * hw.hbm_bytes
    meets_slo = phase == "prefill" or step <= DECODE_STEP_SLO_S
    feasible = fits and meets_slo
    per_gpu = tokens / step if feasible else 0.0
    total = len(parts)
    return Row(hw.key, phase, tokens, n, total, ROUTED_EXPERTS / n, first.experts_hit, first.rows_per_expert,
               first.imbalance, total * first.weight_bytes / 1e6, held / GB, fits,
               LAYERS * total * first.compute_s * 1e3, LAYERS * total * first.memory_s * 1e3,
               LAYERS * total * first.comm_s * 1e3, layer * 1e6, step * 1e3, meets_slo, feasible, per_gpu,
               per_gpu * n, None)


def table(hw: Hardware, phase: str, tokens: int, *, load_cv: float, fp4_math: bool) -> list[Row]:
    rows = [moe_layer(hw, phase, n, tokens, load_cv=load_cv, fp4_math=fp4_math) for n in DEGREES]
    for prev, row in zip(rows, rows[1:]):
        if prev.feasible and row.feasible:
            row.speedup_vs_prev = row.tokens_per_s_per_gpu / prev.tokens_per_s_per_gpu
    best = max(rows, key=lambda r: r.tokens_per_s_per_gpu)
    if best.feasible:
        best.best = True
    return rows


def plan(phase: str, tables: list[list[Row]]) -> PhasePlan:
    """Degrees whose worst throughput ratio to each batch's best is within PLAN_TOLERANCE of the best such ratio."""
    score: dict[int, float] = {}
    for i, n in enumerate(DEGREES):
        ratios = []
        for rows in tables:
            top = max(r.tokens_per_s_per_gpu for r in rows)
            ratios.append(rows[i].tokens_per_s_per_gpu / top if top else 0.0)
        score[n] = min(ratios)
    top_score = max(score.values())
    degrees = [n for n in DEGREES if top_score > 0 and score[n] >= (1 - PLAN_TOLERANCE) * top_score]
    knee = None
    for i in range(len(DEGREES) - 1):
        gains = [rows[i + 1].speedup_vs_prev for rows in tables]
        if all(g is not None for g in gains) and math.prod(gains) ** (1 / len(gains)) < 1 + PLAN_TOLERANCE:
            if all(rows[i].feasible for rows in tables):
                knee = DEGREES[i]
                break
    objective = ("min GPU-seconds per token (max tokens/s per GPU), weights fit" if phase == "prefill" else
                 f"max tokens/s per GPU, weights <= {HBM_WEIGHT_FRACTION:.0%} HBM, "
                 f"{LAYERS} MoE layers <= {DECODE_STEP_SLO_S * 1e3:.0f} ms")
    return PhasePlan(phase, objective, degrees, min(degrees) if degrees else 0, max(degrees) if degrees else 0, knee)


def _fmt_rate(x: float) -> str:
    if x <= 0:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


BLOCK_HEAD = (f"{'mb':>2} {'read MB':>7} {'cmp ms':>6} {'mem ms':>6} {'comm ms':>7} {'layer us':>8} {'tok/s/GPU':>10} "
              f"{'tok/s sys':>9} {'x prev':>6}")


def _block(row: Row) -> str:
    mark = "*" if row.best else ("x" if not row.feasible else " ")
    gain = f"{row.speedup_vs_prev:.2f}" if row.speedup_vs_prev is not None else "-"
    return (f"{row.micro_batches:>2} {row.weight_read_mb:>7.0f} {row.compute_ms:>6.2f} {row.memory_ms:>6.2f} "
            f"{row.comm_ms:>7.2f} {row.layer_us:>8.1f} {_fmt_rate(row.tokens_per_s_per_gpu):>9}{mark} "
            f"{_fmt_rate(row.tokens_per_s_system):>9} {gain:>6}")


def print_phase(tables: list[list[Row]]) -> None:
    """The batch sizes' tables side by side, sharing the per-degree columns on the left."""
    left = f"{'EP':>4} {'exp/rk':>6} {'held GB':>7} {'imbal':>5}"
    heads = [f"T={rows[0].tokens_per_rank} tokens/rank".center(len(BLOCK_HEAD)) for rows in tables]
    print(f"{'':>{len(left)}} | " + " | ".join(heads))
    print(left + " | " + " | ".join(BLOCK_HEAD for _ in tables))
    for i, n in enumerate(DEGREES):
        first = tables[0][i]
        imbalance = tables[-1][i].imbalance
        fit = "" if first.fits else "!"
        print(f"{n:>4} {first.experts_per_rank:>6.0f} {first.weights_held_gb:>6.1f}{fit or ' '} {imbalance:>5.2f} | "
              + " | ".join(_block(rows[i]) for rows in tables))


def _span(p: PhasePlan) -> str:
    return f"EP {p.low}" if p.low == p.high else f"EP {p.low}–{p.high}"


def plan_line(label: str, prefill: PhasePlan, decode: PhasePlan) -> str:
    knee = f"past EP {decode.knee}" if decode.knee else "nowhere"
    return (f"plan ({label}): prefill {_span(prefill)}, decode {_span(decode)} "
            f"(decode gains < {PLAN_TOLERANCE:.0%} per doubling {knee})")


def run(keys: list[str], *, load_cv: float, fp4_math: bool) -> dict:
    """Print every hardware's tables and plan; return the figures for ``--json``."""
    out: dict = {
        "model": {"name": "DeepSeek-V4-Flash", "hidden": HIDDEN, "moe_intermediate": MOE_INTERMEDIATE,
                  "routed_experts": ROUTED_EXPERTS, "top_k": TOP_K, "shared_experts": SHARED_EXPERTS, "layers": LAYERS,
                  "expert_bytes": EXPERT_BYTES, "shared_expert_bytes": SHARED_EXPERT_BYTES,
                  "routed_bytes_all_layers": ROUTED_BYTES, "replicated_bytes": REPLICATED_BYTES},
        "assumptions": {"gemm_efficiency": GEMM_EFFICIENCY, "hbm_efficiency": HBM_EFFICIENCY,
                        "link_efficiency": LINK_EFFICIENCY, "gemm_row_tile": GEMM_ROW_TILE, "expert_load_cv": load_cv,
                        "overlap_residual": OVERLAP_RESIDUAL, "hbm_weight_fraction": HBM_WEIGHT_FRACTION,
                        "decode_step_slo_s": DECODE_STEP_SLO_S, "plan_tolerance": PLAN_TOLERANCE,
                        "scale_up_collective_latency_s": SCALE_UP_COLLECTIVE_LATENCY_S,
                        "scale_out_collective_latency_s": SCALE_OUT_COLLECTIVE_LATENCY_S,
                        "per_peer_latency_s": PER_PEER_LATENCY_S, "math": "fp4" if fp4_math else "fp8"},
        "hardware": {},
    }
    print(f"DeepSeek-V4-Flash MoE layer under EP: routed experts {ROUTED_BYTES / GB:.1f} GB (FP4), replicated "
          f"{REPLICATED_BYTES / GB:.2f} GB, {EXPERT_BYTES / 1e6:.1f} MB per expert, shared expert "
          f"{SHARED_EXPERT_BYTES / 1e6:.1f} MB (FP8) per layer")
    print(f"ms columns: summed over the {LAYERS} MoE layers of one step; layer us: one layer after overlap; "
          "mb: micro-batches (2 = overlapped);")
    print("read MB: weights read per layer; imbal: busiest rank's routed rows over the mean (largest batch); "
          f"* best, x infeasible, ! weights over {HBM_WEIGHT_FRACTION:.0%} of HBM")
    lines = []
    plans_by_key: dict[str, dict[str, PhasePlan]] = {}
    for key in keys:
        hw = HARDWARE[key]
        plans = {}
        rows_out = []
        print(f"\n== {hw.name}: {hw.hbm_bytes / GB:.0f} GB at {hw.hbm_bw / TB:.1f} TB/s, "
              f"{(hw.fp4_flops if fp4_math else hw.fp8_flops) / PFLOPS:.1f} PF {'FP4' if fp4_math else 'FP8'} "
              f"dense, {hw.interconnect}")
        for phase, batches in (("prefill", PREFILL_TOKENS_PER_RANK), ("decode", DECODE_TOKENS_PER_RANK)):
            tables = [table(hw, phase, t, load_cv=load_cv, fp4_math=fp4_math) for t in batches]
            plans[phase] = plan(phase, tables)
            rows_out += [asdict(r) for rows in tables for r in rows]
            print(f"-- {phase} ({plans[phase].objective})")
            print_phase(tables)
        plans_by_key[key] = plans
        line = plan_line(hw.key, plans["prefill"], plans["decode"])
        lines.append(line)
        print(line)
        out["hardware"][key] = {"spec": asdict(hw), "rows": rows_out, "plan": {k: asdict(v) for k, v in plans.items()}}
    if "ascend950pr" in plans_by_key and "ascend950dt" in plans_by_key:  # Huawei's pairing
        combined = plan_line("ascend950: prefill on 950PR, decode on 950DT", plans_by_key["ascend950pr"]["prefill"],
                             plans_by_key["ascend950dt"]["decode"])
        lines.append(combined)
        out["plan_ascend950"] = {"prefill_on": "ascend950pr", "decode_on": "ascend950dt",
                                 "prefill": asdict(plans_by_key["ascend950pr"]["prefill"]),
                                 "decode": asdict(plans_by_key["ascend950dt"]["decode"])}
    print()
    for line in lines:
        print(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="b200,gb200-nvl72,ascend950",
                    help=f"comma-separated among {', '.join([*HARDWARE, *ALIASES])}")
    ap.add_argument("--expert-load-cv", type=float, default=EXPERT_LOAD_CV,
                    help="per-expert load coefficient of variation within a step (imbalance model)")
    ap.add_argument("--fp4-math", action="store_true", help="run the routed-expert GEMMs at the FP4 peak, not FP8")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = ap.parse_args()
    keys: list[str] = []
    for key in args.hardware.split(","):
        key = key.strip()
        if key not in HARDWARE and key not in ALIASES:
            ap.error(f"unknown hardware {key!r}; choose among {', '.join([*HARDWARE, *ALIASES])}")
        keys += ALIASES.get(key, (key,))
    out = run(keys, load_cv=args.expert_load_cv, fp4_math=args.fp4_math)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()

"""A cost model of DeepSeek-V4-Flash's MoE layers under expert parallelism on published hardware figures.

For each EP degree N and each phase it models one rank of a data-parallel-attention + EP deployment:

- weights: the rank holds 256/N routed experts (FP4 e2m1 with 1x32 UE8M0 scales) and the replicated rest
  (FP8 linears, shared experts, embeddings), the bytes ``deepinfer inspect`` gives; they must fit in 70 % of
  HBM, and the KV cache gets what is left of 90 %;
- MoE compute: ``2·3·D·I`` FLOPs per (token, expert) pair, 6 routed + 1 shared per token, at the FP8
  tensor-core peak times an efficiency; expert weights read once per step (only the experts the global
  batch hits); a layer takes the roofline max of the two;
- dispatch (FP8 activations + scales) and combine (bf16) through all-to-all: bytes over the scale-up link
  for peers in the scale-up domain, over the scale-out NIC for the others, plus a per-collective latency
  that grows with the number of peers; two micro-batches overlap communication with compute (DeepSeek's
  serving scheme), so a layer costs ``max(compute, comm)`` plus a tenth of the smaller;
- decode also reads each sequence's KV (sliding window + top-k compressed entries, from the engine's own
  cache geometry) and is held to a step-time budget: the batch per rank is the largest the KV memory and
  the budget allow.

Objectives: prefill maximises tokens/s per device at a fixed per-rank batch; decode maximises tokens/s
per device within the step budget. The printed plan is every N within 10 % of the best.

    .venv/bin/python benchmarks/ep_plan.py [--hardware b200,gb200nvl72,ascend950] [--json]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import add_json_flag, emit_json  # noqa: E402

from tests.helpers.published import V4_FLASH  # noqa: E402  (the published V4-Flash config.json)

GB = 1e9
LAYERS = V4_FLASH["num_hidden_layers"]
D = V4_FLASH["hidden_size"]
I = V4_FLASH["moe_intermediate_size"]  # noqa: E741
EXPERTS = V4_FLASH["n_routed_experts"]
TOP_K = V4_FLASH["num_experts_per_tok"]
#: FP4 e2m1 codes (half a byte) plus one UE8M0 byte per 32 values
FP4_BYTES = 0.5 + 1 / 32
EXPERT_BYTES = 3 * D * I * FP4_BYTES
SHARED_BYTES = 3 * D * I * (1 + 1 / (128 * 128))  # FP8 with 128 x 128 float scales
#: decode: mean context per sequence, and what sparse attention reads per sequence and layer:
#: a 128-token window plus index_topk 512 compressed entries, 512-d bf16 KV
CONTEXT = 8192
ATTN_READ_PER_SEQ_LAYER = (128 + 512) * 512 * 2
DECODE_STEP_BUDGET_S = 0.050  # 20 tokens/s per sequence
PREFILL_TOKENS_PER_RANK = 16384
DEGREES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes: float
    hbm_bw: float
    fp8_flops: float
    scale_up_bw: float
    scale_up_domain: int
    scale_out_bw: float
    #: fixed and per-peer latency of one all-to-all, seconds
    latency_s: float
    latency_per_peer_s: float
    sources: str


HARDWARE = {
    # NVIDIA DGX B200 datasheet / Blackwell architecture pages (nvidia.com): 180 GB HBM3e per GPU at 8 TB/s,
    # dense FP8 4.5 PFLOP/s (9 with sparsity), fifth-generation NVLink 1.8 TB/s per GPU (900 GB/s each way) in an
    # 8-GPU HGX domain, ConnectX-7 400 Gb/s (50 GB/s) per GPU for scale-out.
    "b200": Hardware("B200 (HGX, 8-GPU NVLink domain)", 180 * GB, 8e12, 4.5e15, 900 * GB, 8, 50 * GB, 15e-6, 0.2e-6,
                     "nvidia.com DGX B200 datasheet; NVIDIA Blackwell architecture technical brief"),
    # NVIDIA GB200 NVL72 datasheet (nvidia.com): 72 Blackwell GPUs in one NVLink domain (130 TB/s in all, 1.8 TB/s
    # per GPU), 13.4 TB HBM3e (186 GB per GPU) at 8 TB/s per GPU; scale-out as above.
    "gb200nvl72": Hardware("GB200 NVL72 (72-GPU NVLink domain)", 186 * GB, 8e12, 4.5e15, 900 * GB, 72, 50 * GB, 15e-6, 0.2e-6,
                           "nvidia.com GB200 NVL72 datasheet"),
    # Huawei Connect 2025 roadmap (as announced): Ascend 950DT 144 GB HiZQ 2.0 HBM at 4 TB/s, 1 PFLOP/s FP8,
    # 2 TB/s interconnect per chip; Atlas 950 SuperPoD joins chips over the UB mesh (modelled as a 64-chip
    # scale-up group, beyond which 400 Gb/s RoCE is assumed).
    "ascend950": Hardware("Ascend 950DT (SuperPoD, 64-chip group)", 144 * GB, 4e12, 1e15, 1000 * GB, 64, 50 * GB, 20e-6, 0.2e-6,
                          "Huawei Connect 2025 keynote: Ascend 950PR/950DT specifications (as announced)"),
}
COMPUTE_EFF, MEMORY_EFF = 0.6, 0.8


@dataclass
class Row:
    hardware: str
    phase: str
    ep: int
    fits: bool
    weights_gb_per_rank: float
    tokens_per_rank: int
    compute_us: float
    memory_us: float
    comm_us: float
    layer_us: float
    step_ms: float
    tokens_per_s_per_device: float


def _kv_bytes_per_seq() -> float:
    import torch

    from deepinfer.model.cache_spec import CacheGeometry, block_size_for
    from deepinfer.model.config import ModelConfig

    config = ModelConfig.from_hf(dict(V4_FLASH))
    geometry = CacheGeometry.build(config, block_size_for(config, 16), 512, CONTEXT)
    return geometry.bytes_per_token(torch.bfloat16) * CONTEXT + geometry.bytes_per_slot(torch.bfloat16)


def _layer(hw: Hardware, n: int, tokens: int) -> tuple[float, float, float, float]:
    """(compute, memory, comm, layer) seconds of one MoE layer on one rank."""
    pairs = tokens * TOP_K
    flops = (pairs + tokens) * 2 * 3 * D * I
    hit = (EXPERTS / n) * (1 - (1 - 1 / EXPERTS) ** (n * pairs))
    weight_bytes = hit * EXPERT_BYTES + SHARED_BYTES
    act_bytes = (pairs + tokens) * D * 2 * 3  # activations in and out of the grouped GEMMs
    compute = flops / (hw.fp8_flops * COMPUTE_EFF)
    memory = (weight_bytes + act_bytes) / (hw.hbm_bw * MEMORY_EFF)
    comm = 0.0
    if n > 1:
        off_rank = pairs * (n - 1) / n
        volume = off_rank * D * ((1 + 1 / 128) + 2)  # FP8 dispatch with scales, bf16 combine
        peers = n - 1
        outside = max(0, n - hw.scale_up_domain) / peers
        comm = volume * (1 - outside) / hw.scale_up_bw + volume * outside / hw.scale_out_bw
        comm += 2 * (hw.latency_s + hw.latency_per_peer_s * peers)
    work = max(compute, memory)
    return compute, memory, comm, max(work, comm) + 0.1 * min(work, comm)


def _weight_bytes() -> tuple[float, float]:
    """(routed experts, everything else) held quantized, as ``deepinfer inspect`` counts them."""
    import json
    import tempfile

    import torch

    from deepinfer.weight_memory import weight_memory

    directory = Path(tempfile.mkdtemp())
    (directory / "config.json").write_text(json.dumps(V4_FLASH))
    mem = weight_memory(directory, dtype=torch.bfloat16)
    return mem.by_kind["experts"], mem.total_bytes - mem.by_kind["experts"]


def rows_for(hw: Hardware, kv_per_seq: float, weight_bytes: tuple[float, float]) -> list[Row]:
    routed, rest = weight_bytes
    rows = []
    for n in DEGREES:
        weights = routed / n + rest
        fits = weights <= 0.7 * hw.hbm_bytes
        c, m, x, layer = _layer(hw, n, PREFILL_TOKENS_PER_RANK)
        rows.append(Row(hw.name, "prefill", n, fits, weights / GB, PREFILL_TOKENS_PER_RANK, c * 1e6, m * 1e6, x * 1e6,
                        layer * 1e6, layer * LAYERS * 1e3, PREFILL_TOKENS_PER_RANK / (layer * LAYERS) if fits else 0.0))
        kv_room = max(0.0, 0.9 * hw.hbm_bytes - weights)
        best = None
        for t in range(8, int(kv_room // kv_per_seq) + 1, 8):
            c, m, x, layer = _layer(hw, n, t)
            step = LAYERS * layer + t * LAYERS * ATTN_READ_PER_SEQ_LAYER / (hw.hbm_bw * MEMORY_EFF)
            if step > DECODE_STEP_BUDGET_S:
                break
            best = (t, c, m, x, layer, step)
        if best is None:
            rows.append(Row(hw.name, "decode", n, False, weights / GB, 0, 0, 0, 0, 0, 0, 0.0))
            continue
        t, c, m, x, layer, step = best
        rows.append(Row(hw.name, "decode", n, fits, weights / GB, t, c * 1e6, m * 1e6, x * 1e6, layer * 1e6, step * 1e3,
                        t / step if fits else 0.0))
    return rows


def plan_range(rows: list[Row]) -> tuple[int, int]:
    """The EP degrees within 10 % of the best tokens/s per device."""
    top = max(r.tokens_per_s_per_device for r in rows)
    good = [r.ep for r in rows if r.tokens_per_s_per_device >= 0.9 * top]
    return min(good), max(good)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="b200,gb200nvl72,ascend950", help=f"comma-separated among {', '.join(HARDWARE)}")
    add_json_flag(ap)
    args = ap.parse_args()
    kv = _kv_bytes_per_seq()
    weight_bytes = _weight_bytes()
    out = {"kv_bytes_per_sequence": kv, "context": CONTEXT, "weight_bytes": list(weight_bytes), "hardware": {}}
    for key in args.hardware.split(","):
        hw = HARDWARE[key]
        rows = rows_for(hw, kv, weight_bytes)
        plans = {}
        print(f"\n== {hw.name} ({hw.sources})")
        for phase in ("prefill", "decode"):
            phase_rows = [r for r in rows if r.phase == phase]
            lo, hi = plan_range(phase_rows)
            plans[phase] = [lo, hi]
            print(f"-- {phase}: {'tokens/rank':>11} {'weights GB':>10} {'compute us':>10} {'memory us':>9} {'comm us':>8} "
                  f"{'layer us':>8} {'step ms':>8} {'tok/s/device':>12}")
            prev = None
            for r in phase_rows:
                gain = "" if prev is None or not prev else f" ({r.tokens_per_s_per_device / prev:.2f}x)"
                print(f"   EP {r.ep:>3}{'' if r.fits else '*'} {r.tokens_per_rank:>11} {r.weights_gb_per_rank:>10.1f} "
                      f"{r.compute_us:>10.1f} {r.memory_us:>9.1f} {r.comm_us:>8.1f} {r.layer_us:>8.1f} {r.step_ms:>8.2f} "
                      f"{r.tokens_per_s_per_device:>12.0f}{gain}")
                prev = r.tokens_per_s_per_device
        print(f"   (* the weights do not fit in 70 % of HBM)\nplan: prefill EP {plans['prefill'][0]}-{plans['prefill'][1]}, "
              f"decode EP {plans['decode'][0]}-{plans['decode'][1]}")
        out["hardware"][key] = {"name": hw.name, "plan": plans, "rows": [asdict(r) for r in rows]}
    emit_json(args.json, out)


if __name__ == "__main__":
    main()

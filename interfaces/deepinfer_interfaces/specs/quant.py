"""Quantized-weight cases: FP8 linears with DeepSeek's 128 x 128 blocks (partial edge blocks, UE8M0 and
float32 scales, codes as e4m3 or as raw bytes, one token, an empty batch) and grouped experts over FP4
(1 x 32 UE8M0 blocks) and FP8 stacks with -1 and foreign ids.

Weights are built so outputs have unit scale: a backend that quantizes activations on the fly (e4m3, one
scale per token and 128 columns, as FP8 GEMMs do) stays within the bf16/fp16 bounds, a wrong block or
scale index does not.
"""

import torch

from ..quant import QuantizedWeight, quantize
from .shapes import HIDDEN, MOE_INTER
from .spec import RMS_LIMITS, Case, OpSpec, Tolerance, randn, register, seeded


def _weight(g: torch.Generator, n: int, k: int, fmt: str, block: tuple[int, int], ue8m0: bool = True, raw: bool = False):
    """A random ``[n, k]`` weight of std ``1/sqrt(k)`` with uneven block magnitudes, quantized."""
    w = randn(n, k, gen=g) * k**-0.5
    rows = torch.rand(-(-n // block[0]), 1, generator=g) * 3 + 0.25  # blocks of rows at different scales
    w = w * rows.repeat_interleave(block[0], 0)[:n]
    q = quantize(w, fmt, block, ue8m0)
    return QuantizedWeight(q.codes.view(torch.uint8), q.scales, q.block, q.fmt) if raw else q


def _linear_cases() -> list[Case]:
    g = seeded(40)
    return [
        Case("t5_n200_k300_partial_blocks_ue8m0", dict(x=randn(5, 300, gen=g), weight=_weight(g, 200, 300, "e4m3", (128, 128)))),
        Case("t4_n256_k512_float32_scales", dict(x=randn(4, 512, gen=g), weight=_weight(g, 256, 512, "e4m3", (128, 128), ue8m0=False))),
        Case("one_token_codes_as_bytes", dict(x=randn(1, 384, gen=g), weight=_weight(g, 136, 384, "e4m3", (128, 128), raw=True))),
        Case("k_below_one_block", dict(x=randn(3, 40, gen=g), weight=_weight(g, 24, 40, "e4m3", (128, 128)))),
        Case("empty_batch", dict(x=torch.empty(0, 256), weight=_weight(g, 64, 256, "e4m3", (128, 128)))),
        Case("one_token_k4096_n384_real_width", dict(x=randn(1, HIDDEN, gen=g), weight=_weight(g, 384, HIDDEN, "e4m3", (128, 128)))),
        Case("t3_k4096_n256_long_k", dict(x=randn(3, HIDDEN, gen=g), weight=_weight(g, 256, HIDDEN, "e4m3", (128, 128)))),
    ]


def _experts(g, t: int, d: int, i: int, e: int, ids: torch.Tensor, fmt: str, block, limit) -> dict:
    w13 = quantize(randn(e, 2 * i, d, gen=g) * d**-0.5 * 2, fmt, block)
    w2 = quantize(randn(e, d, i, gen=g) * i**-0.5 * 2, fmt, block)
    return dict(x=randn(t, d, gen=g), topk_ids=ids, topk_weights=torch.rand(t, ids.shape[1], generator=g), w13=w13, w2=w2, limit=limit)


def _expert_cases() -> list[Case]:
    g = seeded(41)
    ids = torch.randint(0, 6, (7, 2), generator=g)
    many = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(200)])
    foreign = torch.tensor([[0, -1], [3, 9], [-1, -1], [2, 2]])
    return [
        Case("fp4_t7_d64_i32_e6_k2_clamped", _experts(g, 7, 64, 32, 6, ids, "e2m1", (1, 32), 1.0)),
        Case("fp4_t200_grouped", _experts(g, 200, 64, 32, 8, many, "e2m1", (1, 32), 10.0)),
        Case("fp8_t7_d160_i64_partial_blocks", _experts(g, 7, 160, 64, 6, ids, "e4m3", (128, 128), 10.0)),
        Case("fp4_minus_one_and_foreign_ids_skipped", _experts(g, 4, 32, 16, 4, foreign, "e2m1", (1, 32), None)),
        Case("empty_batch", _experts(g, 0, 32, 16, 3, torch.empty(0, 2, dtype=torch.int64), "e2m1", (1, 32), 10.0)),
        Case("fp4_one_token", _experts(g, 1, 64, 32, 4, torch.tensor([[2, 0]]), "e2m1", (1, 32), 10.0)),
        Case("fp4_one_token_d4096_i2048_real_width", _fp4_real_width(g), dtypes=(torch.bfloat16,)),
    ]


def _fp4_raw(g: torch.Generator, e: int, n: int, k: int, fan_in: int) -> QuantizedWeight:
    """Random FP4 codes (two per byte) and UE8M0 scales giving values of std about ``2/sqrt(fan_in)``:
    built directly, since quantizing 25M values would dominate the case."""
    codes = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    exp = 127 + round(torch.log2(torch.tensor(fan_in**-0.5)).item())
    scales = torch.randint(exp - 1, exp + 2, (e, n, k // 32), generator=g, dtype=torch.int64).to(torch.uint8)
    return QuantizedWeight(codes, scales, (1, 32), "e2m1")


def _fp4_real_width(g: torch.Generator) -> dict:
    """One token at V4-Flash's width on the one expert of this rank it picked (its other 5 picks are
    -1 or foreign); bf16 only, the dtype its relative-RMS limit is about (the case costs ~0.5 s a dtype)."""
    ids = torch.tensor([[0, 255, -1, 9, 3, 1]])
    return dict(x=randn(1, HIDDEN, gen=g), topk_ids=ids, topk_weights=torch.rand(1, 6, generator=g),
                w13=_fp4_raw(g, 1, 2 * MOE_INTER, HIDDEN, HIDDEN), w2=_fp4_raw(g, 1, HIDDEN, MOE_INTER, MOE_INTER), limit=10.0)


register(OpSpec(
    op="fp8_linear",
    cases=_linear_cases,
    cast=("x",),
    tolerances={torch.bfloat16: Tolerance(atol=0.2, rtol=0.04), torch.float16: Tolerance(atol=0.2, rtol=0.04)},
    tolerance_reason=(
        "a backend may quantize the activations to e4m3 per token and 128 columns (3 mantissa bits) before its FP8 GEMM; "
        "on these unit-scale outputs that costs up to about 0.19"
    ),
    rms_limits={torch.float32: RMS_LIMITS[torch.float32], torch.bfloat16: 0.05, torch.float16: 0.05},
    rms_reason=(
        "fp32: the table's; bf16/fp16: e4m3 activations (allowed) cost an estimated 0.03 relative RMS on their own, so the limit "
        "only catches gross loss (a whole 4096-long sum kept in 16 bits), not bf16 partial sums between 128-column blocks"
    ),
))
register(OpSpec(
    op="moe_experts_quantized",
    cases=_expert_cases,
    cast=("x",),
    tolerances={torch.bfloat16: Tolerance(atol=0.1, rtol=0.016), torch.float16: Tolerance(atol=0.01, rtol=0.002)},
    tolerance_reason=(
        "a backend may round the clamped-SwiGLU activation to x's dtype between the two matmuls (the down "
        "projection's 16-bit tensor-core operand, as the moe_experts kernels do); with these cases' activations "
        "up to about 10 and outputs up to about 45 that costs up to about 0.05 in bf16 and 0.005 in fp16"
    ),
    rms_limits={**RMS_LIMITS, torch.bfloat16: 1e-2},
    rms_reason=("the expert GEMMs' 4096- and 2048-long dots at the real width: partial sums kept in bf16 between K tiles "
                "lose several roundings; bf16 allows 1e-2 because a backend may round the SwiGLU activation to bf16 "
                "before the down projection (up to 7e-3 measured)"),
))

"""FP8 linears and FP4/FP8 routed experts mapped onto torch_npu's quantized matmuls (Ascend 950 only).

Each function takes the imported ``torch_npu`` module and NPU tensors, states
next to the call the torch_npu signature it relies on and the gap it bridges,
and raises ``NotSupportedError`` for inputs the fused ops do not take (the
kernel set then runs the reference, or conformance reports not_supported).

Two block-scaled modes of CANN's quantized matmuls fit DeepSeek's weights;
both quantize the activations on the fly, as FP8 GEMMs do:

- **MX** (``group_sizes=[1, 1, 32]``): e4m3 x e4m3 with one e8m0 scale per
  row and 32 consecutive K columns on both sides, scales laid out
  ``[rows, ceil(K/64), 2]`` (pairs of 32-column groups). A UE8M0 weight with
  any block whose column count is a multiple of 32 becomes MX exactly by
  repeating each block scale over its rows and 32-column groups; DeepSeek's
  FP4 experts (1 x 32 UE8M0 blocks along K) already are MX blocks.
- **G-B** (``group_sizes=[1, 128, 128]``): e4m3 x e4m3 with float32 scales, one
  per token and 128 K columns for x and one per 128 x 128 block for the
  weight: DeepSeek's FP8 linears with float32 scales, as stored.

Left to the reference, and why:

- Atlas A2/A3 (and older): no FP8 or MX matmul. Their quantized matmuls take
  int8/int4 (the A2/A3 G-B mode is int8 only); re-quantizing FP8 codes to
  int8 is lossy, so the reference runs there.
- fp32/fp64 activations: these paths quantize x to e4m3 (3 mantissa bits),
  which cannot meet the fp32 tolerance the op spec holds fp32 inputs to.
- Weights no mode fits: FP4 codes or any block without a multiple of 32
  columns unless the scales are UE8M0; float32 scales on blocks other than
  128 x 128.
- Weight-only (A16) block-scaled matmuls: on Ascend 950
  ``npu_weight_quant_batchmatmul`` takes FP8 weights per channel only and
  MXFP4 weights in a single (not grouped) matmul, and the grouped matmul's
  antiquant mode takes FP8 weights per channel only.

FP4 experts do not use a W4A8 grouped matmul (FP8 x, FP4 weight): the
aclnnGroupedMatmulV4 reference for Ascend 950 lists FP4 weights only with FP4
activations (too lossy for V4's experts) and ND weights only, while the W4A8
path vllm-ascend runs casts the experts to FRACTAL_NZ at load time, which
needs a weight-preparation hook the Kernels contract does not have. Instead
the FP4 codes are re-encoded to e4m3 per call (exact: every e2m1 value is an
e4m3 value), nibble order per ``QuantizedWeight`` (low nibble first), and run
as MXFP8 with their scales unchanged. That costs one pass over the local
experts' weights per call; a load-time repack would remove it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from deepinfer_interfaces import NotSupportedError, QuantizedWeight

from .device import cached_soc, features_for_generation
from .npu_ops import swiglu_packed

#: activation dtypes the FP8 paths take (fp32 needs a tighter bound than e4m3 activations meet)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)
#: K columns per MX scale
MX_GROUP = 32
#: M, N, K group sizes of the G-B mode
GB_GROUPS = (1, 128, 128)
#: most groups (experts) one grouped matmul takes
MAX_GROUPS = 1024

def _need(cond: bool, what: str) -> None:
    if not cond:
        raise NotSupportedError(what)


def require_fp8_soc(tn: ModuleType, device: torch.device) -> None:
    """Raise ``NotSupportedError`` unless ``device`` is an Ascend 950 (the generation with FP8/MX matmuls).

    The SoC comes from ``torch_npu.npu.get_soc_version()`` (the device name as
    the fallback), once per device (see ``device.detect_soc``).
    """
    soc = cached_soc(tn.npu, device.index or 0)
    _need(features_for_generation(soc.generation)["fp8"],
          f"{soc.source} (generation {soc.generation}) has no FP8/MX matmul; block-scaled FP8 GEMMs exist on Ascend 950 only")


def _e8m0(tn: ModuleType) -> Any:
    dtype = getattr(tn, "float8_e8m0fnu", None)
    _need(dtype is not None, "this torch_npu has no float8_e8m0fnu, so it cannot pass MX scales")
    return dtype


def scheme(weight: QuantizedWeight) -> str:
    """``"mx"`` or ``"gb"``: the block-scaled mode ``weight`` runs in; ``NotSupportedError`` if none fits."""
    bn, bk = weight.block
    if weight.scales.dtype == torch.uint8 and bk % MX_GROUP == 0:
        return "mx"
    if weight.fmt == "e4m3" and weight.scales.dtype == torch.float32 and (bn, bk) == GB_GROUPS[1:]:
        return "gb"
    raise NotSupportedError(
        f"no FP8 matmul mode takes {weight.fmt} codes with {weight.scales.dtype} scales on {bn} x {bk} blocks "
        "(MX needs UE8M0 scales on blocks of a multiple of 32 columns, G-B float32 scales on 128 x 128 blocks)"
    )


def e2m1_as_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """FP4 codes ``[..., K/2]`` (two per byte, low nibble first) as the same values in e4m3 ``[..., K]``.

    Exact: e2m1 is sign, 2 exponent bits (bias 1) and 1 mantissa bit; a normal
    value keeps its mantissa bit as e4m3's top mantissa bit with the exponent
    rebased to bias 7, the one subnormal (0.5) is e4m3's 2^-1. Integer ops on
    bytes only, so no float copy of the weight is made.
    """
    nib = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)
    sign = (nib & 0x08) << 4
    exp = (nib >> 1) & 0x03
    man = nib & 0x01
    magnitude = torch.where(exp > 0, ((exp + 6) << 3) | (man << 2), man * (6 << 3))
    return (sign | magnitude).view(torch.float8_e4m3fn)


def _e4m3_codes(weight: QuantizedWeight) -> torch.Tensor:
    """The weight's codes as ``float8_e4m3fn`` ``[..., N, K]`` (raw bytes viewed, FP4 re-encoded)."""
    if weight.fmt == "e2m1":
        return e2m1_as_e4m3(weight.codes.view(torch.uint8))
    return weight.codes if weight.codes.dtype == torch.float8_e4m3fn else weight.codes.view(torch.float8_e4m3fn)


def mx_scales(weight: QuantizedWeight) -> torch.Tensor:
    """UE8M0 block scales ``[..., ceil(N/bn), ceil(K/bk)]`` as MX scales ``[..., N, ceil(K/64), 2]``.

    Each block scale is repeated over its ``bn`` rows and its ``bk/32`` column
    groups (partial edge blocks trimmed); an odd group count gets one zero
    byte, the padding the MX layout asks for, which scales no columns.
    """
    *lead, n, k = weight.shape
    bn, bk = weight.block
    groups = -(-k // MX_GROUP)
    s = weight.scales
    if bk != MX_GROUP:
        s = s.repeat_interleave(bk // MX_GROUP, dim=-1)
    s = s[..., :groups]
    if bn != 1:
        s = s.repeat_interleave(bn, dim=-2)
    s = s[..., :n, :]
    if groups % 2:
        s = torch.cat([s, s.new_zeros(*s.shape[:-1], 1)], dim=-1)
    return s.reshape(*lead, n, -1, 2)


def quantize_mx(tn: ModuleType, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as e4m3 codes and e8m0 scales ``[M, ceil(K/64), 2]`` (one per 32 columns).

    ``torch_npu.npu_dynamic_mx_quant(input, *, axis=-1, round_mode="rint",
    dst_type=296, block_size=32, scale_alg=0, dst_type_max=0.0, max_low_bound=0.0)
    -> (y, mxscale)`` (``dst_type`` is an ``int`` in the schema; a torch dtype converts to its ScalarType number)
    (Ascend 950; mxscale as uint8 bytes, groups even-padded with 0).
    ``scale_alg=1`` takes each group's amax / 448 and rounds the exponent up, so
    no value saturates: DeepSeek's own UE8M0 activation scaling.
    """
    try:
        return tn.npu_dynamic_mx_quant(x.contiguous(), axis=-1, dst_type=torch.float8_e4m3fn, block_size=MX_GROUP, scale_alg=1)
    except TypeError as exc:  # releases whose npu_dynamic_mx_quant has no scale_alg
        raise NotSupportedError(f"this torch_npu's npu_dynamic_mx_quant has no scale_alg ({exc})") from exc


def quantize_gb(tn: ModuleType, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` as e4m3 codes and float32 scales ``[M, ceil(K/128)]`` with ``x ≈ codes · scale``.

    ``torch_npu.npu_dynamic_block_quant(x, *, min_scale=0.0, round_mode="rint",
    dst_type=1, row_block_size=1, col_block_size=128, dst_type_max=0.0) -> (y, scale)``;
    FP8 output on Ascend 950 only (aclnnDynamicBlockQuantV2), where
    ``scale = amax / 448`` per block (the torch_npu page's formula reads as the
    reciprocal; its own example and the aclnn reference show the multiplier).
    """
    return tn.npu_dynamic_block_quant(
        x.contiguous(), dst_type=torch.float8_e4m3fn, row_block_size=GB_GROUPS[0], col_block_size=GB_GROUPS[2]
    )


def _check_activations(x: torch.Tensor) -> None:
    _need(x.dtype in ACTIVATION_DTYPES,
          f"the FP8 matmuls quantize activations to e4m3, too coarse for {x.dtype} inputs; bf16/fp16 only")


def fp8_linear(tn: ModuleType, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``Kernels.fp8_linear`` through ``torch_npu.npu_quant_matmul(x1, x2, scale, *,
    offset=None, pertoken_scale=None, bias=None, output_dtype=None, x1_dtype=None,
    x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None, y_scale=None) -> Tensor``.

    ``x2`` is the logical ``[K, N]`` weight: the stored ``[N, K]`` codes
    transposed as a view, with the weight scales transposed the same way (the op
    requires x2 and its scales to agree). MX: scales ``[ceil(K/64), N, 2]``
    uint8 with ``scale_dtype``/``pertoken_scale_dtype=float8_e8m0fnu`` and
    ``group_sizes=[1, 1, 32]``. G-B: scales ``[ceil(K/128), ceil(N/128)]``
    float32 and ``group_sizes=[1, 128, 128]``. Output ``x.dtype`` (bf16/fp16).
    """
    _check_activations(x)
    _need(weight.fmt == "e4m3", f"fp8_linear takes e4m3 weights, not {weight.fmt}")
    mode = scheme(weight)
    require_fp8_soc(tn, x.device)
    codes = _e4m3_codes(weight).t()
    if mode == "mx":
        e8m0 = _e8m0(tn)
        xq, xs = quantize_mx(tn, x)
        return tn.npu_quant_matmul(
            xq, codes, mx_scales(weight).transpose(0, 1), scale_dtype=e8m0, pertoken_scale=xs,
            pertoken_scale_dtype=e8m0, output_dtype=x.dtype, group_sizes=[1, 1, MX_GROUP],
        )
    xq, xs = quantize_gb(tn, x)
    return tn.npu_quant_matmul(
        xq, codes, weight.scales.t(), pertoken_scale=xs, output_dtype=x.dtype, group_sizes=list(GB_GROUPS)
    )


def _grouped(tn: ModuleType, x: torch.Tensor, weight: QuantizedWeight, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of group e] = x[rows of group e] @ W[e]ᵀ`` for a stacked block-scaled ``W`` ``[E, N, K]``.

    ``torch_npu.npu_grouped_matmul(x, weight, *, bias=None, scale=None, ...,
    per_token_scale=None, group_list=None, split_item=0, group_type=None,
    group_list_type=0, act_type=0, tuning_config=None, output_dtype=None,
    x_dtype=None, weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None)
    -> List[Tensor]`` (aclnnGroupedMatmulV4, Ascend 950 "dynamic quantization"):
    one ``[M, K]`` e4m3 x, one ``[E, K, N]`` weight (the stored codes as a
    transposed view), ``group_type=0``, per-group row counts with
    ``group_list_type=1`` (their sum may stay below M; rows past it are left
    unspecified), ``split_item=2``. MX: weight scale ``[E, ceil(K/64), N, 2]``
    and x scale ``[M, ceil(K/64), 2]``, both e8m0. G-B: weight scale
    ``[E, ceil(K/128), ceil(N/128)]`` and x scale ``[M, ceil(K/128)]``, float32.
    """
    common = dict(group_list=counts, group_type=0, group_list_type=1, split_item=2, output_dtype=x.dtype)
    codes = _e4m3_codes(weight).transpose(1, 2)
    if scheme(weight) == "mx":
        e8m0 = _e8m0(tn)
        xq, xs = quantize_mx(tn, x)
        scales = mx_scales(weight).transpose(1, 2)
        return tn.npu_grouped_matmul([xq], [codes], scale=[scales], per_token_scale=[xs], scale_dtype=e8m0,
                                     per_token_scale_dtype=e8m0, **common)[0]
    xq, xs = quantize_gb(tn, x)
    return tn.npu_grouped_matmul([xq], [codes], scale=[weight.scales.transpose(1, 2)], per_token_scale=[xs], **common)[0]


def moe_experts_quantized(
    tn: ModuleType,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: QuantizedWeight,
    w2: QuantizedWeight,
    limit: float | None,
) -> torch.Tensor:
    """Grouped clamped-SwiGLU experts over quantized stacks: two block-scaled grouped matmuls.

    A stable sort puts the (token, slot) rows of each expert together, valid
    ids first; the row count per expert is the group list, so ``-1`` and
    foreign ids fall past its sum and are masked out of the result. Every
    shape is static (``T·k`` rows) and nothing waits for the device. The
    clamped SwiGLU runs between the matmuls (``npu_ops.swiglu_packed``); its
    output is quantized again for the down projection. The weighted rows are
    summed back per token in fp32.
    """
    _check_activations(x)
    num_experts = w13.shape[0]
    _need(1 <= num_experts <= MAX_GROUPS, f"npu_grouped_matmul takes 1 to {MAX_GROUPS} groups, got {num_experts} experts")
    for weight in (w13, w2):
        scheme(weight)
    require_fp8_soc(tn, x.device)
    t, d = x.shape
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts].to(torch.int64)
    tokens = order // k
    h = _grouped(tn, x[tokens], w13, counts)
    y = _grouped(tn, swiglu_packed(tn, h, limit), w2, counts)
    w = topk_weights.reshape(-1)[order].float()
    rows = torch.where(valid[order][:, None], y.float() * w[:, None], 0.0)
    out = torch.zeros(t, d, dtype=torch.float32, device=x.device).index_add_(0, tokens, rows)
    return out.to(x.dtype)

"""Linears over block-scaled quantized weights: ``x @ Wᵀ`` with ``W`` read as codes inside the GEMM.

Two paths, chosen on the host from dtypes, the weight's blocks and the device
(never from data, so a captured graph or a compiled forward sees no branch):

- **FP8 tensor cores** (compute capability 8.9 and up, bf16/fp16 activations,
  e4m3 weights whose column blocks are whole multiples of 128):
  ``_act_quant_kernel`` quantizes the activations to e4m3 in groups of one
  token × 128 columns (scale ``amax / 448``, DeepGEMM's activation layout),
  then ``_fp8_gemm_kernel`` runs an FP8 × FP8 ``tl.dot`` per 128-column step
  with fp32 accumulation, multiplying each step's product by the token's
  activation scale and the weight block's scale.
- **Decode in the kernel** (fp32 activations, older GPUs, other blocks, FP4
  codes): ``_dequant_gemm_kernel`` decodes weight tiles in registers
  (``triton_dequant.weight_dot``) and runs a bf16/fp16/fp32 dot.

When the output has few tiles (decode batches) the K reduction is split over
programs that write fp32 partial sums, added afterwards. Under the interpreter
bf16/fp16 take the FP8 path too: its FP8 ``tl.dot`` is exact there, so the
op specs check the numerics a Hopper or Blackwell GPU runs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_interfaces.quant import QuantizedWeight

from .launch import Tiles, autotune_configs, choose, interpreting, rows
from .triton_common import dot_operands, programs_target, split_count
from .triton_dequant import E4M3, WeightOperand, scale_to_float, weight_dot

#: activation columns one e4m3 scale covers, and the FP8 GEMM's K step
GROUP = 128


@triton.jit
def e4m3_bits(x):
    """The e4m3 byte (as int32) nearest to each fp32 ``x`` with ``|x| <= 448``, ties to even, by integer arithmetic.

    The interpreter's own fp32 → e4m3 cast loses the carry when rounding up
    crosses a power of two (127.4 becomes 64); this is what the GPU's
    ``cvt.rn.satfinite`` computes.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normals: round the 23 mantissa bits to 3 (the carry moves into the exponent), rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # below 2^-6: multiples of 2^-9, rounded to even by the fp32 adder
    tiny = ((tl.abs(x) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return sign | tl.where(a < 0x3C800000, tiny, normal)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, T, K, stride_x, stride_q, stride_s,
    INTEGER_CAST: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr,
):
    """Rows ``[BLOCK_T]`` × one group of ``GROUP`` columns: e4m3 codes and one fp32 scale per row (``s[g, t]``)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (t < T)[:, None] & (cols < K)[None, :]
    t64 = t.to(tl.int64)
    x = tl.load(x_ptr + t64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # 448 is e4m3's largest value; the floor gives an all-zero group a finite scale (and zero codes)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    y = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    if INTEGER_CAST:
        q = e4m3_bits(y).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        q = y.to(tl.float8e4nv)
    tl.store(q_ptr + t64[:, None] * stride_q + cols[None, :], q, mask=mask)
    tl.store(s_ptr + g * stride_s + t, scale, mask=t < T)


def _fp8_configs() -> list[triton.Config]:
    shapes = ((64, 4, 4), (128, 4, 3), (128, 8, 4), (256, 8, 3))
    return autotune_configs(
        [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in shapes],
        triton.Config({"BLOCK_N": 16}, num_warps=1),
    )


def _dequant_configs() -> list[triton.Config]:
    shapes = ((64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3))
    return autotune_configs(
        [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in shapes],
        triton.Config({"BLOCK_N": 16, "BLOCK_K": 32}, num_warps=1),
    )


def _prune(configs: list[triton.Config], nargs: dict, **_: object) -> list[triton.Config]:
    """Drop tiles wider than the weight; a weight narrower than every tile takes the first config."""
    fit = [c for c in configs if c.kwargs["BLOCK_N"] <= max(64, nargs["N"]) and c.kwargs.get("BLOCK_K", 0) <= max(64, nargs["K"])]
    return fit or configs[:1]


@triton.autotune(configs=_fp8_configs(), key=["N", "K", "BLOCK_M"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _fp8_gemm_kernel(
    q_ptr, qs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, SLICE, stride_q, stride_qs, stride_wn, stride_sn, stride_o,
    BN_W: tl.constexpr, BK_W: tl.constexpr, UE8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One output tile over one K slice: e4m3 activations (scales ``qs[k / BLOCK_K, m]``) × e4m3 weight bytes."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    sl = tl.program_id(2)
    m_ok, n_ok = m < M, n < N
    m64, n64 = m.to(tl.int64), n.to(tl.int64)
    ws_rows = (n // BN_W).to(tl.int64) * stride_sn
    start = sl * SLICE
    end = tl.minimum(start + SLICE, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(start, end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < end
        a = tl.load(q_ptr + m64[:, None] * stride_q + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + n64[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        a_s = tl.load(qs_ptr + (k0 // BLOCK_K) * stride_qs + m, mask=m_ok, other=0.0)
        w_s = scale_to_float(tl.load(ws_ptr + ws_rows + k0 // BK_W, mask=n_ok, other=0), UE8M0)
        acc += tl.dot(a, b.to(tl.float8e4nv, bitcast=True)) * (a_s[:, None] * w_s[None, :])
    out_rows = (sl * M + m).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.autotune(configs=_dequant_configs(), key=["N", "K", "BLOCK_M", "FMT"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _dequant_gemm_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, SLICE, stride_x, stride_wn, stride_sn, stride_o,
    FMT: tl.constexpr, BN_W: tl.constexpr, BK_W: tl.constexpr, UE8M0: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One output tile over one K slice: activations × weight tiles decoded in registers."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    sl = tl.program_id(2)
    m_ok, n_ok = m < M, n < N
    m64 = m.to(tl.int64)
    start = sl * SLICE
    end = tl.minimum(start + SLICE, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(start, end, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + m64[:, None] * stride_x + kk[None, :], mask=m_ok[:, None] & (kk < end)[None, :], other=0.0).to(DOT)
        acc = weight_dot(acc, a, w_ptr, s_ptr, n, n_ok, k0, end, stride_wn, stride_sn,
                         FMT, BN_W, BK_W, UE8M0, DOT, PREC, BLOCK_N, BLOCK_K)
    out_rows = (sl * M + m).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_o + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.lru_cache(maxsize=None)
def _has_fp8_tensor_cores(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def uses_fp8_dot(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    """True when ``fp8_linear`` runs the FP8 × FP8 path for these operands on this device (a host-side, cached decision)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.fmt != "e4m3" or weight.block[1] % GROUP:
        return False
    if interpreting() or x.device.type != "cuda":
        return True
    return _has_fp8_tensor_cores(torch.cuda.current_device() if x.device.index is None else x.device.index)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[T, K]`` as e4m3 codes ``[T, K]`` and fp32 scales ``[ceil(K/128), T]`` (one per token and 128 columns):
    ``scale = max(amax, 1e-12) / 448``, ``code = e4m3(clamp(x / scale, ±448))``."""
    t, k = x.shape
    q = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(triton.cdiv(k, GROUP), t, dtype=torch.float32, device=x.device)
    tiles = act_quant_tiles()
    _act_quant_kernel[(triton.cdiv(t, tiles.blocks["BLOCK_T"]), triton.cdiv(k, GROUP))](
        x, q, s, t, k, x.stride(0), q.stride(0), s.stride(0), INTEGER_CAST=interpreting(), **tiles.kwargs(),
    )
    return q, s


def act_quant_tiles() -> Tiles:
    """16 tokens × one 128-column group per program."""
    block_t = choose(16, 4)
    return Tiles({"BLOCK_T": block_t, "GROUP": GROUP}, num_warps=4 if block_t >= 16 else 1)


def block_m_for(tokens: int, invariant: bool = False) -> int:
    """Output rows per tile: the smallest MMA tile that holds a decode batch, up to 128 for prefill; one
    height (64) whatever the batch in batch-invariant mode."""
    if interpreting():
        return 8
    if invariant:
        return 64
    return 16 if tokens <= 16 else 32 if tokens <= 32 else 64 if tokens <= 64 else 128


def k_step(fp8_dot: bool) -> int:
    """Columns a K slice is a multiple of: one activation scale group on the FP8 path."""
    return GROUP if fp8_dot else choose(128, 32)


def k_slices(m_tiles: int, n: int, k: int, step: int, target: int) -> tuple[int, int]:
    """``(splits, slice)``: K cut into ``splits`` slices of ``slice`` columns (a multiple of ``step``)
    when the output's tiles fall short of ``target`` programs."""
    chunk = step * choose(4, 1)
    splits = split_count(m_tiles * triton.cdiv(n, 128), k, chunk, target)
    slice_k = triton.cdiv(triton.cdiv(k, step), splits) * step
    return triton.cdiv(k, slice_k), slice_k


def fp8_linear(x: torch.Tensor, weight: QuantizedWeight, fp8_dot: bool | None = None, invariant: bool = False) -> torch.Tensor:
    """``Kernels.fp8_linear`` on the device for ``x`` ``[T, K]``, ``T >= 1``; ``fp8_dot`` forces a path (None: ``uses_fp8_dot``).
    ``invariant``: batch-invariant mode (one tile height whatever ``T``, K never split)."""
    op = WeightOperand.of(weight)
    n, k = op.shape
    if x.dim() != 2 or x.shape[-1] != k:
        raise ValueError(f"fp8_linear: need x [T, {k}] for a weight [{n}, {k}]; got {tuple(x.shape)}")
    fp8_dot = uses_fp8_dot(x, weight) if fp8_dot is None else fp8_dot
    if fp8_dot and (op.fmt != E4M3 or op.block[1] % GROUP):
        raise ValueError(f"fp8_linear: the FP8 path needs e4m3 codes in blocks of a multiple of {GROUP} columns; got {weight.fmt} {weight.block}")
    x = rows(x, k)
    t = x.shape[0]
    block_m = block_m_for(t, invariant)
    splits, slice_k = k_slices(triton.cdiv(t, block_m), n, k, k_step(fp8_dot), programs_target(x.device, invariant))
    out = torch.empty(splits, t, n, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(t, block_m), triton.cdiv(n, meta["BLOCK_N"]), splits)  # noqa: E731
    if fp8_dot:
        q, qs = quantize_activations(x)
        _fp8_gemm_kernel[grid](
            q, qs, op.data, op.scales, out, t, n, k, slice_k, q.stride(0), qs.stride(0), op.data.stride(0), op.scales.stride(0),
            out.stride(1), BN_W=op.block[0], BK_W=op.block[1], UE8M0=op.ue8m0, BLOCK_M=block_m, BLOCK_K=GROUP,
        )
    else:
        dot, prec = dot_operands(x.dtype)
        _dequant_gemm_kernel[grid](
            x, op.data, op.scales, out, t, n, k, slice_k, x.stride(0), op.data.stride(0), op.scales.stride(0), out.stride(1),
            **op.constants(), DOT=dot, PREC=prec, BLOCK_M=block_m,
        )
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)

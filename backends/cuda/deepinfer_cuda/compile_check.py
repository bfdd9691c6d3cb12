"""Ahead-of-time compile check of every Triton kernel of the CUDA backend, for sm_90 and sm_100, on any machine.

Triton lowers a kernel to PTX and a cubin for a GPU it does not have (its
bundled ``ptxas``), so a CPU-only CI machine can catch what only a GPU launch
would reveal: compile errors, shared memory over what one block may use,
registers that cannot fit, and spills to local memory.

Each kernel is compiled as the launchers launch it at DeepSeek-V4-Flash sizes
(V4.1-Flash's for the kernels only V4.1 launches): the block sizes come from
the launchers' own ``*_tiles`` functions and autotune config lists (what
survives their early pruning at those sizes), the
arguments are specialised by Triton's own launch binder, so aligned pointers
and strides carry the ``tt.divisibility=16`` hints and size-1 integers become
constants, exactly as on a GPU. One ``Record`` comes back per (kernel, config,
dtype, target); spills are reported, not failed.

Registers and spills come from the cubin (``cuobjdump --dump-resource-usage``,
bundled with Triton): Triton 3.9 only learns ``n_regs`` / ``n_spills`` when a
driver loads the binary. ``spill_bytes`` is the local memory one thread uses
(its stack frame, where ptxas spills), which the driver reports as
``CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES`` (Triton's ``n_spills`` is that / 4).

    python -m deepinfer_cuda.compile_check [--targets 90,100] [--dtypes bf16,fp16,fp32] [--json FILE] [--quick]

Run it without ``TRITON_INTERPRET=1``: under the interpreter the launchers pick
interpreter blocks. ``TRITON_CACHE_DIR`` sets where compiled kernels are kept.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import math
import multiprocessing
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction, MockTensor, create_function_from_signature

from deepinfer_interfaces import KVFormat

from . import __path__ as _package_path
from . import (
    triton_attention, triton_bitmask, triton_cache, triton_candidates, triton_compressor, triton_engram, triton_experts,
    triton_fp8, triton_hadamard, triton_indexer, triton_linear, triton_long_context, triton_mhc, triton_moe, triton_norm,
    triton_records,
    triton_rope, triton_sampling, triton_vit,
)
from .launch import SHARED_MEMORY_PER_BLOCK, Tiles, interpreting
from .pool_operand import NO_FORMAT, format_constants
from .triton_common import PROGRAMS_PER_SM, accumulator, dot_operands
from .triton_dequant import E2M1, E4M3, PLAIN


# ---- limits ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceLimits:
    """What one thread block may use on a compute capability.

    Source: CUDA C++ Programming Guide, "Technical Specifications per Compute
    Capability" (compute capabilities 9.0 and 10.0): 227 KB of shared memory
    per block (opt-in; 228 KB per SM less 1 KB the driver reserves per block),
    64 K 32-bit registers per block and per SM, 255 registers per thread, 1024
    threads per block; registers are allocated per warp in units of 256 (the
    CUDA occupancy calculator's allocation granularity). Multiprocessor counts
    are those of the H100 SXM (132) and B200 (148); they only size the
    launchers' split heuristics at decode.
    """

    name: str
    shared_bytes: int
    regs_per_thread: int
    regs_per_block: int
    reg_alloc_unit: int
    max_threads: int
    multiprocessors: int


SM90 = DeviceLimits("sm_90 (H100/H200)", SHARED_MEMORY_PER_BLOCK, 255, 64 * 1024, 256, 1024, 132)
SM100 = DeviceLimits("sm_100 (B200)", SHARED_MEMORY_PER_BLOCK, 255, 64 * 1024, 256, 1024, 148)
LIMITS: dict[int, DeviceLimits] = {90: SM90, 100: SM100}

#: PTX a prefill-sized FP8 GEMM must contain: e4m3 x e4m3 tensor-core MMAs (wgmma on sm_90, tcgen05 on sm_100)
FP8_MMA = {90: r"wgmma\.mma_async\S*\.e4m3\.e4m3", 100: r"tcgen05\.mma\S*kind::f8f6f4"}


# ---- the sizes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class V41Shapes:
    """DeepSeek-V4.1-Flash's sizes for the kernels only V4.1 launches (its ``text_config``, as
    ``tests/helpers/published.py`` records it): the hyper-connection mixes and collapse it calls apart, and
    the candidate blocks of its two-level top-k, and its Engram ops (``engram_*`` of ``text_config``)."""

    hidden: int = 5120
    hc_mult: int = 4
    sinkhorn_iters: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    #: compress ratio of the candidate source layer (layer 20: one compressed entry per token)
    candidate_ratio: int = 1
    decode_tokens: int = 16
    prefill_tokens: int = 4096
    #: context a decode token sees: 65536 compressed entries at the candidate source, 8192 blocks
    context: int = 65536
    #: Engram: 2- to 4-grams, 8 heads of 256 channels (24 table columns per token), rows of layer 1's table
    engram_ngram: int = 4
    engram_heads: int = 8
    engram_head_dim: int = 256
    engram_rows: int = 384_006_168
    #: the vision tower: 16 heads of 64 channels, and the patches of one call (four images of the largest grid)
    vit_heads: int = 16
    vit_head_dim: int = 64
    vit_tokens: int = 4 * 93 * 93

    @property
    def engram_columns(self) -> int:
        return (self.engram_ngram - 1) * self.engram_heads


@dataclass(frozen=True)
class Shapes:
    """Model sizes the kernels are compiled at: DeepSeek-V4-Flash's ``config.json`` (as ``tests/helpers/published.py``
    records it; written out here because a backend must not import the engine's ``ModelConfig``), and V4.1-Flash's
    for the kernels only V4.1 launches."""

    hidden: int = 4096
    heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora: int = 1024
    index_heads: int = 64
    index_dim: int = 128
    index_topk: int = 512
    experts: int = 256
    top_k: int = 6
    moe_inter: int = 2048
    window: int = 128
    csa_ratio: int = 4
    hca_ratio: int = 128
    hc_mult: int = 4
    sinkhorn_iters: int = 20
    vocab: int = 129280
    #: FP8 linears and FP8 experts: e4m3 in 128 x 128 blocks; FP4 experts: e2m1 in 1 x 32 blocks; UE8M0 scales
    fp8_block: tuple[int, int] = (128, 128)
    fp4_block: tuple[int, int] = (1, 32)
    #: a representative linear for the GEMMs (``wo_b``: hidden x o_groups * o_lora)
    linear: tuple[int, int] = (4096, 8192)
    #: tokens of a decode step (a batch of sequences) and of a chunked-prefill step
    decode_tokens: int = 16
    prefill_tokens: int = 4096
    #: context a decode token sees (for pool sizes and the indexer's candidates)
    context: int = 65536
    #: the kernels only DeepSeek V4.1 launches, at V4.1-Flash's sizes
    v41: V41Shapes = V41Shapes()


V4_FLASH = Shapes()


@dataclass(frozen=True)
class PackedFormats:
    """The packed cache records V4 and V4.1 store (``deepinfer/models/deepseek_v4/cache.py`` ``v4_formats`` and
    ``deepseek_v41/cache.py`` ``v41_formats`` at the Flash models' widths; written out here because a backend must
    not import the engine)."""

    v4_kv: KVFormat = KVFormat("v4.kv.fp8", 512, "e4m3", 64, "ue8m0", 64)
    #: V4's K=V records of a checkpoint whose ``scale_fmt`` is float
    v4_kv_fp32: KVFormat = KVFormat("v4.kv.fp8", 512, "e4m3", 64, "fp32", 64)
    v4_index: KVFormat = KVFormat("v4.index.fp4", 128, "e2m1", 32, "ue8m0")
    v41_window: KVFormat = KVFormat("v41.window.fp8", 512, "e4m3", 32, "ue8m0")
    v41_entry: KVFormat = KVFormat("v41.entry.fp4", 512, "e2m1", 16, "e4m3")
    v41_index: KVFormat = KVFormat("v41.index.fp4", 128, "e2m1", 32, "ue8m0")


PACKED = PackedFormats()


@dataclass(frozen=True)
class PoolArgs:
    """A pool's arguments to a row-reading kernel, as ``pool_operand.PoolOperand`` passes them: plain rows of the
    model dtype, or one or two regions of records (a V4.1 pool: its FP4 entries, then its FP8 window rows)."""

    formats: tuple[KVFormat, ...] = ()

    def kernel(self, name: str) -> str:
        """The record's kernel name: ``name`` for plain rows, else ``name.records`` or ``name.two_regions`` (one
        quick case each)."""
        return name if not self.formats else f"{name}.{'records' if len(self.formats) == 1 else 'two_regions'}"

    def label(self, what: str) -> str:
        return ", ".join([what] + [f"{f.name} {f.scale} scales" for f in self.formats])

    def args(self, dtype: torch.dtype, dim: int, split: int, pointer: str = "kv", stride: str = "kv") -> dict[str, Any]:
        """The kernel arguments ``{pointer}_ptr``, ``{pointer}2_ptr``, ``stride_{stride}``, ``stride_{stride}2``,
        ``SPLIT_ROW`` (``split``, the second region's first row; 0 without one), ``REGIONS``, ``F0`` and ``F1``."""
        storage = ptr(torch.uint8) if self.formats else ptr(dtype)
        constants = [format_constants(f) for f in self.formats] or [NO_FORMAT]
        widths = [f.record_bytes for f in self.formats] or [dim]
        return {f"{pointer}_ptr": storage, f"{pointer}2_ptr": storage, f"stride_{stride}": widths[0], f"stride_{stride}2": widths[-1],
                "SPLIT_ROW": split if len(self.formats) == 2 else 0, "REGIONS": len(self.formats), "F0": constants[0],
                "F1": constants[-1]}


PLAIN_POOL = PoolArgs()
V4_KV_POOL = PoolArgs((PACKED.v4_kv,))
V4_KV_FP32_POOL = PoolArgs((PACKED.v4_kv_fp32,))
#: V4.1's K=V pool of a layer: its FP4 compressed entries, then its FP8 window rows
V41_KV_POOL = PoolArgs((PACKED.v41_entry, PACKED.v41_window))
V4_INDEX_POOL = PoolArgs((PACKED.v4_index,))

PHASES = ("decode", "prefill")
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---- cases and records ----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One launch to compile: a kernel, its arguments as a real aligned launch passes them, and its options."""

    kernel: str
    config: str
    dtype: str
    fn: JITFunction
    #: runtime arguments (``MockTensor`` for tensors, ints, floats) and constexprs, by name
    args: dict[str, Any]
    #: compile options: num_warps, num_stages, ...
    options: dict[str, int]
    quick: bool = False
    #: a regex the PTX must match per target (e.g. FP8 tensor-core MMAs)
    ptx_expect: dict[int, str] = field(default_factory=dict)

    @property
    def threads(self) -> int:
        return 32 * self.options.get("num_warps", 4)


@dataclass
class Record:
    """What compiling one case for one target gave."""

    kernel: str
    config: str
    dtype: str
    target: int
    shared_bytes: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    threads: int = 0
    seconds: float = 0.0
    error: str | None = None
    status: str = "ok"

    @property
    def failed(self) -> bool:
        """A compile error or a limit exceeded; spills alone do not fail."""
        return self.status not in ("ok", "spills")


def classify(record: Record, limits: DeviceLimits) -> str:
    """The record's status against ``limits``: the first limit it breaks, else ``spills`` or ``ok``."""
    if record.error is not None:
        return "error"
    if record.threads > limits.max_threads:
        return "threads>limit"
    if record.shared_bytes is not None and record.shared_bytes > limits.shared_bytes:
        return "shared>limit"
    if record.registers is not None:
        per_warp = math.ceil(record.registers * 32 / limits.reg_alloc_unit) * limits.reg_alloc_unit
        if record.registers > limits.regs_per_thread or per_warp * (record.threads // 32) > limits.regs_per_block:
            return "regs>limit"
    if record.spill_bytes:
        return "spills"
    return "ok"


# ---- building cases -------------------------------------------------------------------------


def ptr(dtype: torch.dtype) -> MockTensor:
    """A tensor argument: Triton specialises it by dtype, and its address (0) counts as 16-byte aligned."""
    return MockTensor(dtype)


def _jit(kernel: JITFunction | Autotuner) -> JITFunction:
    return kernel.fn if isinstance(kernel, Autotuner) else kernel


def _describe(blocks: dict[str, Any], options: dict[str, int], extra: str = "") -> str:
    """``BLOCK_M=64 BLOCK_N=128 w8 s3 · extra``: the block constexprs and the warps and stages."""
    parts = [f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in blocks.items()]
    parts.append(f"w{options.get('num_warps', 4)} s{options.get('num_stages', 3)}")
    return " ".join(parts) + (f" · {extra}" if extra else "")


def _footprint(case: Case) -> int:
    """A rough size of a config (blocks times stages), to pick the largest for the quick subset."""
    size = case.options.get("num_stages", 3) * case.options.get("num_warps", 4)
    for k, v in case.args.items():
        if k.startswith("BLOCK") and isinstance(v, int):
            size *= v
    return size


def launch_cases(
    name: str, kernel: JITFunction | Autotuner, dtype: str, args: dict[str, Any], tiles: Tiles, extra: str = "",
    ptx_expect: dict[int, str] | None = None,
) -> list[Case]:
    """The cases of one launch: one for a plain kernel, one per autotune config that survives the
    kernel's early pruning at these arguments (what the autotuner would benchmark on a GPU)."""
    fn = _jit(kernel)
    args = {**args, **tiles.blocks}
    base = {k: v for k, v in (("num_warps", tiles.num_warps), ("num_stages", tiles.num_stages)) if v is not None}
    expect = ptx_expect or {}
    if not isinstance(kernel, Autotuner):
        return [Case(name, _describe(tiles.blocks, base, extra), dtype, fn, args, base, ptx_expect=expect)]
    configs = kernel.configs
    if kernel.early_config_prune is not None:
        constexprs = {p.name for p in fn.params if p.is_constexpr}
        runtime = {k: v for k, v in args.items() if k not in constexprs}
        configs = kernel.early_config_prune(configs, runtime, **{k: v for k, v in args.items() if k in constexprs})
    out = []
    for config in configs:
        options = {k: v for k, v in config.all_kwargs().items() if k not in config.kwargs}
        out.append(Case(name, _describe({**tiles.blocks, **config.kwargs}, options, extra), dtype, fn,
                        {**args, **config.kwargs}, options, ptx_expect=expect))
    return out


def _norm(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    out = []
    rows = ((s.hidden, True, "hidden"), (s.q_lora, True, "q latent"), (s.head_dim, True, "kv / entry"),
            (s.head_dim, False, "q per head"), (s.index_dim, True, "indexer entry"),
            (4 * s.hidden + 1, True, "two-pass row > 16384"))
    for width, weighted, what in rows:
        args = dict(x_ptr=ptr(dtype), w_ptr=ptr(torch.float32 if weighted else dtype), out_ptr=ptr(dtype), D=width,
                    stride_x=width, stride_o=width, eps=1e-6, HAS_WEIGHT=weighted, ACC=accumulator(dtype))
        out += launch_cases("rms_norm", triton_norm._rms_norm_kernel, dt, args, triton_norm.rms_norm_tiles(width), what)
    return out


def _rope(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    out = []
    for heads, dim, inverse, what in ((s.heads, s.head_dim, False, "q"), (1, s.head_dim, False, "kv"),
                                      (s.heads, s.head_dim, True, "output, inverse"),
                                      (s.index_heads, s.index_dim, False, "indexer q"), (1, s.index_dim, False, "indexer entry")):
        half = s.rope_dim // 2
        args = dict(x_ptr=ptr(dtype), cos_ptr=ptr(torch.float32), sin_ptr=ptr(torch.float32), out_ptr=ptr(dtype), H=heads,
                    D=dim, NOPE=dim - s.rope_dim, stride_xt=heads * dim, stride_xh=dim, stride_ot=heads * dim,
                    stride_oh=dim, stride_ct=half, stride_st=half, INVERSE=inverse, ACC=accumulator(dtype))
        out += launch_cases("rope", triton_rope._rope_kernel, dt, args, triton_rope.rope_tiles(heads, dim), what)
    return out


def _sampling(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    f32, v = ptr(torch.float32), s.vocab
    words = triton.cdiv(v, 32)
    out = launch_cases("apply_token_bitmask", triton_bitmask._apply_bitmask_kernel, dt,
                       dict(logits_ptr=ptr(dtype), mask_ptr=ptr(torch.int32), V=v, W=words, stride_l=v, stride_m=words),
                       triton_bitmask.bitmask_tiles())
    out += launch_cases("sample.softmax_stats", triton_sampling._softmax_stats_kernel, dt,
                        dict(logits_ptr=ptr(dtype), temp_ptr=f32, max_ptr=f32, sum_ptr=f32, V=v, stride_l=v), Tiles())
    top = 50  # a row's top_k: torch.topk orders that many candidates
    out += launch_cases("sample.cutoff", triton_sampling._cutoff_kernel, dt,
                        dict(sorted_ptr=ptr(dtype), stride_s=top, K=top, V=v, temp_ptr=f32, top_k_ptr=ptr(torch.int64),
                             top_p_ptr=f32, need_ptr=ptr(torch.int8), max_ptr=f32, sum_ptr=f32, cutoff_ptr=f32),
                        triton_sampling.cutoff_tiles(), "top_k 50")
    out += launch_cases("sample.race", triton_sampling._race_kernel, dt,
                        dict(logits_ptr=ptr(dtype), noise_ptr=f32, V=v, stride_l=v, stride_n=v, temp_ptr=f32, min_p_ptr=f32,
                             max_ptr=f32, sum_ptr=f32, cutoff_ptr=f32, out_ptr=ptr(torch.int64)), Tiles())
    return out


def _cache(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    out = []
    for width, what in ((s.head_dim, "kv rows / HCA state"), (2 * s.head_dim, "CSA state"),
                        (2 * s.index_dim, "indexer state"), (s.index_dim, "indexer entry")):
        args = dict(pool_ptr=ptr(dtype), slots_ptr=ptr(torch.int64), values_ptr=ptr(dtype), N=s.context, W=width,
                    stride_p=width, stride_v=width)
        out += launch_cases("cache_write", triton_cache._cache_write_kernel, dt, args, triton_cache.cache_write_tiles(width), what)
    return out


def _records(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    """Packed records: the fused quantize-and-scatter of ``cache_write`` into each format's region, ``kv_pack`` of the
    indexer queries (``round_as_cached``) and ``kv_unpack`` of them in the model dtype."""
    out = []
    for fmt in (PACKED.v4_kv, PACKED.v4_kv_fp32, PACKED.v4_index, PACKED.v41_window, PACKED.v41_entry, PACKED.v41_index):
        args = dict(x_ptr=ptr(dtype), slots_ptr=ptr(torch.int64), out_ptr=ptr(torch.uint8), stride_x=fmt.dim,
                    stride_o=fmt.record_bytes, first_row=4096, rows=s.context, amax_floor=fmt.amax_floor,
                    F=format_constants(fmt), SCATTER=True)
        out += launch_cases(f"cache_write.{fmt.code}_{fmt.scale}", triton_records._kv_pack_kernel, dt, args,
                            triton_records.pack_tiles(fmt), f"{fmt.name} records")
    fmt = PACKED.v4_index
    args = dict(x_ptr=ptr(dtype), slots_ptr=ptr(torch.uint8), out_ptr=ptr(torch.uint8), stride_x=fmt.dim, stride_o=fmt.record_bytes,
                first_row=0, rows=s.prefill_tokens * s.index_heads, amax_floor=fmt.amax_floor, F=format_constants(fmt), SCATTER=False)
    out += launch_cases("kv_pack", triton_records._kv_pack_kernel, dt, args, triton_records.pack_tiles(fmt), "indexer queries")
    bf16 = dtype == torch.bfloat16
    args = dict(rec_ptr=ptr(torch.uint8), out_ptr=ptr(torch.int16 if bf16 else dtype), n=s.prefill_tokens * s.index_heads,
                stride_r=fmt.record_bytes, stride_o=fmt.dim, F=format_constants(fmt), BF16=bf16)
    out += launch_cases("kv_unpack", triton_records._kv_unpack_kernel, dt, args, triton_records.unpack_tiles(fmt), "indexer queries")
    return out


def _hadamard(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    """V4's rotation of indexer queries and keys (``index_dim`` wide)."""
    dot, prec = dot_operands(dtype)
    d = s.index_dim
    args = dict(x_ptr=ptr(dtype), out_ptr=ptr(dtype), T=s.prefill_tokens * s.index_heads, D=d, stride_x=d, stride_o=d,
                inv_sqrt=d**-0.5, DOT=dot, PREC=prec)
    return launch_cases("hadamard", triton_hadamard._hadamard_kernel, dt, args, triton_hadamard.hadamard_tiles(d), "indexer rows")


def attention_cases(heads: int, dim: int, tokens: int, k: int, dtype: torch.dtype, dt: str, target: int, what: str,
                    pool: PoolArgs = PLAIN_POOL) -> list[Case]:
    """The sparse attention launch (and at decode the slice merge) for ``tokens`` tokens over ``k`` indices of ``pool``."""
    dot, prec = dot_operands(dtype)
    f32 = ptr(torch.float32)
    splits, slice_len = triton_attention.attention_slices(tokens, heads, k, PROGRAMS_PER_SM * LIMITS[target].multiprocessors)
    split = splits > 1
    out_ptr = f32 if split else ptr(dtype)
    stride_ot = splits * heads * dim if split else heads * dim
    args = dict(q_ptr=ptr(dtype), idx_ptr=ptr(torch.int64), sink_ptr=f32, out_ptr=out_ptr,
                part_m_ptr=f32 if split else out_ptr, part_l_ptr=f32 if split else out_ptr, H=heads, D=dim, K=k, N=1 << 20,
                SLICE=slice_len if split else k, qk_scale=0.06, stride_qt=heads * dim, stride_qh=dim,
                stride_it=k, stride_ot=stride_ot, stride_oh=dim, SPLIT=split, DOT=dot, PREC=prec, **pool.args(dtype, dim, 1 << 19))
    label = f"{what}, {splits} slices" if split else what
    out = launch_cases(pool.kernel("sparse_attention"), triton_attention._sparse_attention_kernel, dt, args,
                       triton_attention.attention_tiles(heads, dim), pool.label(label))
    if split:
        merge = dict(part_ptr=f32, part_m_ptr=f32, part_l_ptr=f32, sink_ptr=f32, out_ptr=ptr(dtype), H=heads, D=dim, S=splits,
                     stride_ot=heads * dim, stride_oh=dim)
        out += launch_cases("sparse_attention.merge", triton_attention._merge_slices_kernel, dt, merge,
                            triton_attention.merge_tiles(heads, dim), label)
    return out


def indexer_cases(heads: int, dim: int, tokens: int, k: int, dtype: torch.dtype, dt: str, what: str,
                  pool: PoolArgs = PLAIN_POOL) -> list[Case]:
    """The lightning indexer's score launch for ``tokens`` queries over ``k`` candidates of ``pool``."""
    dot, prec = dot_operands(dtype)
    args = dict(q_ptr=ptr(dtype), w_ptr=ptr(dtype), idx_ptr=ptr(torch.int64), out_ptr=ptr(torch.float32),
                H=heads, D=dim, K=k, N=1 << 18, scale=0.088, stride_qt=heads * dim, stride_qh=dim, stride_wt=heads,
                stride_it=k, stride_ot=k, DOT=dot, PREC=prec, **pool.args(dtype, dim, 1 << 18, "keys", "k"))
    return launch_cases(pool.kernel("indexer_scores"), triton_indexer._indexer_scores_kernel, dt, args,
                        triton_indexer.indexer_tiles(heads, dim), pool.label(what))


def _attention(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    tokens = s.decode_tokens if phase == "decode" else s.prefill_tokens
    out = []
    for pool in (PLAIN_POOL, V4_KV_POOL, V4_KV_FP32_POOL, V41_KV_POOL):
        out += attention_cases(s.heads, s.head_dim, tokens, s.window + s.index_topk, dtype, dt, target, f"{phase}, CSA", pool)
    if phase == "decode":
        for pool in (PLAIN_POOL, V4_INDEX_POOL):
            out += indexer_cases(s.index_heads, s.index_dim, tokens, s.context // s.csa_ratio, dtype, dt, phase, pool)
        # the bundled tiny model's smallest tiles: a head block below one MMA, one indexer head
        out += attention_cases(2, 16, tokens, 32, dtype, dt, target, "tiny model")
        out += indexer_cases(1, 16, tokens, 64, dtype, dt, "tiny model")
    return out


def _long_context(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    """The ops over every entry a token sees, at a million-token context: the indexer's fused top-k over the CSA
    entries (split over them at decode, then the merge) and attention over the window plus every HCA entry."""
    tokens = s.decode_tokens if phase == "decode" else s.prefill_tokens
    context = 1 << 20
    n, k = context // s.csa_ratio, s.index_topk
    dot, prec = dot_operands(dtype)
    i64, f32 = ptr(torch.int64), ptr(torch.float32)
    programs = PROGRAMS_PER_SM * LIMITS[target].multiprocessors
    splits, slice_len = triton_long_context.topk_slices(tokens, k, n, programs)
    split = splits > 1
    tiles = triton_long_context.topk_tiles(s.index_heads, s.index_dim, k, n, dtype)
    what = f"{phase}, {n} CSA entries, top {k}" + (f", {splits} slices" if split else "")
    out = []
    for pool in (PLAIN_POOL, V4_INDEX_POOL):
        args = dict(q_ptr=ptr(dtype), w_ptr=ptr(dtype), table_ptr=i64, seq_ptr=i64, vis_ptr=i64, out_ptr=i64,
                    H=s.index_heads, D=s.index_dim, N=n, P=n + 4096, TOPK=k, SLICE=slice_len, scale=0.088,
                    stride_qt=s.index_heads * s.index_dim, stride_qh=s.index_dim, stride_wt=s.index_heads,
                    stride_tb=n, stride_ot=k, SPLIT=split, DOT=dot, PREC=prec, **pool.args(dtype, s.index_dim, n + 4096, "keys", "k"))
        out += launch_cases(pool.kernel("indexer_topk"), triton_long_context._indexer_topk_kernel, dt, args, tiles, pool.label(what))
    if split:
        merge = dict(part_ptr=i64, out_ptr=i64, S=splits, TOPK=k, stride_ot=k)
        out += launch_cases("indexer_topk.merge", triton_long_context._topk_merge_kernel, dt, merge,
                            triton_long_context.topk_merge_tiles(k, n), what)
    heads, dim, window, entries = s.heads, s.head_dim, s.window, context // s.hca_ratio
    splits, slice_len = triton_attention.attention_slices(tokens, heads, window + entries, programs)
    split = splits > 1
    out_ptr = f32 if split else ptr(dtype)
    what = f"{phase}, window {window} + {entries} HCA entries" + (f", {splits} slices" if split else "")
    for pool in (PLAIN_POOL, V4_KV_POOL, V41_KV_POOL):
        args = dict(q_ptr=ptr(dtype), idx_ptr=i64, table_ptr=i64, seq_ptr=i64, vis_ptr=i64, sink_ptr=f32,
                    out_ptr=out_ptr, part_m_ptr=f32 if split else out_ptr, part_l_ptr=f32 if split else out_ptr, H=heads, D=dim,
                    K=window, N=entries, P=1 << 20, SLICE=slice_len if split else window + entries, qk_scale=0.06,
                    stride_qt=heads * dim, stride_qh=dim, stride_it=window, stride_tb=entries,
                    stride_ot=splits * heads * dim if split else heads * dim, stride_oh=dim, SPLIT=split, DOT=dot, PREC=prec,
                    **pool.args(dtype, dim, entries, "kv", "kv"))
        out += launch_cases(pool.kernel("entry_attention"), triton_long_context._entry_attention_kernel, dt, args,
                            triton_attention.attention_tiles(heads, dim), pool.label(what))
    if split:
        merge = dict(part_ptr=f32, part_m_ptr=f32, part_l_ptr=f32, sink_ptr=f32, out_ptr=ptr(dtype), H=heads, D=dim, S=splits,
                     stride_ot=heads * dim, stride_oh=dim)
        out += launch_cases("entry_attention.merge", triton_attention._merge_slices_kernel, dt, merge,
                            triton_attention.merge_tiles(heads, dim), what)
    return out


def _compressor(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    out = []
    for ratio, width, overlap, what in ((s.csa_ratio, 2 * s.head_dim, True, "CSA"), (s.hca_ratio, s.head_dim, False, "HCA"),
                                        (s.csa_ratio, 2 * s.index_dim, True, "indexer")):
        dout = width // 2 if overlap else width
        args = dict(kv_ptr=ptr(dtype), gate_ptr=ptr(dtype), bias_ptr=ptr(torch.float32), idx_ptr=ptr(torch.int64),
                    prev_ptr=ptr(torch.int64), out_ptr=ptr(dtype), M=ratio, DOUT=dout, N=s.context, stride_kv=width,
                    stride_g=width, stride_b=width, stride_i=ratio, stride_p=ratio, stride_o=dout, HAS_PREV=overlap)
        out += launch_cases("compress_kv", triton_compressor._compress_kv_kernel, dt, args,
                            triton_compressor.compress_tiles(ratio, dout), what)
    return out


def _mhc(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    n, d = s.hc_mult, s.hidden
    tokens = s.decode_tokens if phase == "decode" else s.prefill_tokens
    f32 = ptr(torch.float32)
    splits, slice_len = triton_mhc.mix_slices(tokens, n, d, PROGRAMS_PER_SM * LIMITS[target].multiprocessors)
    out = []
    for head in (False, True):
        what = f"{'head' if head else 'pre'}, {phase}, {splits} slices"
        nu = n if head else (2 + n) * n
        mix = dict(x_ptr=ptr(dtype), fn_ptr=f32, part_ptr=f32, sq_ptr=f32, T=tokens, KD=n * d, NU=nu, SLICE=slice_len,
                   stride_x=n * d, stride_f=n * d, PREC=triton_mhc.mix_precision(dtype))
        out += launch_cases("mhc.mix", triton_mhc._mix_kernel, dt, mix, triton_mhc.mix_tiles(n, head), what)
        out += _mhc_finish(dtype, dt, tokens, n, d, splits, s.sinkhorn_iters, head, True, what)
    if phase == "prefill":
        post = dict(y_ptr=ptr(dtype), x_ptr=ptr(dtype), post_ptr=f32, comb_ptr=f32, out_ptr=ptr(dtype), NS=n, D=d, stride_yt=d,
                    stride_xt=n * d, stride_xn=d, stride_pt=n, stride_ct=n * n, stride_cj=n, stride_ot=n * d, stride_on=d)
        out += launch_cases("mhc.post", triton_mhc._post_kernel, dt, post, triton_mhc.post_tiles(n, d))
    return out


def _mhc_finish(dtype: torch.dtype, dt: str, tokens: int, n: int, d: int, splits: int, iters: int, head: bool, collapse: bool,
                what: str) -> list[Case]:
    """The finishing kernel as ``triton_mhc._mix_and_finish`` launches it (outputs it does not write: the fp32 partials)."""
    f32 = ptr(torch.float32)
    args = dict(x_ptr=ptr(dtype), part_ptr=f32, sq_ptr=f32, base_ptr=f32, scale_ptr=f32, out_ptr=ptr(dtype) if collapse else f32,
                pre_ptr=f32, post_ptr=f32, comb_ptr=f32, T=tokens, NS=n, D=d, S=splits, ITERS=iters, norm_eps=1e-6, hc_eps=1e-6,
                stride_xt=n * d, stride_xn=d, stride_ot=d if collapse else triton_mhc.mix_tiles(n, head).blocks["BLOCK_U"],
                HEAD=head, COLLAPSE=collapse)
    name = "mhc.finish" if collapse else "mhc_mix.finish"
    return launch_cases(name, triton_mhc._finish_kernel, dt, args, triton_mhc.finish_tiles(n, d, head, collapse), what)


def _mhc_v41(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    """V4.1's ``mhc_mix`` (the mixing kernel, then the finishing kernel without the collapse) and ``mhc_collapse``."""
    v = s.v41
    n, d = v.hc_mult, v.hidden
    tokens = v.decode_tokens if phase == "decode" else v.prefill_tokens
    f32 = ptr(torch.float32)
    splits, slice_len = triton_mhc.mix_slices(tokens, n, d, PROGRAMS_PER_SM * LIMITS[target].multiprocessors)
    what = f"V4.1, {phase}, {splits} slices"
    nu = (2 + n) * n
    mix = dict(x_ptr=ptr(dtype), fn_ptr=f32, part_ptr=f32, sq_ptr=f32, T=tokens, KD=n * d, NU=nu, SLICE=slice_len,
               stride_x=n * d, stride_f=n * d, PREC=triton_mhc.mix_precision(dtype))
    out = launch_cases("mhc_mix.mix", triton_mhc._mix_kernel, dt, mix, triton_mhc.mix_tiles(n, False), what)
    out += _mhc_finish(dtype, dt, tokens, n, d, splits, v.sinkhorn_iters, False, False, what)
    collapse = dict(x_ptr=ptr(dtype), pre_ptr=f32, out_ptr=ptr(dtype), T=tokens, NS=n, D=d, stride_xt=n * d, stride_xn=d,
                    stride_pt=n, stride_ot=d)
    out += launch_cases("mhc_collapse", triton_mhc._collapse_kernel, dt, collapse, triton_mhc.collapse_tiles(n, d),
                        f"V4.1, {phase}")
    return out


def _candidates(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    """V4.1's candidate blocks at the candidate source layer: block maxima, then the per-row selection."""
    v = s.v41
    tokens = v.decode_tokens if phase == "decode" else v.prefill_tokens
    n, bs = v.context // v.candidate_ratio, v.candidate_block_size
    blocks = triton.cdiv(n, bs)
    i32 = ptr(torch.int32)
    what = f"V4.1, {phase}, {n} entries, top {v.candidate_topk_blocks} of {blocks} blocks"
    first = dict(scores_ptr=ptr(dtype), visible_ptr=ptr(torch.int64), key_ptr=i32, N=n, NB=blocks, BS=bs, stride_s=n,
                 stride_k=blocks)
    out = launch_cases("candidate_blocks.block_max", triton_candidates._block_max_kernel, dt, first,
                       triton_candidates.block_max_tiles(bs), what)
    select = dict(key_ptr=i32, out_ptr=ptr(torch.uint8), T=tokens, N=n, NB=blocks, BS=bs, K=v.candidate_topk_blocks, stride_k=blocks,
                  stride_o=n)
    out += launch_cases("candidate_blocks.select", triton_candidates._select_kernel, dt, select,
                        triton_candidates.select_tiles(blocks, bs), what)
    return out


def _engram(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    """V4.1's Engram kernels at a prefill step (their tiles do not depend on the token count): the hash of
    ``[T, 4]`` windows, the lookup of 24 columns of 256 channels from an FP8 table and from a plain one, and the
    injection into 4 streams of 5120 with the key and value as views of the one ``wkv`` output."""
    v = s.v41
    tokens, n, d = v.prefill_tokens, v.hc_mult, v.hidden
    cols, hd, i64 = v.engram_columns, v.engram_head_dim, ptr(torch.int64)
    hashed = dict(tok_ptr=i64, mult_ptr=i64, prime_ptr=i64, off_ptr=i64, out_ptr=i64, T=tokens, N=v.engram_ngram,
                  H=v.engram_heads, stride_tt=v.engram_ngram, stride_ts=1, stride_p=v.engram_heads, stride_o=cols)
    out = launch_cases("engram_hash", triton_engram._hash_kernel, dt, hashed, triton_engram.hash_tiles(v.engram_heads),
                       f"V4.1, {v.engram_ngram}-grams x {v.engram_heads} heads")
    lookup_out = ptr(torch.int16 if dtype == torch.bfloat16 else dtype)
    for fmt, what in ((triton_engram.E4M3_TABLE, "e4m3 table, ue8m0 scales"), (triton_engram.PLAIN_TABLE, f"{dt} table")):
        fp8 = fmt == triton_engram.E4M3_TABLE
        scale_cols = hd // 32 if fp8 else hd
        lookup = dict(ids_ptr=i64, codes_ptr=ptr(torch.uint8 if fp8 else dtype), scales_ptr=ptr(torch.uint8 if fp8 else dtype),
                      out_ptr=lookup_out, R=tokens * cols, C=cols, J=hd, ROWS=v.engram_rows, stride_it=cols, stride_ic=1,
                      stride_cr=hd, stride_cj=1, stride_sr=scale_cols, stride_sj=1, stride_o=hd, FMT=fmt,
                      BF16_BITS=dtype == torch.bfloat16)
        out += launch_cases("engram_lookup", triton_engram._lookup_kernel, dt, lookup, triton_engram.lookup_tiles(hd),
                            f"V4.1, {cols} columns x {hd}, {what}")
    kv = (n + 1) * d
    inject = dict(h_ptr=ptr(dtype), q_ptr=ptr(dtype), v_ptr=ptr(dtype), w_ptr=ptr(torch.float32), out_ptr=ptr(dtype), NS=n, D=d,
                  eps=1e-20, inv_sqrt_d=d**-0.5, stride_ht=n * d, stride_hn=d, stride_qt=kv, stride_qn=d, stride_vt=kv,
                  stride_wn=d, stride_ot=n * d, stride_on=d)
    out += launch_cases("engram_inject", triton_engram._inject_kernel, dt, inject, triton_engram.inject_tiles(n, d),
                        f"V4.1, {n} streams x {d}")
    return out


def _vit(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    """The vision tower's attention over a call's packed images (its tiles depend only on the head dim)."""
    v = s.v41
    t, h, d = v.vit_tokens, v.vit_heads, v.vit_head_dim
    dot, prec = dot_operands(dtype)
    args = dict(q_ptr=ptr(dtype), k_ptr=ptr(dtype), v_ptr=ptr(dtype), cu_ptr=ptr(torch.int32), out_ptr=ptr(dtype), T=t, D=d,
                NSEG=4, qk_scale=d**-0.5, stride_qt=3 * h * d, stride_qh=d, stride_kt=3 * h * d, stride_kh=d,
                stride_vt=3 * h * d, stride_vh=d, stride_ot=h * d, stride_oh=d, DOT=dot, PREC=prec)
    return launch_cases("vit_attention", triton_vit._vit_attention_kernel, dt, args, triton_vit.vit_attention_tiles(d, dtype),
                        f"V4.1 vision, {h} heads x {d}, q/k/v views of one qkv")


def _moe(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    e, k = s.experts, s.top_k
    f32, i64 = ptr(torch.float32), ptr(torch.int64)
    out = []
    for hashed in (False, True):
        args = dict(logits_ptr=ptr(dtype), bias_ptr=ptr(dtype) if hashed else f32, table_ptr=i64 if hashed else ptr(dtype),
                    tok_ptr=i64 if hashed else ptr(dtype), w_ptr=f32, ids_ptr=i64, T=s.prefill_tokens, E=e, TOPK=k,
                    routed_scaling=1.5, stride_l=e, stride_tab=k if hashed else 0, SCORING=0, HAS_BIAS=not hashed, HASH=hashed,
                    RENORM=True)
        out += launch_cases("moe_route", triton_moe._route_kernel, dt, args, triton_moe.route_tiles(e, k),
                            "hash" if hashed else "learned, bias")
    w = s.moe_inter
    swiglu = dict(gate_ptr=ptr(dtype), up_ptr=ptr(dtype), out_ptr=ptr(dtype), W=w, stride_g=w, stride_u=w, stride_o=w, limit=10.0,
                  HAS_LIMIT=True)
    out += launch_cases("swiglu", triton_moe._swiglu_kernel, dt, swiglu, triton_moe.swiglu_tiles(w), "shared expert")
    return out


@dataclass(frozen=True)
class WeightFormat:
    """How a stacked weight is stored: plain values or block-scaled codes (``triton_dequant`` formats)."""

    name: str
    fmt: int
    block: tuple[int, int]
    ue8m0: bool

    def operand(self, dtype: torch.dtype, rows: int, cols: int) -> tuple[MockTensor, MockTensor, int, int, int, int]:
        """``(data, scales, stride_e, stride_n, scale_stride_e, scale_stride_n)`` of an ``[E, rows, cols]`` stack."""
        if self.fmt == PLAIN:
            return ptr(dtype), ptr(dtype), rows * cols, cols, rows * cols, cols
        width = cols // 2 if self.fmt == E2M1 else cols
        bn, bk = self.block
        grid_n, grid_k = triton.cdiv(rows, bn), triton.cdiv(cols, bk)
        scales = ptr(torch.uint8 if self.ue8m0 else torch.float32)
        return ptr(torch.uint8), scales, rows * width, width, grid_n * grid_k, grid_k

    def constants(self) -> dict[str, Any]:
        return dict(FMT=self.fmt, BN_W=self.block[0], BK_W=self.block[1], UE8M0=self.ue8m0)


def _experts(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    tokens = s.decode_tokens if phase == "decode" else s.prefill_tokens
    e, k, d, inter = s.experts, s.top_k, s.hidden, s.moe_inter
    block_m = triton_experts.block_m_for(tokens * k, e)
    dot, prec = dot_operands(dtype)
    f32, i64 = ptr(torch.float32), ptr(torch.int64)
    formats = (WeightFormat("bf16 weights" if dtype != torch.float32 else "plain weights", PLAIN, (1, 1), False),
               WeightFormat("e4m3 128x128", E4M3, s.fp8_block, True), WeightFormat("e2m1 1x32", E2M1, s.fp4_block, True))
    common = dict(pairs_ptr=i64, block_expert_ptr=ptr(torch.int32), E=e, DOT=dot, PREC=prec)
    rows = Tiles({"BLOCK_M": block_m})
    out = []
    for wf in formats:
        what = f"{phase}, {wf.name}"
        w, sc, se_w, sn_w, se_s, sn_s = wf.operand(dtype, 2 * inter, d)
        up = dict(common, x_ptr=ptr(dtype), w_ptr=w, s_ptr=sc, act_ptr=ptr(dtype), N=inter, K=d, TOPK=k, stride_x=d,
                  stride_we=se_w, stride_wn=sn_w, stride_se=se_s, stride_sn=sn_s, stride_a=inter, limit=10.0, HAS_LIMIT=True,
                  **wf.constants())
        out += launch_cases("moe_experts.up", triton_experts._up_kernel, dt, up, rows, what)
        w, sc, se_w, sn_w, se_s, sn_s = wf.operand(dtype, d, inter)
        down = dict(common, act_ptr=ptr(dtype), w_ptr=w, s_ptr=sc, y_ptr=f32, weights_ptr=f32, N=d, K=inter, stride_a=inter,
                    stride_we=se_w, stride_wn=sn_w, stride_se=se_s, stride_sn=sn_s, stride_y=d, **wf.constants())
        out += launch_cases("moe_experts.down", triton_experts._down_kernel, dt, down, rows, what)
    if phase == "prefill":
        args = dict(y_ptr=f32, ids_ptr=i64, out_ptr=ptr(dtype), E=e, D=d, TOPK=k, stride_y=d, stride_o=d)
        out += launch_cases("moe_experts.sum", triton_experts._sum_kernel, dt, args, triton_experts.sum_tiles(d))
    return out


def _linear(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    """The batch-invariant dense linear: one tile shape for every batch, over a projection and the LM head."""
    tokens = s.decode_tokens if phase == "decode" else s.prefill_tokens
    dot, prec = dot_operands(dtype)
    out = []
    for (n, k), what in ((s.linear, "projection"), ((s.vocab, s.hidden), "lm head")):
        args = dict(x_ptr=ptr(dtype), w_ptr=ptr(dtype), out_ptr=ptr(dtype), M=tokens, N=n, K=k, stride_x=k, stride_w=k,
                    stride_o=n, DOT=dot, PREC=prec)
        out += launch_cases("linear", triton_linear._linear_kernel, dt, args, triton_linear.linear_tiles(), f"{phase}, {what}")
    return out


def _fp8(s: Shapes, dtype: torch.dtype, dt: str, phase: str, target: int) -> list[Case]:
    tokens = s.decode_tokens if phase == "decode" else s.prefill_tokens
    n, k = s.linear
    block_m = triton_fp8.block_m_for(tokens)
    programs = PROGRAMS_PER_SM * LIMITS[target].multiprocessors
    f32, u8 = ptr(torch.float32), ptr(torch.uint8)
    out = []
    # the FP8 tensor-core path takes 16-bit activations (quantized to e4m3 first); fp32 decodes the weight in the kernel
    fp8_dot = dtype != torch.float32
    splits, slice_k = triton_fp8.k_slices(triton.cdiv(tokens, block_m), n, k, triton_fp8.k_step(fp8_dot), programs)
    result = f32 if splits > 1 else ptr(dtype)
    what = f"{phase}, {splits} K slices"
    bn, bk = s.fp8_block
    if fp8_dot:
        quant = dict(x_ptr=ptr(dtype), q_ptr=ptr(torch.float8_e4m3fn), s_ptr=f32, T=tokens, K=k, stride_x=k, stride_q=k,
                     stride_s=tokens, INTEGER_CAST=False)
        out += launch_cases("fp8_linear.act_quant", triton_fp8._act_quant_kernel, dt, quant, triton_fp8.act_quant_tiles(), phase)
        for ue8m0 in (True, False):
            gemm = dict(q_ptr=ptr(torch.float8_e4m3fn), qs_ptr=f32, w_ptr=u8, ws_ptr=u8 if ue8m0 else f32, out_ptr=result, M=tokens,
                        N=n, K=k, SLICE=slice_k, stride_q=k, stride_qs=tokens, stride_wn=k, stride_sn=triton.cdiv(k, bk),
                        stride_o=n, BN_W=bn, BK_W=bk, UE8M0=ue8m0)
            # below 64 rows (decode) Triton runs the e4m3 dot as f16 mma.sync (e4m3 is exact in f16); from 64 rows
            # it must be an FP8 tensor-core MMA (wgmma on sm_90, tcgen05 on sm_100)
            out += launch_cases("fp8_linear.fp8_gemm", triton_fp8._fp8_gemm_kernel, dt, gemm,
                                Tiles({"BLOCK_M": block_m, "BLOCK_K": triton_fp8.GROUP}),
                                f"{what}, {'ue8m0' if ue8m0 else 'fp32'} scales", ptx_expect=FP8_MMA if block_m >= 64 else None)
    else:
        dot, prec = dot_operands(dtype)
        for ue8m0 in (True, False):
            deq = dict(x_ptr=ptr(dtype), w_ptr=u8, s_ptr=u8 if ue8m0 else f32, out_ptr=result, M=tokens, N=n, K=k, SLICE=slice_k,
                       stride_x=k, stride_wn=k, stride_sn=triton.cdiv(k, bk), stride_o=n, FMT=E4M3, BN_W=bn, BK_W=bk,
                       UE8M0=ue8m0, DOT=dot, PREC=prec)
            out += launch_cases("fp8_linear.dequant_gemm", triton_fp8._dequant_gemm_kernel, dt, deq, Tiles({"BLOCK_M": block_m}),
                                f"{what}, e4m3 {'ue8m0' if ue8m0 else 'fp32'} scales")
    return out


#: the case builders, one per kernel family
BUILDERS: tuple[Callable[[Shapes, torch.dtype, str, str, int], list[Case]], ...] = (
    _norm, _rope, _sampling, _cache, _records, _hadamard, _attention, _long_context, _compressor, _mhc, _mhc_v41, _candidates,
    _engram, _vit, _moe, _experts, _fp8, _linear,
)


def _phase_independent(builder: Callable) -> bool:
    return builder in (_norm, _rope, _sampling, _cache, _records, _hadamard, _compressor, _engram, _vit, _moe)


def enumerate_cases(target: int, shapes: Shapes = V4_FLASH, dtypes: Sequence[str] = tuple(DTYPES)) -> list[Case]:
    """Every launch of every kernel at ``shapes`` for ``target``, in ``dtypes``, with the quick subset marked."""
    if interpreting():
        raise RuntimeError("compile_check needs the GPU launch configs: run it without TRITON_INTERPRET=1")
    cases: list[Case] = []
    for dt in dtypes:
        for builder in BUILDERS:
            for phase in PHASES[-1:] if _phase_independent(builder) else PHASES:
                cases += builder(shapes, DTYPES[dt], dt, phase, target)
    return _mark_quick(cases)


def _mark_quick(cases: list[Case]) -> list[Case]:
    """The CI subset: per kernel (and separately per weight format and for the tiny-model launches) the
    largest config, in bf16 where the kernel runs in bf16."""
    best: dict[tuple[str, Any, bool], tuple[tuple[bool, int], Case]] = {}
    for c in cases:
        key = (c.kernel, c.args.get("FMT"), "tiny model" in c.config)
        rank = (c.dtype == "bf16", _footprint(c))
        if key not in best or rank > best[key][0]:
            best[key] = (rank, c)
    chosen = {id(c) for _, c in best.values()}
    return [replace(c, quick=True) if id(c) in chosen else c for c in cases]


def backend_kernels() -> dict[str, JITFunction]:
    """Every kernel of the backend by ``module.name``: the ``*_kernel`` JIT functions (autotuned or not)
    of every ``triton_*`` module, found by scanning the package so a new one cannot go unchecked."""
    found = {}
    for info in pkgutil.iter_modules(_package_path):
        if info.name.startswith("triton_"):
            module = importlib.import_module(f"{__package__}.{info.name}")
            for name, obj in vars(module).items():
                if name.endswith("_kernel") and isinstance(obj, (JITFunction, Autotuner)):
                    found[f"{info.name}.{name}"] = _jit(obj)
    return found


# ---- compiling ------------------------------------------------------------------------------


_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """``(registers, local bytes per thread)`` of the one kernel in ``cubin``, read by the bundled ``cuobjdump``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    m = _RESOURCES.search(text)
    if m is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    reg, stack, _, local = map(int, m.groups())
    return reg, stack + local


def _error(exc: BaseException) -> str:
    """A short error: the exception's type and the first lines of its message (ptxas errors carry the whole log)."""
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: " + " | ".join(lines[:6])[:600]


def compile_case(case: Case, target: int) -> Record:
    """Compile ``case`` for ``sm_<target>`` the way a launch would, and measure it against that target's limits."""
    limits = LIMITS[target]
    record = Record(case.kernel, case.config, case.dtype, target, threads=case.threads)
    gpu = GPUTarget("cuda", target, 32)
    backend = make_backend(gpu)
    start = time.perf_counter()
    try:
        fn = case.fn
        # Triton's own launch binder: the signature, constants and divisibility hints of a real launch
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, opts = binder(**case.args, **case.options)
        options, signature, constexprs, attrs = fn._pack_args(backend, dict(case.options), bound, spec, opts)
        with contextlib.redirect_stdout(io.StringIO()):  # ptxas failures print the whole PTX
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=gpu, options=options.__dict__)
        record.shared_bytes = compiled.metadata.shared
        record.registers, record.spill_bytes = resource_usage(compiled.asm["cubin"])
        pattern = case.ptx_expect.get(target)
        if pattern and not re.search(pattern, compiled.asm["ptx"]):
            record.error = f"PTX has no match for {pattern!r} (expected instructions missing)"
    except Exception as exc:  # noqa: BLE001 - every failure is a record, not a crash
        record.error = _error(exc)
    record.seconds = round(time.perf_counter() - start, 3)
    record.status = classify(record, limits)
    return record


_WORKER_CASES: dict[tuple[int, tuple[str, ...]], list[Case]] = {}


def _compile_indexed(target: int, dtypes: tuple[str, ...], index: int) -> Record:
    """Worker side of ``check``: the cases are enumerated again (deterministically) and one is compiled."""
    key = (target, dtypes)
    if key not in _WORKER_CASES:
        _WORKER_CASES[key] = enumerate_cases(target, dtypes=dtypes)
    return compile_case(_WORKER_CASES[key][index], target)


def check(targets: Iterable[int] = (90, 100), dtypes: Sequence[str] = tuple(DTYPES), quick: bool = False,
          jobs: int | None = None) -> list[Record]:
    """Compile every case (or the quick subset) for every target, in ``jobs`` processes; one record each."""
    dtypes = tuple(dtypes)
    work = [(t, dtypes, i) for t in targets for i, c in enumerate(enumerate_cases(t, dtypes=dtypes)) if c.quick or not quick]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    if jobs == 1:
        return [_compile_indexed(*w) for w in work]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_compile_indexed, *zip(*work), chunksize=4))


# ---- the CLI --------------------------------------------------------------------------------


def table(records: Sequence[Record]) -> str:
    """The records as a text table: kernel, config, dtype, target, shared KB, registers, spill bytes, status."""
    head = ("kernel", "config", "dtype", "target", "shared KB", "regs", "spills B", "status")
    rows = [head] + [
        (r.kernel, r.config, r.dtype, f"sm_{r.target}", "-" if r.shared_bytes is None else f"{r.shared_bytes / 1024:.1f}",
         "-" if r.registers is None else str(r.registers), "-" if r.spill_bytes is None else str(r.spill_bytes),
         r.status if r.error is None else f"{r.status}: {r.error}")
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def summary(records: Sequence[Record]) -> str:
    """A markdown table per kernel and dtype: the cases (launches x autotune configs) compiled per target and,
    per target, the largest shared memory (KB), registers and spill bytes over them (the worst a GPU meets)."""
    targets = sorted({r.target for r in records})
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        groups.setdefault((r.kernel, r.dtype), []).append(r)
    head = ["kernel", "dtype", "cases"] + [f"sm_{t} {what}" for t in targets for what in ("shared KB", "regs", "spills B")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = list(DTYPES)
    for (kernel, dtype), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        cells = [f"`{kernel}`", dtype, str(len(rs) // len(targets))]
        for t in targets:
            on = [r for r in rs if r.target == t and r.error is None]
            cells += [f"{max(r.shared_bytes or 0 for r in on) / 1024:.1f}", str(max(r.registers or 0 for r in on)),
                      str(max(r.spill_bytes or 0 for r in on))] if on else ["error"] * 3
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Compile, print the table, write the JSON records if asked; 1 when any record failed, else 0."""
    parser = argparse.ArgumentParser(prog="python -m deepinfer_cuda.compile_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="90,100", help="compute capabilities to compile for (default 90,100)")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help=f"activation dtypes (default {','.join(DTYPES)})")
    parser.add_argument("--json", metavar="FILE", help="write the records as JSON to FILE")
    parser.add_argument("--quick", action="store_true", help="only the CI subset: each kernel at its largest config")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPU count)")
    parser.add_argument("--markdown", metavar="FILE", help="write the per-kernel summary table (markdown) to FILE")
    args = parser.parse_args(argv)
    targets = [int(t) for t in args.targets.split(",") if t]
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [t for t in targets if t not in LIMITS] + [d for d in dtypes if d not in DTYPES]
    if interpreting():
        parser.error("TRITON_INTERPRET=1 is set: the launchers would pick interpreter blocks; unset it")
    if bad:
        parser.error(f"unknown targets or dtypes {bad}: targets are {sorted(LIMITS)}, dtypes {list(DTYPES)}")
    start = time.perf_counter()
    records = check(targets, dtypes, args.quick, args.jobs)
    print(table(records))
    failed = [r for r in records if r.failed]
    spilled = [r for r in records if r.spill_bytes]
    print(f"\n{len(records)} compiled in {time.perf_counter() - start:.1f} s; {len(failed)} failed, {len(spilled)} spill "
          f"(reported, not failed)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in records], f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(summary(records) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

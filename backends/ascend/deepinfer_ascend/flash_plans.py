"""The DeepSeek-V4-Flash and V4.1-Flash launches the Triton-Ascend kernels make, planned for each UB budget.

Importing this module imports the kernels' planners (and so Triton); ``launch``
stays free of them, so the kernels can import ``launch`` without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer_interfaces.kv_format import KVFormat

from .launch import KiB, TilePlan, UNIFIED_BUFFERS


@dataclass(frozen=True)
class V4Shapes:
    """The DeepSeek-V4-Flash figures that size the Triton-Ascend tiles (its config.json)."""

    hidden: int = 4096
    hc_mult: int = 4
    head_dim: int = 512
    index_heads: int = 64
    index_head_dim: int = 128
    csa_ratio: int = 4
    hca_ratio: int = 128
    max_positions: int = 1048576


V4_FLASH = V4Shapes()


def v4_flash_plans(generation: str, dtype: torch.dtype = torch.bfloat16, shapes: V4Shapes = V4_FLASH) -> list[TilePlan]:
    """Every Triton-Ascend launch V4-Flash makes, planned for ``generation``'s UB (imports the kernels, so Triton).

    Activations and pools in ``dtype``; mHC weights, ``post``/``comb`` and the compressor's
    position bias in fp32, as the model keeps them. Indexer candidates: every compressed
    entry of a full-length context.
    """
    from .triton_ascend_compressor import plan_compress_kv
    from .triton_ascend_indexer import plan_indexer_scores
    from .triton_ascend_mhc import plan_mhc_post, plan_mhc_pre

    ub = UNIFIED_BUFFERS[generation]
    s = shapes
    return [
        plan_mhc_pre(s.hc_mult, s.hidden, dtype, ub),
        plan_mhc_pre(s.hc_mult, s.hidden, dtype, ub, head=True),
        plan_mhc_post(s.hc_mult, s.hidden, dtype, ub),
        plan_indexer_scores(s.index_heads, s.index_head_dim, s.max_positions // s.csa_ratio, dtype, ub),
        plan_compress_kv(s.csa_ratio, s.head_dim, True, dtype, torch.float32, ub),
        plan_compress_kv(s.hca_ratio, s.head_dim, False, dtype, torch.float32, ub),
        plan_compress_kv(s.csa_ratio, s.index_head_dim, True, dtype, torch.float32, ub),
    ]


@dataclass(frozen=True)
class V41Shapes:
    """The DeepSeek-V4.1-Flash figures that size the tiles of the launches V4.1 adds (its text_config): the mixes
    and collapse it calls apart, mhc_post at its width, the candidate blocks and the Engram injection."""

    hidden: int = 5120
    hc_mult: int = 4
    candidate_block_size: int = 8
    #: compressed entries a decode token sees at the candidate source (ratio 1): 8192 blocks of 8
    context: int = 65536


V41_FLASH = V41Shapes()


def v41_flash_plans(generation: str, dtype: torch.dtype = torch.bfloat16, shapes: V41Shapes = V41_FLASH) -> list[TilePlan]:
    """Every Triton-Ascend launch V4.1-Flash adds to V4's, planned for ``generation``'s UB (imports the kernels).

    Streams in ``dtype``; indexer scores (the candidate blocks' input), ``pre`` and the Engram gate weight
    (``q_weight · k_weight``) in fp32, as the model has them.
    """
    from .triton_ascend_engram import plan_engram_inject
    from .triton_ascend_indexer import plan_candidate_keys, plan_candidate_select
    from .triton_ascend_mhc import plan_mhc_collapse, plan_mhc_post, plan_mhc_pre

    ub = UNIFIED_BUFFERS[generation]
    s = shapes
    blocks = -(-s.context // s.candidate_block_size)
    return [
        plan_mhc_pre(s.hc_mult, s.hidden, dtype, ub, collapse=False),
        plan_mhc_collapse(s.hc_mult, s.hidden, dtype, ub),
        plan_mhc_post(s.hc_mult, s.hidden, dtype, ub),
        plan_candidate_keys(blocks, s.candidate_block_size, torch.float32, ub),
        plan_candidate_select(blocks, s.candidate_block_size, ub),
        plan_engram_inject(s.hc_mult, s.hidden, dtype, torch.float32, ub),
    ]


#: the packed cache records of V4-Flash (UE8M0 or fp32 scales, as the checkpoint's ``scale_fmt``) and V4.1-Flash
#: (the engine's ``v4_formats`` / ``v41_formats`` at the releases' widths; the tests check they are equal)
V4_KV = KVFormat("v4.kv.fp8", 512, "e4m3", 64, "ue8m0", 64)
V4_KV_FP32 = KVFormat("v4.kv.fp8", 512, "e4m3", 64, "fp32", 64)
V4_INDEX = KVFormat("v4.index.fp4", 128, "e2m1", 32, "ue8m0")
V41_WINDOW = KVFormat("v41.window.fp8", 512, "e4m3", 32, "ue8m0")
V41_ENTRY = KVFormat("v41.entry.fp4", 512, "e2m1", 16, "e4m3")
V41_INDEX = KVFormat("v41.index.fp4", 128, "e2m1", 32, "ue8m0")
PACKED_FORMATS = (V4_KV, V4_KV_FP32, V4_INDEX, V41_WINDOW, V41_ENTRY, V41_INDEX)


def packed_cache_plans(generation: str, dtype: torch.dtype = torch.bfloat16, shapes: V4Shapes = V4_FLASH) -> list[TilePlan]:
    """Every Triton-Ascend launch a packed cache adds, planned for ``generation``'s UB (imports the kernels): packing
    and unpacking each format's rows of ``dtype``, the indexer over FP4 keys (V4's 64 heads of 128 over a
    full-length context's entries) and attention over V4's FP8 rows (both scale kinds); V4.1's two-format KV pools
    run the reference."""
    from .triton_ascend_indexer import plan_indexer_scores
    from .triton_ascend_kv_quant import plan_kv_pack, plan_kv_unpack
    from .triton_ascend_long_context import plan_entry_attention, plan_entry_keys

    ub = UNIFIED_BUFFERS[generation]
    s = shapes
    entries = s.max_positions // s.csa_ratio
    return [
        *(plan_kv_pack(fmt, dtype, ub) for fmt in PACKED_FORMATS if fmt.name != V41_INDEX.name),
        *(plan_kv_unpack(fmt, dtype, ub) for fmt in PACKED_FORMATS if fmt.name != V41_INDEX.name),
        plan_indexer_scores(s.index_heads, s.index_head_dim, entries, dtype, ub, packed=V4_INDEX),
        plan_entry_keys(s.index_heads, s.index_head_dim, entries, dtype, ub, packed=V4_INDEX),
        plan_entry_attention(s.head_dim, dtype, ub, packed=V4_KV),
        plan_entry_attention(s.head_dim, dtype, ub, packed=V4_KV_FP32),
    ]


def footprint_table(
    dtype: torch.dtype = torch.bfloat16,
    plans: Callable[[str, torch.dtype], list[TilePlan]] = v4_flash_plans,
    model: str = "V4-Flash",
) -> str:
    """A markdown table of each launch's UB footprint and blocks, one column per UB budget (for the docs):
    V4-Flash's by default, V4.1's additions with ``plans=v41_flash_plans, model="V4.1-Flash"``."""
    by_budget: dict[int, list[str]] = {}
    for gen, ub in UNIFIED_BUFFERS.items():
        by_budget.setdefault(ub.budget_bytes, []).append(gen)
    columns = [(gens, plans(gens[0], dtype)) for gens in by_budget.values()]
    head = " | ".join(f"{' / '.join(gens)} ({UNIFIED_BUFFERS[gens[0]].budget_bytes // KiB} KiB)" for gens, _ in columns)
    rows = [f"| kernel ({model} shape) | {head} |", "|---|" + "---|" * len(columns)]
    for i, plan in enumerate(columns[0][1]):
        cells = []
        for _, plans in columns:
            p = plans[i]
            cells.append(f"{p.bytes / KiB:.1f} KiB ({', '.join(f'{k}={v}' for k, v in p.blocks.items())})")
        rows.append(f"| `{plan.kernel}` ({plan.shape}) | " + " | ".join(cells) + " |")
    return "\n".join(rows)

"""The packed cache formats the op specs cover, and packed pools of random rows for the ops that read or write pools.

DeepSeek V4 stores its K=V rows (window and compressed entries alike) as FP8
records with 64-channel ue8m0 scales and the 64 rotary channels in bf16 (fp32
scales for checkpoints whose ``scale_fmt`` is float), and its rotated indexer
keys as FP4 records; V4.1 keeps a K=V source's compressed entries as FP4 records
with e4m3 scales and its window rows as FP8 records, both in one pool. The
``small_*`` formats are the narrow rows of one block a tiny model gets.
"""

from __future__ import annotations

import torch

from ..kv_format import KVFormat, pack_rows
from ..packed_pool import PackedPool, PackedRegion
from .shapes import HEAD_DIM, INDEX_HEAD_DIM, ROPE_DIM
from .spec import randn

V4_KV = KVFormat("v4.kv.fp8", HEAD_DIM, "e4m3", 64, "ue8m0", ROPE_DIM)
V4_KV_FP32 = KVFormat("v4.kv.fp8", HEAD_DIM, "e4m3", 64, "fp32", ROPE_DIM)
V4_INDEX = KVFormat("v4.index.fp4", INDEX_HEAD_DIM, "e2m1", 32, "ue8m0")
V41_WINDOW = KVFormat("v41.window.fp8", HEAD_DIM, "e4m3", 32, "ue8m0")
V41_ENTRY = KVFormat("v41.entry.fp4", HEAD_DIM, "e2m1", 16, "e4m3")
V41_INDEX = KVFormat("v41.index.fp4", INDEX_HEAD_DIM, "e2m1", 32, "ue8m0")
#: a tiny V4's K=V row: 24 channels in one block, 8 rotary, 3 bytes of padding
SMALL_KV = KVFormat("small.kv.fp8", 32, "e4m3", 24, "ue8m0", 8)
SMALL_KV_FP32 = KVFormat("small.kv.fp8", 32, "e4m3", 24, "fp32", 8)
SMALL_WINDOW = KVFormat("small.window.fp8", 32, "e4m3", 32, "ue8m0")
SMALL_ENTRY = KVFormat("small.entry.fp4", 32, "e2m1", 16, "e4m3")
SMALL_INDEX = KVFormat("small.index.fp4", 16, "e2m1", 16, "ue8m0")

#: case-name tag -> format, every format the specs pack and unpack
FORMATS: dict[str, KVFormat] = {
    "v4_kv_fp8_d512": V4_KV,
    "v4_kv_fp8_fp32_scales_d512": V4_KV_FP32,
    "v4_index_fp4_d128": V4_INDEX,
    "v41_window_fp8_d512": V41_WINDOW,
    "v41_entry_fp4_d512": V41_ENTRY,
    "v41_index_fp4_d128": V41_INDEX,
    "small_kv_fp8_d32_rot8": SMALL_KV,
    "small_kv_fp8_fp32_scales_d32": SMALL_KV_FP32,
    "small_window_fp8_d32": SMALL_WINDOW,
    "small_entry_fp4_d32": SMALL_ENTRY,
    "small_index_fp4_d16": SMALL_INDEX,
}


def packed_pool(g: torch.Generator, parts: list[tuple[int, KVFormat]]) -> PackedPool:
    """A pool of random unit rows packed into ``parts`` (rows, format) regions in order, read back in fp32."""
    regions, start = [], 0
    for rows, fmt in parts:
        regions.append(PackedRegion(start, pack_rows(randn(rows, fmt.dim, gen=g), fmt), fmt))
        start += rows
    return PackedPool(tuple(regions), parts[0][1].dim, torch.float32)


def pool_rows(pool: torch.Tensor | PackedPool) -> torch.Tensor:
    """Every row of ``pool`` in fp64 on the CPU (a packed pool's decoded exactly)."""
    if isinstance(pool, PackedPool):
        return pool.map(lambda t: t.detach().cpu()).take(torch.arange(pool.shape[0]), torch.float64)
    return pool.detach().to("cpu", torch.float64)


def pool_contents(pool: torch.Tensor | PackedPool) -> torch.Tensor | list[torch.Tensor]:
    """What a write into ``pool`` is judged by: its rows, or a packed pool's records (bytes, compared exactly)."""
    return pool.tensors() if isinstance(pool, PackedPool) else pool

"""DeepSeek-V4's cache kinds: one per attention type (sliding, CSA, HCA), each layer its own pools; and the
records V4 was trained with: window and compressed K=V rows as FP8 e4m3 codes of the non-rotary channels in
blocks of 64 (the checkpoint's scale format: ue8m0 powers of two, or fp32) with the rotary channels in bf16,
and indexer keys Walsh–Hadamard-rotated, then FP4 e2m1 in blocks of 32 with ue8m0 scales (queries alike)."""

from __future__ import annotations

import torch

from deepinfer_interfaces import KVFormat

from ..common.cache_spec import CacheFormats, CacheGeometry, LayerCacheSpec, fit_block
from ..common.config import CSA, ModelConfig


def v4_geometry(config: ModelConfig, block_size: int, step: int, max_len: int) -> CacheGeometry:
    """A window ring per layer; compressed layers add compressor state rings (CSA's overlapping two
    windows) and entry blocks, CSA's with indexer keys."""
    w = config.sliding_window
    specs: dict[str, LayerCacheSpec] = {}
    for lt in dict.fromkeys(config.layer_types):
        m = config.compress_ratio(lt)
        overlap = 2 if lt == CSA else 1
        specs[lt] = LayerCacheSpec(
            layer_type=lt,
            ratio=m,
            head_dim=config.head_dim,
            index_head_dim=config.index_head_dim if lt == CSA else 0,
            window_rows=min(w - 1 + step, max_len),
            state_rows=min(overlap * m - 1 + step, max_len) if m else 0,
            state_width=config.head_dim * overlap if m else 0,
            index_state_width=2 * config.index_head_dim if lt == CSA else 0,
            entries_per_block=block_size // m if m else 0,
            entry_kind=lt if m else None,
            state_keep=overlap * m - 1 if m else 0,
            overlap=lt == CSA,
        )
    return CacheGeometry(block_size, step, max_len, w, specs, tuple(config.layer_types))


def v4_formats(config: ModelConfig, scale_fmt: str) -> CacheFormats:
    """V4's trained records (see the module docstring; a row narrower than a block is one block);
    ``ValueError`` when the config's widths do not fit them."""
    nope = config.head_dim - config.qk_rope_head_dim
    block = fit_block(nope, 64, "the K=V row's non-rotary part")
    kv = KVFormat("v4.kv.fp8", config.head_dim, "e4m3", block, "ue8m0" if scale_fmt == "ue8m0" else "fp32", config.qk_rope_head_dim)
    d = config.index_head_dim
    if d & (d - 1):
        raise ValueError(f"index_head_dim {d} is not a power of two (the indexer's Walsh–Hadamard rotation)")
    index = KVFormat("v4.index.fp4", d, "e2m1", fit_block(d, 32, "the indexer key"), "ue8m0")
    return CacheFormats("fp8", window=kv, entry=kv, index=index, index_rotate=True, state_dtype=torch.float32)

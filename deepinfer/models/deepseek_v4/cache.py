"""DeepSeek-V4's cache kinds: one per attention type (sliding, CSA, HCA), each layer its own pools."""

from __future__ import annotations

from ..common.cache_spec import CacheGeometry, LayerCacheSpec
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

"""DeepSeek V4.1's cache kinds: per ratio a source kind and a reader kind.

The compressed KV and indexer keys of a ratio are owned by its KV source
layers and read by the layers after them, so a ratio has two kinds:
``shared{r}.source`` (window, compressor state, entries) and
``shared{r}.reader`` (its window only). A reader's window ring lives in its
source's pool, after the entries, so one gather reads both.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import KVFormat

from ..common.cache_spec import CacheFormats, CacheGeometry, LayerCacheSpec, fit_block
from ..common.config import SLIDING, ModelConfig
from .text_config import V41Layer, V41TextConfig


def v41_kind(layer: "V41Layer") -> str:
    """The cache kind of a V4.1 layer (a ``V41Layer``): sliding, or its ratio's source or reader kind."""
    m = layer.compress_ratio
    if not m:
        return SLIDING
    return f"shared{m}.source" if layer.owns_kv else f"shared{m}.reader"


def v41_geometry(config: ModelConfig, v: V41TextConfig, block_size: int, step: int, max_len: int) -> CacheGeometry:
    """DeepSeek V4.1: per ratio a source kind (window, compressor state unless the ratio is 1, entries and
    indexer keys) and a reader kind (window only, in its source's pool); ``v``: the text config's layer roles."""
    w = config.sliding_window
    window = min(w - 1 + step, max_len)
    specs: dict[str, LayerCacheSpec] = {}
    kinds: list[str] = []
    pools: list[tuple[int, int]] = []
    members: dict[int, int] = {}
    for layer in v.layers():
        m = layer.compress_ratio
        kind = v41_kind(layer)
        if not m:
            specs.setdefault(kind, LayerCacheSpec(kind, 0, config.head_dim, 0, window, 0, 0, 0, 0))
            pools.append((layer.index, 0))
        else:
            source = f"shared{m}.source"
            owner = layer.index if layer.owns_kv else layer.kv_source
            state = min(m - 1 + step, max_len) if m > 1 else 0
            specs.setdefault(kind, LayerCacheSpec(
                layer_type=kind,
                ratio=m,
                head_dim=config.head_dim,
                index_head_dim=config.index_head_dim if layer.owns_kv else 0,
                window_rows=window,
                state_rows=state if layer.owns_kv else 0,
                state_width=config.head_dim if layer.owns_kv and state else 0,
                index_state_width=0,
                entries_per_block=block_size // m if layer.owns_kv else 0,
                entry_kind=source,
                state_keep=m - 1 if layer.owns_kv and state else 0,
            ))
            pools.append((owner, members.get(owner, 0)))
            members[owner] = members.get(owner, 0) + 1
        kinds.append(kind)
    n_gram = v.engram_max_ngram_size if v.engram_layer_ids else 0
    history = min(n_gram - 1 + step, max_len) if n_gram else 0
    n = config.num_hidden_layers
    last_source = max(v.kv_source_layer_ids, default=n - 1)
    tail = tuple((n - layer) * (w - 1) + 1 for layer in range(last_source + 1, n))
    return CacheGeometry(block_size, step, max_len, w, specs, tuple(kinds), tuple(pools), True, history, n_gram, tail)


def v41_formats(config: ModelConfig) -> CacheFormats:
    """V4.1's trained records (see the module docstring; a row narrower than a block is one block);
    ``ValueError`` when the config's widths do not fit them."""
    d, i = config.head_dim, config.index_head_dim
    return CacheFormats(
        "fp8",
        window=KVFormat("v41.window.fp8", d, "e4m3", fit_block(d, 32, "the K=V row"), "ue8m0"),
        entry=KVFormat("v41.entry.fp4", d, "e2m1", fit_block(d, 16, "the K=V row"), "e4m3"),
        index=KVFormat("v41.index.fp4", i, "e2m1", fit_block(i, 32, "the indexer key"), "ue8m0"),
        state_dtype=torch.float32,
    )

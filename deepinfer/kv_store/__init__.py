"""The on-disk block store under the prefix cache (``kv_store=DIR``): see ``store.py`` and ``docs/kv-store.md``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .block_file import FORMAT_VERSION, PartShape
from .fingerprint import describe_model, fingerprint
from .policy import StorePolicy, store_policy
from .step_ops import BlockLoad, BlockSave, KVStoreOps
from .store import BlockWrite, KVStore, StoreStats, store_line

__all__ = [
    "BlockLoad", "BlockSave", "BlockWrite", "KVStore", "KVStoreOps", "PartShape", "StorePolicy", "StoreStats", "open_store", "store_line",
    "store_policy",
]


def open_store(
    config: Any, model_dir: Path, settings: dict[str, Any], dtype: torch.dtype, formats: dict[str, Any], parts: list[PartShape],
    block_size: int,
) -> KVStore | None:
    """The store ``config.kv_store`` names, for a cache of ``parts`` computed in ``dtype`` and stored as ``formats``
    (``CacheFormats.as_dict()``: what ``kv_cache_dtype`` resolved to); ``settings``: the kernel-relevant choices
    (backend, kernel set, ...) that enter the fingerprint."""
    description = {
        "format": FORMAT_VERSION,
        "model": describe_model(model_dir),
        "dtype": str(dtype),
        "kv_cache": formats,
        "block_size": block_size,
        "parts": [p.header() for p in parts],
        **settings,
    }
    return KVStore.open(config.kv_store, fingerprint(description), store_policy(config), parts, block_size)

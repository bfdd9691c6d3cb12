"""The contract's features, each tagged with the minor version that introduced it.

A minor version only adds: new ``Kernels`` ops, new argument types that existing
ops may receive, new ``Device`` methods with a default, new switches (modes) on
``Kernels`` that change what existing ops promise. A plugin that declares an
older minor version was written without them, so the engine never hands its own
code one of them: calls of a newer feature run the reference instead
(``versioned.py``), unless the plugin lists the feature in ``extra_features``
(it implements that newer feature itself). The conformance suite reports the
cases of such features ``not_applicable``, naming the version that enables them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from .packed_pool import PackedPool
from .version import major_minor


@dataclass(frozen=True)
class Feature:
    """One addition to the contract: the ops, argument type or device methods it brought, and since when."""

    name: str
    #: the version that introduced it, ``"MAJOR.MINOR"``
    since: str
    summary: str
    #: ``Kernels`` operations it added
    ops: tuple[str, ...] = ()
    #: a type that existing ops may receive since then, and those ops
    argument: type | None = None
    argument_ops: tuple[str, ...] = ()
    #: ``Device`` methods it added (each with a default that a device may keep)
    device_methods: tuple[str, ...] = ()
    #: a switch it added to ``Kernels`` (the instance attribute that reads it): while it is on, a kernel set
    #: written before it runs the reference for every op (its own code never promised what the mode asks)
    mode: str | None = None

    def newer_than(self, version: str) -> bool:
        """Whether a plugin declaring ``version`` was written before this feature."""
        return major_minor(self.since) > major_minor(version)

    def used_by(self, op: str, kwargs: dict[str, Any]) -> bool:
        """Whether calling ``op`` with ``kwargs`` uses this feature."""
        if op in self.ops:
            return True
        return self.argument is not None and op in self.argument_ops and holds(kwargs.values(), self.argument)


def holds(values: Iterable[Any], kind: type) -> bool:
    """Whether any of ``values`` (or of the lists and tuples among them) is a ``kind``."""
    return any(isinstance(v, kind) or (isinstance(v, (list, tuple)) and holds(v, kind)) for v in values)


#: the ops of contract 1.0 (the DeepSeek-V4 model, greedy and sampled decoding, grammar masks)
BASE = Feature(
    "base", "1.0", "the DeepSeek-V4 ops on plain tensors",
    ops=("apply_token_bitmask", "cache_write", "compress_kv", "hash_route", "indexer_scores", "mhc_head", "mhc_post",
         "mhc_pre", "moe_experts", "moe_route", "rms_norm", "rope", "sample", "sparse_attention", "swiglu", "topk_select"),
)

#: every feature after 1.0, oldest first
FEATURES: tuple[Feature, ...] = (
    Feature("quantized-weights", "1.1", "FP8 linears and FP4/FP8 experts on QuantizedWeight codes and scales",
            ops=("fp8_linear", "moe_experts_quantized")),
    Feature("speculative-sampling", "1.2", "target probabilities and rejection sampling for speculative decoding",
            ops=("sampling_probs", "rejection_sample")),
    Feature("v41-mixing", "1.3", "DeepSeek V4.1's mHC mix and collapse and two-level top-k candidates",
            ops=("mhc_mix", "mhc_collapse", "candidate_blocks")),
    Feature("engram", "1.3", "V4.1's Engram hashes, table lookups and gated injection",
            ops=("engram_hash", "engram_lookup", "engram_inject")),
    Feature("long-context", "1.4", "tiled indexer top-k and attention over per-sequence entry tables",
            ops=("indexer_topk", "indexer_block_topk", "entry_attention")),
    Feature("kv-quant", "1.5", "packing and unpacking KV cache records, the Hadamard rotation",
            ops=("kv_pack", "kv_unpack", "hadamard")),
    Feature("packed-pools", "1.5", "cache pools handed to the cache and attention ops as PackedPool records",
            argument=PackedPool,
            argument_ops=("cache_write", "sparse_attention", "entry_attention", "indexer_scores", "indexer_topk",
                          "indexer_block_topk")),
    Feature("vit-attention", "1.6", "the vision tower's attention within each image of a packed batch",
            ops=("vit_attention",)),
    Feature("map-host", "1.6", "Device.map_host: host memory the device's kernels read in place",
            device_methods=("map_host",)),
    Feature("batch-invariance", "1.7", "the dense linear op and the batch-invariant switch (set_batch_invariant)",
            ops=("linear",), mode="batch_invariant"),
)

BY_NAME: dict[str, Feature] = {f.name: f for f in FEATURES}


def newer_features(version: str, implemented: Iterable[str] = ()) -> tuple[Feature, ...]:
    """The features a plugin declaring ``version`` was written without, less those it lists as ``implemented``."""
    own = set(implemented)
    return tuple(f for f in FEATURES if f.newer_than(version) and f.name not in own)


def oldest_supported(current: str) -> str:
    """The oldest version honoured alongside ``current``: minor 0 of its major (docs/writing-a-backend.md)."""
    return f"{major_minor(current)[0]}.0"

"""The ``Kernels`` contract: one method per operation, each method its own reference.

A backend subclasses ``Kernels`` and overrides what it accelerates; whatever it
does not override runs this plain-PyTorch reference on the backend's tensors.
Each family of ops lives in its own module as a mixin; ``Kernels`` joins them.
"""

from __future__ import annotations

from typing import ClassVar

from ..version import INTERFACE_VERSION
from .attention import AttentionOps
from .base import acc_dtype, op
from .bitmask import BitmaskOps, unpack_bitmask
from .cache_ops import CacheOps
from .compressor import CompressorOps
from .engram import EngramOps
from .indexer import IndexerOps
from .kv_quant import KVQuantOps
from .invariant import INVARIANT_TILE_ROWS, lanewise, row_tiled_matmul
from .linear import LinearOps
from .mhc import MHCOps
from .moe import MoEOps
from .norm import NormOps
from .quant import QuantOps
from .rope import RopeOps
from .sampling import SamplingOps
from .vit import VitOps


class Kernels(
    NormOps,
    LinearOps,
    RopeOps,
    SamplingOps,
    BitmaskOps,
    CacheOps,
    AttentionOps,
    IndexerOps,
    CompressorOps,
    MHCOps,
    MoEOps,
    QuantOps,
    EngramOps,
    KVQuantOps,
    VitOps,
):
    """The reference kernel set, in plain PyTorch; its methods are the specification.

    Batch-invariant mode (the engine's deterministic mode): ``set_batch_invariant(True)``
    switches it on, ``batch_invariant`` reads it (off by default). While it is on,
    every op in ``batch_invariant_ops()`` (those whose ``@op`` marker names its
    ``rows``) gives, for each row, a result bitwise independent of the other rows
    in the call, of their number and order, and so of how a prompt was cut into
    chunks: fixed reduction splits, fixed tile shapes and order, no atomics whose
    order varies. Ops outside that set make no such promise. A kernel set that
    cannot keep the promise raises ``NotSupportedError`` (one line: why) from
    ``set_batch_invariant(True)``; a subclass that overrides it calls
    ``super().set_batch_invariant`` once it has switched its own paths.
    """

    #: entry-point name of this kernel set
    name: ClassVar[str] = "reference"
    #: the contract version this kernel set was written for; a plugin's set declares its own (never inherited
    #: from here), and features newer than it run the reference (``deepinfer_interfaces.versioned``)
    interface_version: ClassVar[str] = INTERFACE_VERSION
    #: names of features newer than ``interface_version`` that this set implements itself (``features.py``)
    extra_features: ClassVar[tuple[str, ...]] = ()
    #: the newer features the engine runs on the reference for this set (set on the class the registry builds)
    routed_features: ClassVar[tuple] = ()
    #: batch-invariant mode, off unless ``set_batch_invariant(True)`` turned it on
    batch_invariant: bool = False

    def set_batch_invariant(self, enabled: bool) -> None:
        """Turn batch-invariant mode on or off for this kernel set (see the class docstring).

        Raises ``NotSupportedError`` when this kernel set cannot be batch-invariant here.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_batch_invariant takes a bool, got {type(enabled).__name__}")
        self.batch_invariant = enabled

    @classmethod
    def batch_invariant_ops(cls) -> dict[str, tuple[str, ...]]:
        """The ops that promise batch invariance, each with the arguments whose leading dim is its row."""
        return {n: getattr(Kernels, n)._deepinfer_rows for n in cls.ops() if getattr(Kernels, n)._deepinfer_rows}

    @classmethod
    def ops(cls) -> list[str]:
        """Every operation of the contract."""
        return sorted(n for n in dir(Kernels) if getattr(getattr(Kernels, n), "_deepinfer_op", False))

    def for_conformance(self) -> "Kernels":
        """This kernel set as the conformance suite should measure it.

        A set that quietly runs the reference for ops it cannot run here (an NPU
        op without its runtime, say) returns a view that raises
        ``NotSupportedError`` for those instead, so they are reported
        ``not_supported`` rather than passing on the reference's numbers.
        """
        return self

    @classmethod
    def overrides(cls) -> list[str]:
        """The operations this kernel set implements itself rather than inheriting the reference."""
        return [n for n in cls.ops() if getattr(cls, n) is not getattr(Kernels, n)]


__all__ = ["INVARIANT_TILE_ROWS", "Kernels", "op", "acc_dtype", "lanewise", "row_tiled_matmul", "unpack_bitmask"]

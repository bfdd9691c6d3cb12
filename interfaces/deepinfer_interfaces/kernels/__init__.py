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
from .mhc import MHCOps
from .moe import MoEOps
from .norm import NormOps
from .quant import QuantOps
from .rope import RopeOps
from .sampling import SamplingOps
from .vit import VitOps


class Kernels(
    NormOps,
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
    """The reference kernel set, in plain PyTorch; its methods are the specification."""

    #: entry-point name of this kernel set
    name: ClassVar[str] = "reference"
    #: the contract version this kernel set was written against
    interface_version: ClassVar[str] = INTERFACE_VERSION

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


__all__ = ["Kernels", "op", "acc_dtype", "unpack_bitmask"]

"""The op specs of every ``Kernels`` operation, registered on import."""

from . import attention, bitmask, cache_ops, compressor, engram, indexer, kv_quant, linear, long_context, mhc, moe, norm, quant, rope, sampling, vit  # noqa: F401  (registration)
from .spec import FLOAT_DTYPES, RMS_LIMITS, SPECS, TOLERANCES, WARN_FACTOR, Case, OpSpec, Tolerance, register

__all__ = ["FLOAT_DTYPES", "RMS_LIMITS", "SPECS", "TOLERANCES", "WARN_FACTOR", "Case", "OpSpec", "Tolerance", "register"]

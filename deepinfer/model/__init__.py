"""The DeepSeek-V4 model: config, batch, cache interface and the network itself."""

from .batch import Batch
from .cache import COMPRESSOR, INDEXER, ContiguousCache, ModelCache
from .config import CSA, HCA, SLIDING, ModelConfig, RopeParams
from .model import DeepseekV4Model

__all__ = [
    "Batch",
    "COMPRESSOR",
    "INDEXER",
    "CSA",
    "HCA",
    "SLIDING",
    "ContiguousCache",
    "DeepseekV4Model",
    "ModelCache",
    "ModelConfig",
    "RopeParams",
]

"""The DeepSeek-V4 model: config, batch, cache and its geometry, step inputs and the network itself."""

from .batch import Batch
from .cache import COMPRESSOR, INDEXER, ContiguousCache, ModelCache
from .cache_spec import CacheGeometry, LayerCacheSpec, block_size_for
from .config import CSA, HCA, SLIDING, ModelConfig, RopeParams
from .inputs import ForwardInputs, StepLayout, StepShape
from .model import CausalLM, DeepseekV4Model

__all__ = [
    "Batch",
    "CacheGeometry",
    "ForwardInputs",
    "LayerCacheSpec",
    "StepLayout",
    "StepShape",
    "block_size_for",
    "COMPRESSOR",
    "INDEXER",
    "CSA",
    "HCA",
    "SLIDING",
    "ContiguousCache",
    "CausalLM",
    "DeepseekV4Model",
    "ModelCache",
    "ModelConfig",
    "RopeParams",
]

"""What every model family shares: the config base, batch, cache and its geometry, step inputs, the causal LM base."""

from .batch import Batch
from .cache import COMPRESSOR, INDEXER, ContiguousCache, ModelCache
from .cache_spec import CacheGeometry, LayerCacheSpec, block_size_for
from .config import CSA, HCA, SLIDING, ModelConfig, RopeParams
from .inputs import ForwardInputs, StepLayout, StepShape
from .causal_lm import CausalLM

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
    "ModelCache",
    "ModelConfig",
    "RopeParams",
]

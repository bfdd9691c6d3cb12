"""DeepInfer: offline inference for the DeepSeek-V4 family on pluggable hardware backends."""

from .config import EngineConfig, load_config
from .errors import ConfigError, DeepInferError, PluginError

__all__ = ["EngineConfig", "load_config", "ConfigError", "DeepInferError", "PluginError"]

"""DeepInfer: offline inference for the DeepSeek-V4 family on pluggable hardware backends."""

import os

# torch_npu's autoload hook breaks ``import torch`` where CANN is missing; the
# Ascend plugin imports torch_npu itself when it is selected.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from .config import EngineConfig, load_config  # noqa: E402
from .errors import ConfigError, DeepInferError, PluginError  # noqa: E402

_LAZY = {
    "LLM": ("llm", "LLM"),
    "SamplingParams": ("sampling_params", "SamplingParams"),
    "StructuredOutputsParams": ("sampling_params", "StructuredOutputsParams"),
    "RequestOutput": ("outputs", "RequestOutput"),
    "CompletionOutput": ("outputs", "CompletionOutput"),
    "Logprob": ("outputs", "Logprob"),
}


def __getattr__(name: str):
    """The public API, imported on first use so that ``deepinfer backends`` stays light."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f".{module}", __name__), attr)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")


__all__ = ["EngineConfig", "load_config", "ConfigError", "DeepInferError", "PluginError", *_LAZY]

"""Loading DeepSeek-V4 HF-layout checkpoint directories: config, weights, tokenizer."""

from .files import read_config, read_generation_config
from .tokenizer import load_tokenizer
from .names import model_name
from .weights import Checkpoint, load_weights, read_checkpoint

__all__ = [
    "read_config",
    "read_generation_config",
    "load_weights",
    "read_checkpoint",
    "Checkpoint",
    "model_name",
    "load_tokenizer",
]

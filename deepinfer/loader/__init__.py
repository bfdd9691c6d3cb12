"""Loading DeepSeek-V4 HF-layout checkpoint directories: config, weights, tokenizer."""

from .files import read_config, read_generation_config
from .fp4 import dequantize_fp4_blockwise, unpack_fp4
from .fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise
from .tokenizer import load_tokenizer
from .weights import load_weights

__all__ = [
    "read_config",
    "read_generation_config",
    "load_weights",
    "load_tokenizer",
    "quantize_fp8_blockwise",
    "dequantize_fp8_blockwise",
    "dequantize_fp4_blockwise",
    "unpack_fp4",
]

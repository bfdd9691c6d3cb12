"""DeepSeek V4.1 (``model_type: deepseek_v41``): shared compressed KV (CSA2), Engram n-gram memory, V4.1's mHC and draft,
images through its vision tower."""

from ..family import ModelFamily
from .config import DeepseekV41Config, V41ModelConfig
from .image_processor import image_reader
from .model import DeepseekV41Model

FAMILY = ModelFamily(
    name="DeepSeek-V4.1",
    model_types=("deepseek_v41",),
    architectures=("DeepseekV41ForConditionalGeneration", "DeepseekV41ForCausalLM"),
    config_class=V41ModelConfig,
    model_class=DeepseekV41Model,
    image_reader=image_reader,
)

__all__ = ["FAMILY", "DeepseekV41Config", "DeepseekV41Model", "V41ModelConfig"]

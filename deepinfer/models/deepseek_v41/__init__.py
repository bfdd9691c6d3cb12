"""DeepSeek V4.1 (``model_type: deepseek_v41``): shared compressed KV (CSA2), Engram n-gram memory, V4.1's mHC and draft."""

from ..family import ModelFamily
from .config import DeepseekV41Config, V41ModelConfig
from .model import DeepseekV41Model
from .prompt import check_prompt

FAMILY = ModelFamily(
    name="DeepSeek-V4.1",
    model_types=("deepseek_v41",),
    architectures=("DeepseekV41ForConditionalGeneration", "DeepseekV41ForCausalLM"),
    config_class=V41ModelConfig,
    model_class=DeepseekV41Model,
    check_prompt=check_prompt,
)

__all__ = ["FAMILY", "DeepseekV41Config", "DeepseekV41Model", "V41ModelConfig"]

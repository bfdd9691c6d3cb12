"""DeepSeek-V4 (``model_type: deepseek_v4``): sliding-window, CSA and HCA attention, hash-routed and biased top-k MoE, mHC."""

from ..family import ModelFamily
from .config import DeepseekV4Config
from .model import DeepseekV4Model
from .prompt import check_prompt

FAMILY = ModelFamily(
    name="DeepSeek-V4",
    model_types=("deepseek_v4",),
    architectures=("DeepseekV4ForCausalLM",),
    config_class=DeepseekV4Config,
    model_class=DeepseekV4Model,
    check_prompt=check_prompt,
    chat_encoder="deepseek_v4",
)

__all__ = ["FAMILY", "DeepseekV4Config", "DeepseekV4Model"]

"""DeepSeek V4.1 (``model_type: deepseek_v41``): its composite ``config.json``, validated, with per-layer roles.

The release ships an image-text-to-text config: ``text_config`` (the backbone,
the Engram tables and the DSpark draft), ``vision_config`` and a top-level
``quantization_config`` (FP8 e4m3 in 32 x 32 blocks, ``expert_dtype`` FP4).
Field names follow the released ``config.json``; where transformers' class
(``DeepseekV41TextConfig``) spells a field differently, both spellings are
accepted. ``DeepseekV41Config.to_model_config()`` gives the engine's
``V41ModelConfig``, which carries the text config for the per-layer roles.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ...errors import ConfigError
from ..common.cache_spec import CacheFormats, CacheGeometry
from ..common.config import SLIDING, ModelConfig, QuantizationConfig, fold_rope, invalid_config
from .cache import v41_formats, v41_geometry
from .text_config import V41TextConfig

MODEL_TYPE = "deepseek_v41"
#: V4.1's compressed layers: compressed KV and indexer keys shared from a source layer (CSA2)
SHARED = "shared_compressed_attention"
#: V4.1's draft fields that ``V41TextConfig`` validates and gives defaults for
DRAFT_FIELDS = (
    "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok",
)


class V41VisionConfig(BaseModel):
    """``vision_config``: the vision tower's shape (a ViT over ``patch_size`` patches with 2D rotary attention, its
    aligner merging ``downsample_ratio`` × ``downsample_ratio`` patches) and the image budget. ``num_hidden_layers``
    0 declares no tower."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    hidden_size: int = Field(1024, gt=0)
    intermediate_size: int = Field(2816, gt=0)
    num_hidden_layers: int = Field(32, ge=0)
    num_attention_heads: int = Field(16, gt=0)
    patch_size: int = Field(14, gt=0)
    downsample_ratio: int = Field(3, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    max_image_tokens: int = Field(1024, gt=0)
    min_pixels: int = Field(295936, gt=0)
    max_wh_ratio: int | None = None
    rms_norm_eps: float = Field(1e-6, gt=0)

    @model_validator(mode="after")
    def _heads_split_for_2d_rope(self) -> "V41VisionConfig":
        """Each head splits in two halves, each rotated by row and column angles in pairs: a multiple of 4 channels."""
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError(
                f"vision_config: hidden_size {self.hidden_size} over num_attention_heads {self.num_attention_heads} must give "
                "heads of a multiple of 4 channels (the 2D rotary embedding rotates each half in pairs)"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class DeepseekV41Config(BaseModel):
    """The composite ``config.json`` of a DeepSeek V4.1 checkpoint."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: Literal["deepseek_v41"] = MODEL_TYPE
    text_config: V41TextConfig
    vision_config: V41VisionConfig | None = None
    image_token_id: int | None = 129264
    #: None: an unquantized checkpoint
    quantization: QuantizationConfig | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "DeepseekV41Config":
        """Parse a raw ``config.json`` mapping; a bad value raises a one-line ``ConfigError`` naming the field."""
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(f"config.json has model_type {raw.get('model_type')!r}, not {MODEL_TYPE!r}")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("invalid DeepSeek-V4.1 config.json: text_config must be an object holding the backbone's fields")
        fields = dict(raw)
        try:
            # the release keeps quantization_config at the top; accept it inside text_config too
            quant_source = raw if "quantization_config" in raw else text
            fields["quantization"] = QuantizationConfig.parse(quant_source)
            return cls.model_validate(fields)
        except ValidationError as exc:
            raise invalid_config("DeepSeek-V4.1", exc) from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid DeepSeek-V4.1 config.json: {exc}") from None

    def to_model_config(self) -> "V41ModelConfig":
        """The engine's config: the backbone's shape, every MoE layer routed by biased top-k, and the text
        config itself for the per-layer roles (``V41ModelConfig.text``)."""
        t = self.text_config
        n = t.num_hidden_layers
        fields = {name: getattr(t, name) for name in _SHARED_FIELDS}
        main, compress = fold_rope(t.model_dump(include={"rope_theta", "compress_rope_theta", "rope_scaling", "rope_parameters",
                                                          "max_position_embeddings"}, exclude_none=True))
        try:
            return V41ModelConfig(
                **fields,
                model_type=MODEL_TYPE,
                layer_types=[SHARED if r else SLIDING for r in t.compress_ratios[:n]],
                mlp_layer_types=["moe"] * n,
                compress_rates={},
                rope_main=main,
                rope_compress=compress,
                quantization=self.quantization,
                renormalize_topk=t.norm_topk_prob and t.num_experts_per_tok > 1,
                router_image_bias=True,
                text=t,
                vision=self.vision_config if self.vision_config and self.vision_config.num_hidden_layers else None,
                image_token_id=self.image_token_id,
            )
        except ValidationError as exc:
            raise invalid_config("DeepSeek-V4.1", exc) from None


#: the fields ``ModelConfig`` takes from ``text_config`` unchanged
_SHARED_FIELDS = (
    "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "q_lora_rank", "qk_rope_head_dim", "num_experts_per_tok", "n_routed_experts", "n_shared_experts",
    "scoring_func", "norm_topk_prob", "routed_scaling_factor", "max_position_embeddings", "hc_mult", "hc_sinkhorn_iters",
    "hc_eps", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk",
    "num_nextn_predict_layers", "rms_norm_eps", "hidden_act", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "gate_temp",
)


class V41ModelConfig(ModelConfig):
    """A DeepSeek V4.1 backbone: every layer keeps a sliding window, compressed layers share their KV
    (``text`` holds the per-layer roles, the Engram tables and the draft). Its router renormalises the
    top-k weights only when ``norm_topk_prob`` is set and it picks more than one expert (transformers' V4
    router always does), and keeps ``gate.bias_vl`` for image positions."""

    LAYER_TYPES: ClassVar[tuple[str, ...]] = (SLIDING, SHARED)

    model_type: Literal["deepseek_v41"] = MODEL_TYPE
    text: V41TextConfig
    #: the vision tower (None: the checkpoint has none, or declares one of no layers)
    vision: V41VisionConfig | None = None
    #: the placeholder token of an image in a prompt (every position of an image's span holds it)
    image_token_id: int | None = None

    @model_validator(mode="after")
    def _image_token_in_vocabulary(self) -> "V41ModelConfig":
        """A tower needs a placeholder token the embedding holds (the span's positions carry it)."""
        if self.vision is not None and not (self.image_token_id is not None and 0 <= self.image_token_id < self.vocab_size):
            raise ValueError(
                f"image_token_id {self.image_token_id} must be a token id below vocab_size {self.vocab_size} when vision_config "
                "declares a vision tower"
            )
        return self

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "V41ModelConfig":
        return DeepseekV41Config.from_hf(raw).to_model_config()

    def compress_ratio(self, layer_type: str) -> int:
        """0 for sliding-window layers; shared layers have a ratio per layer (``layer_ratio``)."""
        if layer_type == SHARED:
            raise ValueError(f"{SHARED} layers have a ratio per layer; use layer_ratio(i)")
        return super().compress_ratio(layer_type)

    def layer_ratio(self, layer: int) -> int:
        return self.text.compress_ratios[layer]

    def cache_geometry(self, block_size: int, step: int, max_len: int) -> CacheGeometry:
        return v41_geometry(self, self.text, block_size, step, max_len)

    def packed_cache_formats(self, scale_fmt: str) -> CacheFormats:
        return v41_formats(self)

    def draft_fields(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        """``text_config`` with the validated text config's values (its defaults where the file is silent),
        declared by ``num_nextn_predict_layers`` > 0, which is then the stage count unless ``n_mtp_layers``
        / ``dspark_num_stages`` say otherwise."""
        text = self.text
        if not text.num_nextn_predict_layers:
            return None
        given = raw.get("text_config") or {}
        fields = {**given, **text.model_dump(include=set(DRAFT_FIELDS))}
        if given.get("dspark_num_stages") is None and given.get("n_mtp_layers") is None:
            fields["n_mtp_layers"] = text.num_nextn_predict_layers
        return fields

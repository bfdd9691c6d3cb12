"""DeepSeek-V4's configuration, parsed from a checkpoint's HF ``config.json``.

Both the current transformers layout (``layer_types``, ``mlp_layer_types``,
``compress_rates``, nested ``rope_parameters``) and the fields DeepSeek's
release ships (``compress_ratios`` with its trailing entry for the draft
layer, ``compress_rate_csa`` / ``compress_rate_hca``, ``num_hash_layers``,
``qk_rope_head_dim``, ``rope_scaling``, ``expert_dtype``,
``quantization_config``, ``topk_method``) are accepted and folded the way
transformers folds them; what the engine cannot honour is refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ValidationError

from ...errors import ConfigError
from ..common.cache_spec import CacheFormats, CacheGeometry
from ..common.config import CSA, HCA, SLIDING, ModelConfig, QuantizationConfig, fold_rope, invalid_config
from .cache import v4_formats, v4_geometry

MODEL_TYPE = "deepseek_v4"
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
_DEFAULT_NUM_HASH_LAYERS = 3


class DeepseekV4Config(ModelConfig):
    """A DeepSeek-V4 backbone: sliding-window, CSA and HCA layers, hash-routed then biased top-k MoE."""

    model_type: Literal["deepseek_v4"] = MODEL_TYPE

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "DeepseekV4Config":
        """Parse a raw ``config.json`` mapping; bad or unsupported values raise ``ConfigError``."""
        if raw.get("model_type") != MODEL_TYPE:
            raise ConfigError(
                f"config.json has model_type {raw.get('model_type')!r}, not {MODEL_TYPE!r}; "
                "load it with deepinfer.models.registry.load_model, which builds the model its model_type names"
            )
        try:
            return cls.model_validate(_fold_legacy(dict(raw)))
        except ValidationError as exc:
            raise invalid_config("DeepSeek-V4", exc) from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"invalid DeepSeek-V4 config.json: {exc}") from None

    def cache_geometry(self, block_size: int, step: int, max_len: int) -> CacheGeometry:
        return v4_geometry(self, block_size, step, max_len)

    def packed_cache_formats(self, scale_fmt: str) -> CacheFormats:
        return v4_formats(self, scale_fmt)

    def replay_extra(self) -> int:
        """The overlapping CSA compressor's two windows."""
        return 2 * self.compress_ratio(CSA) if CSA in self.layer_types else 0


def _fold_legacy(raw: dict[str, Any]) -> dict[str, Any]:
    """Fold legacy and flat fields into the fields ``ModelConfig`` declares."""
    for key in ("num_hidden_layers", "head_dim"):
        if key not in raw:
            raise ValueError(f"the field {key!r} is missing")
    n = raw["num_hidden_layers"]
    raw["quantization"] = QuantizationConfig.parse(raw)
    method = raw.get("topk_method")
    if method not in (None, "noaux_tc", "greedy"):
        raise ValueError(f"topk_method is {method!r}; DeepSeek-V4 routes by biased top-k ('noaux_tc') without expert groups")

    rates = dict(_DEFAULT_COMPRESS_RATES)
    rates.update(raw.get("compress_rates") or {})
    if raw.get("compress_rate_csa") is not None:
        rates[CSA] = raw["compress_rate_csa"]
    if raw.get("compress_rate_hca") is not None:
        rates[HCA] = raw["compress_rate_hca"]
    raw["compress_rates"] = rates

    if raw.get("layer_types") is None and raw.get("compress_ratios") is not None:
        by_ratio = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
        unknown = sorted({r for r in raw["compress_ratios"] if r not in by_ratio})
        if unknown:
            raise ValueError(f"compress_ratios holds {unknown}; each must be 0, {rates[CSA]} (CSA) or {rates[HCA]} (HCA)")
        raw["layer_types"] = [by_ratio[r] for r in raw["compress_ratios"]]
    if raw.get("layer_types") is None:
        raw["layer_types"] = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    raw["layer_types"] = list(raw["layer_types"])[:n]

    if raw.get("mlp_layer_types") is None:
        n_hash = raw.get("num_hash_layers")
        n_hash = _DEFAULT_NUM_HASH_LAYERS if n_hash is None else n_hash
        raw["mlp_layer_types"] = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    raw["mlp_layer_types"] = list(raw["mlp_layer_types"])[:n]

    head_dim = raw["head_dim"]
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        legacy = raw.get("qk_rope_head_dim")
        factor = legacy / head_dim if legacy is not None else 64 / 512
    raw["qk_rope_head_dim"] = int(head_dim * factor)

    raw["rope_main"], raw["rope_compress"] = fold_rope(raw)
    return raw



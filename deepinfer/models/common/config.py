"""What every model family's configuration holds: the backbone's shape, its rotary and quantization.

A family subclasses ``ModelConfig`` (its ``config.json`` parser, its cache
geometry, its replay length and draft fields); shared code reads only the
fields and methods declared here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ...errors import ConfigError

from .cache_spec import CacheFormats

if TYPE_CHECKING:
    from .cache_spec import CacheGeometry

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
MLP_LAYER_TYPES = ("hash_moe", "moe")
#: what ``kv_cache_dtype`` may be
KV_CACHE_DTYPES = ("auto", "fp8", "model")


class RopeParams(BaseModel):
    """One rotary embedding: the plain ``default`` one or YaRN."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rope_type: Literal["default", "yarn"] = "default"
    rope_theta: float
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None


class QuantizationConfig(BaseModel):
    """How the checkpoint's linears and experts are quantized (``quantization_config`` and ``expert_dtype``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    quant_method: Literal["fp8"] = "fp8"
    #: the code format of the FP8 linears
    fmt: Literal["e4m3"] = "e4m3"
    #: ``ue8m0``: scales are powers of two stored as exponent bytes; ``float32``: scales are floats
    scale_fmt: Literal["ue8m0", "float32"] = "float32"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: Literal["dynamic"] = "dynamic"
    #: routed experts: FP4 e2m1 in 1 x 32 blocks, FP8 like the linears, or unquantized
    expert_dtype: Literal["fp4", "fp8", "bf16"] = "fp8"

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> "QuantizationConfig | None":
        """The checkpoint's quantization, or None for an unquantized one; unknown values raise ``ValueError``."""
        quant = raw.get("quantization_config")
        expert_dtype = raw.get("expert_dtype")
        if quant is None:
            if expert_dtype not in (None, "bf16"):
                raise ValueError(f"expert_dtype is {expert_dtype!r} but there is no quantization_config to describe its scales")
            return None
        if not isinstance(quant, dict):
            raise ValueError("quantization_config must be an object")
        quant = dict(quant)
        checks = {
            "quant_method": ("fp8",),
            "fmt": ("e4m3",),
            "activation_scheme": ("dynamic",),
        }
        for key, allowed in checks.items():
            if key in quant and quant[key] not in allowed:
                raise ValueError(f"quantization_config.{key} is {quant[key]!r}; deepinfer reads {' or '.join(map(repr, allowed))} checkpoints")
        scale = quant.pop("scale_fmt", None)
        if scale not in (None, "ue8m0", "float32", "float", "fp32"):
            raise ValueError(f"quantization_config.scale_fmt is {scale!r}; deepinfer reads 'ue8m0' or float32 scales")
        quant["scale_fmt"] = "ue8m0" if scale == "ue8m0" else "float32"
        expert = quant.get("expert_dtype", expert_dtype)
        if expert is not None:
            if expert not in ("fp4", "fp8", "bf16"):
                raise ValueError(f"expert_dtype is {expert!r}; deepinfer reads 'fp4', 'fp8' or 'bf16' experts")
            quant["expert_dtype"] = expert
        block = quant.get("weight_block_size", (128, 128))
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size is {block!r}; give two positive integers such as [128, 128]")
        return cls.model_validate(quant)


class ModelConfig(BaseModel):
    """What shared code needs to know about a model's shape; each family's subclass parses its ``config.json``."""

    model_config = ConfigDict(extra="ignore", frozen=True, protected_namespaces=())

    #: the attention layer types a family's ``layer_types`` may hold
    LAYER_TYPES: ClassVar[tuple[str, ...]] = (SLIDING, CSA, HCA)

    model_type: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int = 1
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int = 1
    scoring_func: Literal["sqrtsoftplus", "sigmoid", "softmax"] = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float | None = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    rope_main: RopeParams
    rope_compress: RopeParams
    #: None: an unquantized checkpoint
    quantization: QuantizationConfig | None = None
    #: router logits are divided by it before scoring
    gate_temp: float = 1.0
    #: the routed experts' weights are renormalised to sum to one after top-k
    renormalize_topk: bool = True
    #: the router keeps a second correction bias for image positions (``gate.bias_vl``)
    router_image_bias: bool = False

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        n = self.num_hidden_layers
        for name, types, allowed in (("layer_types", self.layer_types, self.LAYER_TYPES), ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES)):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries but num_hidden_layers is {n}; give one per layer")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"{name} holds {bad}; each entry must be one of {list(allowed)}")
        if self.num_key_value_heads != 1:
            raise ValueError(f"num_key_value_heads is {self.num_key_value_heads}; DeepSeek-V4 attention has one shared K=V head")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act is {self.hidden_act!r}; DeepSeek-V4 experts use 'silu'")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups={self.o_groups} does not divide num_attention_heads*head_dim={self.num_attention_heads * self.head_dim}")
        if self.qk_rope_head_dim % 2 or not 0 <= self.qk_rope_head_dim <= self.head_dim:
            raise ValueError(f"the rope dim {self.qk_rope_head_dim} must be even and at most head_dim={self.head_dim}")
        for t in (CSA, HCA):
            if t in self.layer_types and self.compress_rates.get(t, 0) <= 0:
                raise ValueError(f"compress_rates[{t!r}] must be a positive integer")
        return self

    def compress_ratio(self, layer_type: str) -> int:
        """Source tokens per compressed entry of ``layer_type`` (0 for sliding-window layers)."""
        return 0 if layer_type == SLIDING else self.compress_rates[layer_type]

    def layer_ratio(self, layer: int) -> int:
        """Source tokens per compressed entry of layer ``layer`` (0: sliding window only)."""
        return self.compress_ratio(self.layer_types[layer])

    @property
    def ratios(self) -> list[int]:
        """The distinct compress ratios of the compressed layers, ascending."""
        return sorted({r for r in (self.layer_ratio(i) for i in range(self.num_hidden_layers)) if r})

    @property
    def num_hash_layers(self) -> int:
        return sum(t == "hash_moe" for t in self.mlp_layer_types)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a raw ``config.json`` mapping of this family; bad values raise ``ConfigError``."""
        raise NotImplementedError(f"{cls.__name__} parses no config.json; use deepinfer.models.registry.parse_config")

    def cache_geometry(self, block_size: int, step: int, max_len: int) -> "CacheGeometry":
        """The family's cache kinds and ring sizes for steps of ``step`` tokens (``CacheGeometry.build``)."""
        raise NotImplementedError(f"{type(self).__name__} describes no cache geometry")

    def packed_cache_formats(self, scale_fmt: str) -> CacheFormats:
        """The packed records the family was trained with (``scale_fmt``: the checkpoint's scale format, where the
        records follow it); raises ``ValueError`` naming what this config's shape cannot hold."""
        raise ValueError(f"model type {self.model_type!r} defines no packed cache records")

    def kv_cache_formats(self, kv_cache_dtype: str) -> CacheFormats:
        """How the cache stores rows for ``kv_cache_dtype``: ``model`` plain rows in the model dtype; ``fp8`` the
        family's packed records (FP8/FP4 codes with block scales); ``auto`` the records a quantized checkpoint was
        trained with (DeepSeek's releases carry ``quantization_config``), the model dtype for an unquantized one
        or one whose shape the records do not fit."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}; pick one of them")
        if kv_cache_dtype == "model" or (kv_cache_dtype == "auto" and self.quantization is None):
            return CacheFormats()
        try:
            return self.packed_cache_formats(self.quantization.scale_fmt if kv_cache_dtype == "auto" else "ue8m0")
        except ValueError as exc:
            if kv_cache_dtype == "auto":
                return CacheFormats()
            raise ConfigError(f"kv_cache_dtype 'fp8' cannot be honoured: {exc}; use kv_cache_dtype 'model'") from None

    def replay_length(self, mode: str) -> int:
        """Tokens recomputed before a prefix hit to rebuild the state that is not cached.

        The sliding-window K=V ring and the compressors' partial windows depend
        on every earlier token, so they are not content-addressed. ``bounded``
        replays the last W tokens (W = the sliding window), their attention
        seeing only the cached compressed context: fixed cost, approximate.
        ``exact`` replays the window's receptive field through all layers (W
        per layer, plus what the family's compressors keep), after which the
        rebuilt state equals a full prefill's.
        """
        w = self.sliding_window
        return w if mode == "bounded" else self.num_hidden_layers * w + self.replay_extra()

    def replay_extra(self) -> int:
        """Tokens an exact replay adds beyond W per layer for the compressors' partial windows."""
        return 0

    def draft_fields(self, raw: dict[str, Any]) -> dict[str, Any] | None:
        """``config.json``'s DSpark draft fields, or None when it declares no draft (V4's layout: the top
        level, declared by ``dspark_block_size``)."""
        return raw if "dspark_block_size" in raw else None


def fold_rope(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The main and compress rotary parameters from ``rope_parameters`` / ``rope_scaling`` / the thetas."""
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        scaling = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if raw.get("rope_scaling") and raw.get("rope_parameters"):
            scaling = {**raw["rope_scaling"], **scaling}
        main = {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
        compress = {**scaling, "rope_theta": raw.get("compress_rope_theta", 160000.0)}
        compress.setdefault("rope_type", compress.get("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    for params in (main, compress):
        params.setdefault("rope_type", params.get("type", "default"))
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
        if params["rope_type"] not in ("default", "yarn"):
            raise ValueError(f"rope_type {params['rope_type']!r} is not supported; DeepSeek-V4 uses 'default' or 'yarn'")
        if params["rope_type"] == "yarn":
            params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 1048576))
    return main, compress


def invalid_config(model: str, exc: ValidationError) -> ConfigError:
    """One line naming the first field a ``config.json`` of ``model`` gets wrong (or the rule it breaks)."""
    err = exc.errors()[0]
    if err["type"] == "value_error":
        detail = str(err["msg"]).removeprefix("Value error, ")
    else:
        detail = f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
    return ConfigError(f"invalid {model} config.json: {detail}")

"""Engine configuration: one pydantic model, read from keywords, flags, environment and a file.

Precedence, highest first: explicit keywords / CLI flags, ``DEEPINFER_<FIELD>``
environment variables, the config file (``--config`` or ``DEEPINFER_CONFIG``,
YAML or JSON), the defaults below.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError

ENV_PREFIX = "DEEPINFER_"


class EngineConfig(BaseModel):
    """Everything that selects and shapes an engine instance."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = Field(None, description="HF-layout model directory; None means the bundled model")
    backend: str = Field("auto", description="backend plugin name, or 'auto'")
    kernels: str | None = Field(None, description="kernel-set plugin overriding the backend's own")
    interpret: bool = Field(False, description="run Triton kernels through Triton's CPU interpreter")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = Field(
        "auto", description="dtype of the unquantized weights and activations; auto: float32 on the host, bfloat16 on an "
        "accelerator; float64 (where the device has it): reference runs whose rounding decisions fp32 noise cannot flip"
    )
    quantization: Literal["auto", "dequantize"] = Field(
        "auto", description="auto: keep the checkpoint's FP8/FP4 weights quantized; dequantize: load every weight in dtype"
    )
    seed: int = 0
    max_model_len: int | None = Field(None, gt=0)
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(2048, gt=0)
    max_prefill_chunk: int = Field(512, gt=0, description="most tokens of one sequence computed in one step")
    kv_cache_memory: int | None = Field(None, gt=0, description="KV cache budget in bytes")
    kv_cache_memory_fraction: float = Field(0.5, gt=0, le=1, description="fraction of free device memory for the KV cache")
    kv_cache_dtype: Literal["auto", "fp8", "model"] = Field(
        "auto",
        description="auto: the KV rounding and packing the checkpoint was trained with (the model dtype when it has none); "
        "fp8: packed FP8/FP4 records with block scales; model: plain rows in the model dtype",
    )
    engram_tables: Literal["auto", "mapped", "host", "device"] = Field(
        "auto", description="where DeepSeek V4.1's Engram tables live: mapped (the checkpoint's files; eager decoding on "
        "an accelerator), host (host memory the device reads in place, inside decode graphs), device (copied onto it); "
        "auto: mapped on the CPU, else host where the device can, else device where they fit, else mapped"
    )
    max_n: int | None = Field(None, gt=0, description="most completions one request may ask for (n, best_of); None: max_num_seqs")
    max_logprobs: int = Field(20, ge=0, description="most top log-probabilities per position a request may ask for (logprobs, top_logprobs, prompt_logprobs)")
    block_size: int = Field(16, gt=0)
    enable_prefix_caching: bool = True
    swa_replay: Literal["bounded", "exact"] = Field(
        "bounded", description="after a prefix hit, bounded: replay the last sliding window (approximate, fixed cost); exact: "
        "replay its receptive field through every layer, so the state equals a full prefill's (default under deterministic)"
    )
    deterministic: bool = Field(
        False, description="a request's tokens and logprobs depend on its prompt, parameters and seed alone: batch-invariant "
        "kernels, exact prefix replay; not its neighbours, the load, chunking, speculation, preemption, EP or PD"
    )
    prefill_fast_path: bool = Field(
        True, description="a prompt's layers past the last KV-sharing one (DeepSeek V4.1) compute only its last windows"
    )
    overlap_scheduling: bool | None = Field(
        None, description="schedule the next step while the device runs this one; None: on where the device runs asynchronously"
    )
    enforce_eager: bool | None = Field(
        None, description="True: never capture graphs; False: capture decode graphs; None: the device's default"
    )
    graph_capture_sizes: list[int] | None = Field(
        None, description="decode batch sizes captured as graphs (default 1, 2, 4, 8, 16, 24, ... up to max_num_seqs)"
    )
    expert_parallel_size: int = Field(1, gt=0, description="ranks the routed experts are spread over (one device each)")
    num_redundant_experts: int = Field(0, ge=0, description="extra physical expert slots per layer for replicas of hot experts")
    eplb_interval: int = Field(0, ge=0, description="steps between expert re-placements from measured load (0: never)")
    eplb_window: int = Field(64, gt=0, description="steps of load the balancer plans from")
    ep_timeout_s: float = Field(30.0, gt=0, description="seconds a rank waits in a collective before the group is declared failed")
    speculative_method: Literal["auto", "dspark"] | None = Field(
        "auto", description="dspark: draft with the checkpoint's DSpark stages and verify; None: never; auto: dspark when the checkpoint has them"
    )
    speculative_policy: Literal["all", "threshold", "adaptive"] = Field(
        "adaptive", description="which drafted tokens a step verifies: all, those with survival >= speculative_threshold, or as many as raise expected goodput"
    )
    speculative_threshold: float = Field(0.5, ge=0, le=1, description="least survival probability a drafted token needs under the threshold policy")
    num_speculative_tokens: int | None = Field(None, gt=0, description="most drafted tokens verified per request and step (default: the draft's block size)")
    kv_store: str | None = Field(
        None, description="directory (local, or a shared mount such as 3FS or NFS) keeping committed KV blocks across engines and restarts"
    )
    kv_store_retention: dict[str, str | float] = Field(
        default_factory=lambda: {"default": "7d"},
        description="retention classes of the KV store: class -> how long an unused block is kept (e.g. {'chat': '7d', 'agent': '3d'})",
    )
    kv_store_capacity: dict[str, str | int] | str | int | None = Field(
        None, description="bytes each class may hold (one size for all, or class -> size, e.g. '80GB'); past it the least recently used go"
    )
    kv_store_default_class: str | None = Field(None, description="class of requests without cache_class (None: the first retention class)")
    max_images_per_prompt: int = Field(16, ge=0, description="most images one prompt may carry (0: none)")
    max_image_bytes: int = Field(20 << 20, gt=0, description="largest encoded image accepted, in bytes (a data URI's payload, a file, a download)")
    max_image_pixels: int = Field(
        64 << 20, gt=0, description="largest decoded image accepted, width x height in pixels (checked from the header, before decoding)"
    )
    allow_remote_images: bool = Field(False, description="fetch http(s) image URLs; off: images come as data URIs, local files, bytes or PIL images")
    image_fetch_timeout_s: float = Field(10.0, gt=0, description="seconds one remote image fetch may take (with allow_remote_images)")

    @model_validator(mode="before")
    @classmethod
    def _deterministic_replay(cls, data: Any) -> Any:
        """Deterministic mode replays prefix hits exactly (a bounded replay's state differs from a full prefill's)
        and keeps its expert placement (a re-placement follows the load of other requests)."""
        if not isinstance(data, dict) or not data.get("deterministic"):
            return data
        if data.get("swa_replay", "exact") != "exact":
            raise ValueError(f"deterministic mode needs swa_replay='exact' (got {data['swa_replay']!r}): a bounded replay after a "
                             "prefix hit is approximate; drop swa_replay or set it to exact")
        if int(data.get("eplb_interval") or 0) > 0:
            raise ValueError(f"deterministic mode cannot re-place experts from measured load (eplb_interval={data['eplb_interval']}): "
                             "the other requests' load would decide which ranks sum a token's experts; set eplb_interval=0")
        return {**data, "swa_replay": "exact"}

    @field_validator("speculative_method", mode="before")
    @classmethod
    def _none_spelled_out(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.lower() in ("none", "off", "") else v

    @field_validator("graph_capture_sizes")
    @classmethod
    def _positive_sizes(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(s <= 0 for s in v)):
            raise ValueError("give at least one size, every size > 0")
        return v

    @model_validator(mode="after")
    def _store_policy(self) -> "EngineConfig":
        from .kv_store.policy import store_policy

        store_policy(self)
        return self

    @model_validator(mode="after")
    def _sizes_fit(self) -> "EngineConfig":
        if self.graph_capture_sizes is not None and max(self.graph_capture_sizes) > self.max_num_seqs:
            raise ValueError(f"graph_capture_sizes go up to {max(self.graph_capture_sizes)} but max_num_seqs is {self.max_num_seqs}; a step never has more sequences")
        return self


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist (pass an existing YAML or JSON file)")
    text = p.read_text()
    try:
        if p.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:
        raise ConfigError(f"config file {path} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}".splitlines()[0]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of field: value")
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """``DEEPINFER_<FIELD>`` values; a list field takes JSON (``[1, 2, 4]``) or commas (``1,2,4``)."""
    out: dict[str, Any] = {}
    for name, field in EngineConfig.model_fields.items():
        key = ENV_PREFIX + name.upper()
        if key not in env:
            continue
        value = env[key]
        if "dict" in str(field.annotation) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ConfigError(f"{key}={value!r} is not a JSON object; give JSON like {{\"chat\": \"7d\"}}") from None
        elif "list" in str(field.annotation):
            text = value.strip()
            try:
                value = json.loads(text) if text.startswith("[") else [v.strip() for v in text.split(",") if v.strip()]
            except json.JSONDecodeError:
                raise ConfigError(f"{key}={value!r} is not a list; give JSON like [1, 2, 4] or 1,2,4") from None
        out[name] = value
    return out


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    if not err["loc"]:  # a rule across fields
        return f"invalid config: {err['msg'].removeprefix('Value error, ')}"
    field = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        known = ", ".join(EngineConfig.model_fields)
        return f"invalid config: unknown field '{field}' (known fields: {known})"
    return f"invalid config: field '{field}' = {err.get('input')!r}: {err['msg'].removeprefix('Value error, ')}"


def load_config(
    overrides: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    env: Mapping[str, str] | None = None,
    explicit: bool = False,
) -> EngineConfig:
    """Build an ``EngineConfig`` from every source, highest precedence winning field by field.

    ``None`` in ``overrides`` means "not given" (a flag left out); with ``explicit`` (keywords a caller
    wrote) it is kept where it means something, for fields whose default is not None
    (``speculative_method=None``: no speculation)."""
    env = os.environ if env is None else env
    merged: dict[str, Any] = {}
    config_file = config_file or env.get(ENV_PREFIX + "CONFIG")
    if config_file:
        merged.update(_read_file(config_file))
    merged.update(_from_env(env))
    def given(k: str, v: Any) -> bool:
        field = EngineConfig.model_fields.get(k)
        return v is not None or (explicit and field is not None and field.default is not None)

    merged.update({k: v for k, v in (overrides or {}).items() if given(k, v)})
    try:
        return EngineConfig(**merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None

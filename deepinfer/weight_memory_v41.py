"""The memory a DeepSeek V4.1 checkpoint's weights will take, from ``config.json`` (and the index) alone.

There is no V4.1 model in the engine yet, so the tensors are listed from the
config in the release's layout (FP8 e4m3 linears in ``weight_block_size``
tiles, routed experts per ``expert_dtype``, FP8 Engram rows with one scale per
32 columns, BF16 elsewhere, F32 hyper-connections, sinks and router biases)
and counted in three parts, because they are placed differently: the backbone
(routed experts split by expert parallelism), the Engram n-gram tables (one
copy per rank, ~203 GB in the release) and the DSpark draft (its own, smaller
routed-expert bank, split the same way). The vision tower is not counted: the
engine serves text only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deepinfer_interfaces.quant import grid_shape

from .errors import ConfigError
from .loader.files import model_directory, read_config_json
from .model.config_v41 import DeepseekV41Config, V41TextConfig
from .model.linear import FP4_BLOCK, PLAIN, Storage
from .weight_memory import _stored_names, largest_rank_bytes

#: the three parts ``inspect`` reports for a V4.1 checkpoint
PARTS = ("backbone", "engram", "draft")


def stored_bytes(shape: tuple[int, ...], storage: Storage, dtype: torch.dtype) -> int:
    """Bytes of one weight of logical ``shape`` held as ``storage`` (codes plus block scales), or plain in ``dtype``."""
    numel = math.prod(shape)
    if not storage.quantized:
        return numel * dtype.itemsize
    codes = numel // 2 if storage.fmt == "e2m1" else numel
    return codes + math.prod(grid_shape(shape, storage.block)) * storage.scale_dtype.itemsize


@dataclass(frozen=True)
class PartMemory:
    """Bytes of one part of the checkpoint, and of its share on the fullest expert-parallel rank."""

    total_bytes: int
    per_rank_bytes: int
    #: the routed experts' share of ``total_bytes`` (what expert parallelism splits)
    routed_expert_bytes: int


@dataclass(frozen=True)
class V41WeightMemory:
    """Bytes of a V4.1 checkpoint's backbone, Engram tables and DSpark draft (the vision tower not counted)."""

    parts: dict[str, PartMemory]
    ep: int
    dtype: str
    quantization: str
    #: one routed expert (w1, w2, w3 with their scales) and one Engram table row
    bytes_per_routed_expert: int
    bytes_per_engram_row: int
    #: ``metadata.total_size`` of the index (every stored tensor, vision tower included), when there is one
    checkpoint_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return sum(p.total_bytes for p in self.parts.values())

    @property
    def per_rank_bytes(self) -> int:
        return sum(p.per_rank_bytes for p in self.parts.values())

    def as_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "per_rank_bytes": self.per_rank_bytes}


@dataclass
class _Tally:
    """Adds up tensor bytes per part, keeping routed experts apart."""

    dtype: torch.dtype
    fp8: Storage
    experts: Storage
    engram: Storage
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    expert_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))

    def add(self, part: str, shape: tuple[int, ...], storage: Storage = PLAIN) -> None:
        self.bytes[part] += stored_bytes(shape, storage, self.dtype)

    def f32(self, part: str, shape: tuple[int, ...]) -> None:
        self.bytes[part] += math.prod(shape) * 4

    def routed_expert(self, t: V41TextConfig) -> int:
        d, inter = t.hidden_size, t.moe_intermediate_size
        return sum(stored_bytes(s, self.experts, self.dtype) for s in ((inter, d), (d, inter), (inter, d)))


def _block(t: V41TextConfig, tally: _Tally, part: str, n_experts: int) -> None:
    """One transformer block's attention, hyper-connections, norms and MoE (routed experts counted apart)."""
    d, h, hd, q = t.hidden_size, t.num_attention_heads, t.head_dim, t.q_lora_rank
    groups, o_rank, inter, hc = t.o_groups, t.o_lora_rank, t.moe_intermediate_size, t.hc_mult
    fp8 = tally.fp8
    for shape in ((q, d), (h * hd, q), (hd, d), (groups * o_rank, h * hd // groups), (d, groups * o_rank)):
        tally.add(part, shape, fp8)  # wq_a, wq_b, wkv, wo_a, wo_b
    tally.add(part, (q,))  # q_norm
    tally.add(part, (hd,))  # kv_norm
    tally.f32(part, (h,))  # attn_sink
    mix = (2 + hc) * hc
    for _ in ("attn", "ffn"):
        tally.f32(part, (mix, hc * d))
        tally.f32(part, (mix,))
        tally.f32(part, (3,))
        tally.add(part, (d,))  # attn_norm, ffn_norm
    tally.add(part, (n_experts, d))  # router
    tally.f32(part, (2 * n_experts,))  # gate.bias and gate.bias_vl (text and image tokens)
    for _ in range(t.n_shared_experts):
        for shape in ((inter, d), (d, inter), (inter, d)):
            tally.add(part, shape, fp8)
    experts = n_experts * tally.routed_expert(t)
    tally.bytes[part] += experts
    tally.expert_bytes[part] += experts


def _count(config: DeepseekV41Config, dtype: torch.dtype, quantized: bool) -> _Tally:
    t, q = config.text_config, config.quantization
    if quantized and q is not None:
        scale = torch.uint8 if q.scale_fmt == "ue8m0" else torch.float32
        fp8 = Storage("e4m3", tuple(q.weight_block_size), scale)
        experts = {"fp4": Storage("e2m1", FP4_BLOCK, torch.uint8), "fp8": fp8, "bf16": PLAIN}[q.expert_dtype]
        engram = Storage("e4m3", (1, q.weight_block_size[1]), scale)
    else:
        fp8 = experts = engram = PLAIN
    tally = _Tally(dtype, fp8, experts, engram)
    d, hd, v = t.hidden_size, t.head_dim, t.vocab_size
    tally.add("backbone", (v, d))  # embed
    if not t.tie_word_embeddings:
        tally.add("backbone", (v, d))  # head
    tally.add("backbone", (d,))  # final norm
    hash_cols = (t.engram_max_ngram_size - 1) * t.engram_n_heads
    for layer in t.layers():
        _block(t, tally, "backbone", t.n_routed_experts)
        if layer.owns_kv:  # the compressor and the indexer's key side
            tally.add("backbone", (hd, d))  # compressor.wkv
            if layer.compress_ratio > 1:
                tally.add("backbone", (hd, d))  # compressor.wgate: a ratio-1 compressor pools nothing
            tally.add("backbone", (hd,))  # compressor.norm
            tally.add("backbone", (t.index_head_dim, hd))  # indexer.wk
            tally.add("backbone", (t.index_head_dim,))  # indexer.k_norm
        if layer.runs_indexer:  # the indexer's query side
            tally.add("backbone", (t.index_n_heads * t.index_head_dim, t.q_lora_rank), fp8)
            tally.add("backbone", (t.index_n_heads, d))  # weights_proj
        if layer.engram_table is not None:
            tally.add("backbone", (d * (t.hc_mult + 1), hash_cols * t.engram_head_dim), fp8)  # engram.wkv
            tally.add("backbone", (t.hc_mult, d))  # engram.q_weight
            tally.add("backbone", (t.hc_mult, d))  # engram.k_weight
            tally.add("engram", (t.engram_num_embeddings[layer.engram_table], t.engram_head_dim), engram)
    stages = t.num_nextn_predict_layers
    if stages:
        for _ in range(stages):
            _block(t, tally, "draft", t.dspark_n_routed_experts)
        tally.add("draft", (d,))  # main_norm
        tally.add("draft", (d, d * len(t.dspark_target_layer_ids)), fp8)  # main_proj
        tally.add("draft", (d,))  # the last stage's norm
        if t.dspark_markov_rank:
            tally.add("draft", (v, t.dspark_markov_rank))  # markov_head.embed
            tally.add("draft", (v, t.dspark_markov_rank))  # markov_head.head
        tally.add("draft", (1, d + t.dspark_markov_rank))  # confidence_head
    return tally


def v41_weight_memory(
    model_dir: str | Path, ep: int = 1, dtype: torch.dtype = torch.bfloat16, quantization: str = "auto"
) -> V41WeightMemory:
    """Weight bytes of ``model_dir``'s V4.1 checkpoint held in ``dtype`` (quantized where ``quantization="auto"``)."""
    directory = model_directory(model_dir)
    config = DeepseekV41Config.from_hf(read_config_json(directory))
    if quantization not in ("auto", "dequantize"):
        raise ConfigError(f"quantization {quantization!r} is not one of 'auto', 'dequantize'")
    t = config.text_config
    if not 1 <= ep <= t.n_routed_experts:
        raise ConfigError(f"--ep {ep} must be between 1 and the model's {t.n_routed_experts} routed experts")
    tally = _count(config, dtype, quantization == "auto")
    experts = {"backbone": t.n_routed_experts, "engram": 0, "draft": t.dspark_n_routed_experts}
    parts = {}
    for part in PARTS:
        total, routed = tally.bytes[part], tally.expert_bytes[part]
        per_rank = largest_rank_bytes(total, routed, experts[part], ep) if routed else total
        parts[part] = PartMemory(total, per_rank, routed)
    row = stored_bytes((1, t.engram_head_dim), tally.engram, dtype)
    _, checkpoint_bytes = _stored_names(directory)
    return V41WeightMemory(
        parts, ep, str(dtype).removeprefix("torch."), quantization, tally.routed_expert(t), row, checkpoint_bytes
    )

"""DeepSeek V4.1's ``text_config``: the backbone, its shared-KV attention schedule, Engram tables and draft.

``config.py`` holds the composite ``config.json`` around it and the engine's ``V41ModelConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True)
class V41Layer:
    """What one backbone layer owns and whose caches it reads (CSA2's Full / Reindex / Reuse modes)."""

    index: int
    #: source tokens per compressed entry; 0: sliding window only
    compress_ratio: int
    #: the layer whose compressed KV and indexer keys this layer reads (itself when it owns them); None: none
    kv_source: int | None
    #: the layer whose top-k indices this layer reads (itself when it runs the indexer); None: none
    index_source: int | None
    #: "source": keeps the candidate blocks later index sources are confined to; "read": is so confined
    candidates: Literal["source", "read"] | None
    #: the row of ``engram_num_embeddings`` (and table) of this layer's Engram module; None: no Engram
    engram_table: int | None

    @property
    def owns_kv(self) -> bool:
        """Owns a compressor and publishes the shared compressed KV and indexer keys."""
        return self.kv_source == self.index

    @property
    def runs_indexer(self) -> bool:
        return self.index_source == self.index

    @property
    def mode(self) -> Literal["sliding", "full", "reindex", "reuse"]:
        """CSA2's name for the layer: sliding only, Full (owns KV and indexes), Reindex, or Reuse."""
        if self.compress_ratio == 0:
            return "sliding"
        if self.owns_kv:
            return "full"
        return "reindex" if self.runs_indexer else "reuse"


class V41TextConfig(BaseModel):
    """``text_config``: the backbone, its shared-KV attention schedule, the Engram tables and the DSpark draft."""

    model_config = ConfigDict(extra="ignore", frozen=True, populate_by_name=True)

    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    moe_intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = 1
    head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = 64
    q_lora_rank: int = Field(gt=0)
    o_lora_rank: int = Field(gt=0)
    o_groups: int = Field(gt=0)
    hidden_act: str = "silu"
    swiglu_limit: float | None = 10.0
    rms_norm_eps: float = 1e-20
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    # --- MoE: no hash-routed layers in V4.1; every layer routes by biased top-k
    n_routed_experts: int = Field(gt=0)
    n_shared_experts: int = Field(1, ge=0)
    num_experts_per_tok: int = Field(gt=0)
    scoring_func: Literal["sqrtsoftplus", "sigmoid", "softmax"] = "sqrtsoftplus"
    topk_method: Literal["noaux_tc", "greedy"] = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    gate_temp: float = Field(1.0, gt=0)
    # --- attention: every layer keeps a sliding window; compressed KV is shared (CSA2)
    sliding_window: int = Field(128, gt=0)
    compress_ratios: list[int]
    kv_source_layer_ids: list[int]
    index_source_layer_ids: list[int]
    index_n_heads: int = Field(32, gt=0)
    index_head_dim: int = Field(128, gt=0)
    index_topk: int = Field(512, gt=0)
    #: None: the last KV source (transformers' default); negative: no two-level top-k
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = Field(2048, gt=0)
    candidate_block_size: int = Field(8, gt=0)
    # --- mHC: hc_mult residual copies (no hc_head in V4.1)
    hc_mult: int = Field(4, gt=0)
    hc_sinkhorn_iters: int = Field(20, gt=0)
    hc_eps: float = 1e-6
    # --- Engram n-gram tables
    engram_layer_ids: list[int] = Field(default_factory=list)
    engram_num_embeddings: list[int] = Field(default_factory=list)
    engram_max_ngram_size: int = Field(4, ge=2)
    engram_vocab_size: int = Field(16000000, gt=0)
    engram_n_heads: int = Field(8, gt=0)
    engram_head_dim: int = Field(256, gt=0)
    #: the release's ``engram_pad_token_id``; transformers and DeepSeek's inference code say ``engram_pad_id``
    engram_pad_token_id: int = Field(2, validation_alias=AliasChoices("engram_pad_token_id", "engram_pad_id"))
    engram_compressed_vocab_size: int = Field(99092, gt=0)
    # --- DSpark draft (its own, smaller MoE)
    num_nextn_predict_layers: int = Field(3, ge=0)
    dspark_block_size: int = Field(5, gt=0)
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list[int] = Field(default_factory=list)
    dspark_markov_rank: int = Field(256, ge=0)
    dspark_n_routed_experts: int = Field(128, gt=0)
    dspark_num_experts_per_tok: int = Field(3, gt=0)
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1

    @model_validator(mode="after")
    def _check(self) -> "V41TextConfig":
        n, extra = self.num_hidden_layers, self.num_nextn_predict_layers
        if self.num_key_value_heads != 1:
            raise ValueError(f"text_config.num_key_value_heads is {self.num_key_value_heads}; DeepSeek V4.1 has one shared KV latent")
        if self.hidden_act != "silu":
            raise ValueError(f"text_config.hidden_act is {self.hidden_act!r}; DeepSeek V4.1 experts use 'silu'")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"text_config.o_groups={self.o_groups} does not divide num_attention_heads*head_dim={self.num_attention_heads * self.head_dim}"
            )
        if self.qk_rope_head_dim % 2 or not 0 <= self.qk_rope_head_dim <= self.head_dim:
            raise ValueError(f"text_config.qk_rope_head_dim={self.qk_rope_head_dim} must be even and at most head_dim={self.head_dim}")
        for experts, per_tok, name in (
            (self.n_routed_experts, self.num_experts_per_tok, "num_experts_per_tok"),
            (self.dspark_n_routed_experts, self.dspark_num_experts_per_tok, "dspark_num_experts_per_tok"),
        ):
            if per_tok > experts:
                raise ValueError(f"text_config.{name}={per_tok} is more than the {experts} routed experts it picks from")

        ratios = self.compress_ratios
        if len(ratios) not in range(n, n + extra + 1):
            raise ValueError(
                f"text_config.compress_ratios has {len(ratios)} entries; give one per layer: num_hidden_layers={n}, "
                f"optionally followed by one per draft layer (num_nextn_predict_layers={extra})"
            )
        if any(r < 0 for r in ratios):
            raise ValueError(f"text_config.compress_ratios holds {sorted({r for r in ratios if r < 0})}; ratios are 0 or positive")
        if any(ratios[n:]):
            raise ValueError(f"text_config.compress_ratios gives the draft layers {ratios[n:]}; DSpark draft layers are sliding-window only (0)")

        kv, idx = self.kv_source_layer_ids, self.index_source_layer_ids
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx), ("engram_layer_ids", self.engram_layer_ids)):
            if ids != sorted(set(ids)) or any(not 0 <= i < n for i in ids):
                raise ValueError(f"text_config.{name} is {ids}; give distinct ascending layer ids in [0, {n})")
        for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx)):
            flat = [i for i in ids if ratios[i] == 0]
            if flat:
                raise ValueError(f"text_config.{name} holds layers {flat} whose compress_ratios entry is 0; a source needs a compressed branch")
        for layer in range(n):
            if ratios[layer] == 0:
                continue
            owner = _last_at_or_before(kv, layer)
            if owner is None:
                raise ValueError(f"text_config.kv_source_layer_ids has no source at or before layer {layer}, whose compress_ratio is {ratios[layer]}")
            if ratios[owner] != ratios[layer]:
                raise ValueError(
                    f"text_config.compress_ratios: layer {layer} (ratio {ratios[layer]}) reads kv source layer {owner} (ratio {ratios[owner]}); "
                    "a layer reuses a cache of its own ratio"
                )
            if _last_at_or_before(idx, layer) is None:
                raise ValueError(f"text_config.index_source_layer_ids has no source at or before layer {layer}, whose compress_ratio is {ratios[layer]}")

        missing = [i for i in kv if i not in idx]
        if missing:
            raise ValueError(
                f"text_config.kv_source_layer_ids holds {missing}, which index_source_layer_ids {idx} lacks; "
                "a KV source computes the indexer keys its group scores against, so it runs the indexer too"
            )
        cand = self.candidate_source_layer_id
        if cand is not None and cand >= 0 and cand not in idx:
            raise ValueError(f"text_config.candidate_source_layer_id={cand} is not one of index_source_layer_ids {idx}")

        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError(
                f"text_config.engram_num_embeddings has {len(self.engram_num_embeddings)} entries but engram_layer_ids has "
                f"{len(self.engram_layer_ids)}; give one table row count per Engram layer"
            )
        if any(rows <= 0 for rows in self.engram_num_embeddings):
            raise ValueError(f"text_config.engram_num_embeddings is {self.engram_num_embeddings}; every Engram table needs rows")

        if extra:
            bad = [i for i in self.dspark_target_layer_ids if not 0 <= i < n]
            if not self.dspark_target_layer_ids or bad:
                raise ValueError(
                    f"text_config.dspark_target_layer_ids is {self.dspark_target_layer_ids}; the draft needs backbone layers in [0, {n}) to read"
                )
        return self

    @property
    def candidate_source(self) -> int | None:
        """The index source whose candidate blocks confine the later ones; None when two-level top-k is off."""
        cand = self.candidate_source_layer_id
        if cand is None:
            return self.kv_source_layer_ids[-1] if self.kv_source_layer_ids else None
        return cand if cand >= 0 else None

    def layers(self) -> list[V41Layer]:
        """Every backbone layer's role, derived from ``compress_ratios`` and the source lists."""
        cand = self.candidate_source
        engram = {layer: row for row, layer in enumerate(self.engram_layer_ids)}
        out = []
        for i in range(self.num_hidden_layers):
            ratio = self.compress_ratios[i]
            kv = _last_at_or_before(self.kv_source_layer_ids, i) if ratio else None
            idx = _last_at_or_before(self.index_source_layer_ids, i) if ratio else None
            role = None
            if cand is not None and idx == i:
                role = "source" if i == cand else "read" if i > cand else None
            out.append(V41Layer(i, ratio, kv, idx, role, engram.get(i)))
        return out


def _last_at_or_before(ids: list[int], layer: int) -> int | None:
    """The largest id in ascending ``ids`` that is at most ``layer``, or None."""
    found = None
    for i in ids:
        if i > layer:
            break
        found = i
    return found

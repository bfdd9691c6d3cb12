"""DSpark: the checkpoint's draft stages (``mtp.0`` .. ``mtp.{S-1}``) that propose a block of tokens in one pass.

Laid out as DeepSeek-V4-Flash-DSpark publishes it. The target's hidden states at
the layers ``dspark_target_layer_ids`` (each the mean of the layer's output
hyper-connection streams) are concatenated, projected (``mtp.0.main_proj``,
``[D, L·D]``) and normed (``mtp.0.main_norm``, ``[D]``) into one context vector
per committed position. Every stage turns those vectors into K=V rows at their
positions (its ``wkv``, ``kv_norm`` and RoPE) and keeps the last
``dspark_context_window`` of them in its ring.

One draft pass takes the last committed token followed by ``block_size − 1``
noise tokens (``dspark_noise_token_id``) at the next positions, embedded with
the target's embedding (nothing else enters the block), and runs the stages: V4
blocks with sliding-window attention only (no compressor, no indexer), a routed
MoE and mHC streams. Each block position attends to its ring and to every
position of the block (not causal within the block). The last stage collapses
the streams (``hc_head_*``), norms them and applies the target's LM head.
Position ``i`` proposes the token after position ``i``; tokens are chosen left to
right because the Markov head (``markov_w2 · markov_w1[previous token]``, rank
``dspark_markov_rank``) adds a bias from the previous token.

The confidence head scores, from each position's collapsed hidden state (before
the final norm) and ``markov_w1`` of its previous token, the chance that the
position's token survives verification given that the ones before it did. It
never sees the token it scores, so admitting a prefix by confidence cannot
depend on the token admitted. ``sigmoid(logit / T_i)`` with the optional
per-position temperatures ``dspark_confidence_temperatures`` (a calibration,
1 by default) is that chance; the running product is the survival probability.

Weights load as the checkpoint stores them (FP8 linears and FP4 routed experts
stay quantized, as the target's do). All compute goes through ``Kernels`` ops.

DeepSeek V4.1's draft (``deepseek_v41/draft.py``) keeps this layout and these heads but
builds its stages as V4.1 layers; its fields sit in ``text_config``, with its
own routed-expert count and top-k (``dspark_n_routed_experts``,
``dspark_num_experts_per_tok``) and ``num_nextn_predict_layers`` stages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from deepinfer_interfaces import Kernels

from ...errors import CheckpointError, ConfigError
from ...loader.block_scales import DEFAULT_BLOCK, FP4_DTYPES, FP8_DTYPES, block_for, dequantize
from .attention import grouped_output
from .config import SLIDING, ModelConfig
from .layer import DecoderLayer
from .linear import QuantPlan, linear, linear_param
from .params import ParamTree

#: one stage's tensor: (stage, name within the stage)
_STAGE_TENSOR = re.compile(r"^mtp\.(\d+)\.(.+)$")
#: a stage's kv norm under the decoder layer's name (the target's, as transformers names it)
_LAYER_KV_NORM = re.compile(r"^(mtp\.\d+\.attn\.)norm\.weight$")
DEFAULT_CONTEXT_WINDOW = 128
#: dtypes of parameters held plain (a quantized weight stored for one is dequantized)
PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SHOWN_NAMES = 3
#: why speculation cannot run on a checkpoint whose config.json declares no draft
NO_DRAFT = "config.json declares no DSpark draft (no dspark_* fields; for V4.1, num_nextn_predict_layers is 0)"


class DSparkConfig(BaseModel):
    """The draft's fields of config.json, under the names the engine reads.

    The stage count comes from ``dspark_num_stages`` or ``n_mtp_layers`` (the
    release's ``inference/config.json``), else from the ``mtp.{i}`` prefixes of
    the checkpoint (never from ``num_nextn_predict_layers``, which the release
    sets to 1 for its three stages); the context window from
    ``dspark_context_window`` or ``dspark_window_size``, else 128.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    #: None: not given by config.json and no checkpoint names to count
    dspark_num_stages: int | None = None
    dspark_block_size: int = 5
    dspark_target_layer_ids: list[int]
    dspark_noise_token_id: int
    dspark_markov_rank: int
    dspark_context_window: int = DEFAULT_CONTEXT_WINDOW
    #: per-position temperatures of the confidence logits (None: all 1), fitted on text the draft did not train on
    dspark_confidence_temperatures: list[float] | None = None
    #: the stages' routed experts and how many each token picks (None: the target's)
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any], model: ModelConfig, stored: Iterable[str] | None = None) -> "DSparkConfig | None":
        """The draft's config, or None when config.json declares no DSpark draft; ``stored``: the checkpoint's
        ``mtp.*`` tensor names, which give the stage count when config.json does not. ``raw`` is the whole
        config.json (a V4.1 one is composite: its draft's fields are read from ``text_config``)."""
        fields = model.draft_fields(raw)
        if fields is None:
            return None
        head = fields.get("dspark_markov_head_type", "vanilla")
        if head != "vanilla":
            raise ConfigError(f"dspark_markov_head_type is {head!r}; deepinfer runs the 'vanilla' Markov head only")
        try:
            cfg = cls.model_validate({**fields, **_resolved_fields(fields, stored)})
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ConfigError(f"invalid DSpark config: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        cfg._check(model)
        return cfg

    def _check(self, model: ModelConfig) -> None:
        bad = [i for i in self.dspark_target_layer_ids if not 0 <= i < model.num_hidden_layers]
        if bad or not self.dspark_target_layer_ids:
            raise ConfigError(
                f"dspark_target_layer_ids {self.dspark_target_layer_ids} must name layers in [0, {model.num_hidden_layers}); fix config.json"
            )
        if not 0 <= self.dspark_noise_token_id < model.vocab_size:
            raise ConfigError(f"dspark_noise_token_id {self.dspark_noise_token_id} is outside the vocabulary [0, {model.vocab_size})")
        stages = 1 if self.dspark_num_stages is None else self.dspark_num_stages
        if min(self.dspark_block_size, self.dspark_markov_rank, self.dspark_context_window, stages) < 1:
            raise ConfigError("dspark_block_size, the stage count, dspark_markov_rank and the context window must be positive")
        experts = model.n_routed_experts if self.dspark_n_routed_experts is None else self.dspark_n_routed_experts
        per_tok = model.num_experts_per_tok if self.dspark_num_experts_per_tok is None else self.dspark_num_experts_per_tok
        if not 0 < per_tok <= experts:
            raise ConfigError(
                f"dspark_num_experts_per_tok={per_tok} must be positive and at most the draft's {experts} routed experts; fix config.json"
            )
        temps = self.dspark_confidence_temperatures
        if temps is not None and (len(temps) != self.dspark_block_size or min(temps) <= 0):
            raise ConfigError(
                f"dspark_confidence_temperatures {temps} must hold {self.dspark_block_size} positive values, one per block position; "
                "refit them or remove the field"
            )


def _resolved_fields(raw: dict[str, Any], stored: Iterable[str] | None) -> dict[str, Any]:
    """The stage count and context window under the engine's names, from whichever spelling config.json uses."""
    given = {k: raw[k] for k in ("dspark_num_stages", "n_mtp_layers") if raw.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ConfigError(f"config.json gives two stage counts {given}; keep one")
    stages = next(iter(given.values()), None)
    if stages is None and stored is not None:
        stages = stage_count(stored)
    window = next((raw[k] for k in ("dspark_context_window", "dspark_window_size") if raw.get(k) is not None), DEFAULT_CONTEXT_WINDOW)
    return dict(dspark_num_stages=stages, dspark_context_window=window)


def stage_count(names: Iterable[str]) -> int:
    """How many stages ``mtp.0``, ``mtp.1``, ... in a row the tensor ``names`` hold."""
    found = {int(m.group(1)) for m in map(_STAGE_TENSOR.match, names) if m is not None}
    count = 0
    while count in found:
        count += 1
    return count


@dataclass
class Draft:
    """One pass's proposal for ``N`` sequences."""

    #: ``[N, γ]`` drafted token ids
    tokens: torch.Tensor
    #: ``[N, γ]`` draft probability of each drafted token
    token_probs: torch.Tensor
    #: ``[N, γ]`` probability that position ``i`` survives given that ``0..i−1`` did
    accept_probs: torch.Tensor
    #: ``[N, γ]`` probability that positions ``0..i`` all survive verification
    confidence: torch.Tensor
    #: ``[N, γ, V]`` the distribution each token was drawn from (one-hot for greedy rows); only when asked
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class _Header:
    """What ``QuantPlan.from_checkpoint`` reads of a stored tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def stage_config(config: ModelConfig, draft: DSparkConfig) -> ModelConfig:
    """A one-layer config whose layer is sliding-window attention with a routed MoE of the draft's expert
    count and top-k (the target's where the draft gives none)."""
    update: dict[str, Any] = dict(num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"])
    if draft.dspark_n_routed_experts is not None:
        update["n_routed_experts"] = draft.dspark_n_routed_experts
    if draft.dspark_num_experts_per_tok is not None:
        update["num_experts_per_tok"] = draft.dspark_num_experts_per_tok
    return config.model_copy(update=update)


def draft_plan(stored: dict[str, torch.Tensor], block: tuple[int, int]) -> QuantPlan:
    """The storage of the draft's weight roles, read off the stored ``mtp.*`` tensors as the target's plan is read
    off its layers (``main_proj`` is a role of its own)."""
    catalog = {}
    for name, t in stored.items():
        m = _STAGE_TENSOR.match(name)
        if m is not None:
            catalog[f"model.layers.{m.group(1)}.{m.group(2)}"] = _Header(name, t.dtype, tuple(t.shape))
    return QuantPlan.from_checkpoint(catalog, block)


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


def _is_codes(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES or t.dtype in FP4_DTYPES


def _dequantized_scales(params: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]) -> dict[str, str]:
    """Plain parameters whose stored tensor is quantized, each with the name of its stored block scale
    (dequantized on load, as the target's loader does where its plan holds a role plain)."""
    out = {}
    for name, p in params.items():
        scale = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
        t = stored.get(name)
        if t is not None and p.dtype in PLAIN_DTYPES and _is_codes(t) and scale in stored and scale not in params:
            out[name] = scale
    return out


class DSparkDraft(ParamTree):
    """The draft stages and heads; the embedding, LM head and main rotary are the target's.

    Parameters are named as the release names its tensors (``names.model_name``
    maps the other spellings onto them) and held as ``plan`` says: plain in the
    target's dtype, or FP8 / FP4 codes with block scales.
    """

    def __init__(self, target, config: DSparkConfig, plan: QuantPlan | None = None) -> None:
        super().__init__(target.device)
        if config.dspark_num_stages is None:
            raise ConfigError("the DSpark stage count is unknown: add n_mtp_layers to config.json or build the draft with from_target")
        c, mc = config, target.config
        plan = plan or QuantPlan()
        self.config, self.model_config, self.plan = c, mc, plan
        self.kernels: Kernels = target.kernels
        self.embed, self.head, self.rope = target.embed, target.head, target.rope_main
        self.dtype = target.dtype
        self.eps = mc.rms_norm_eps
        d, r = mc.hidden_size, c.dspark_markov_rank
        root = self.child("mtp", ParamTree(target.device))
        stage_cfg = stage_config(mc, c)
        self.stages = [self._stage(stage_cfg, plan) for _ in range(c.dspark_num_stages)]
        for i, stage in enumerate(self.stages):
            root.child(str(i), stage)
        first, last = self.stages[0], self.stages[-1]
        width = len(c.dspark_target_layer_ids) * d
        self.main_proj = linear_param(first, "main_proj", d, width, self.dtype, plan.storage("main_proj"))
        self.main_norm = first.param("main_norm.weight", (d,), torch.float32)
        self._head_collapse(last)
        self.norm = last.param("norm.weight", (d,), torch.float32)
        self.markov_w1 = last.param("markov_head.markov_w1.weight", (mc.vocab_size, r), self.dtype)
        self.markov_w2 = last.param("markov_head.markov_w2.weight", (mc.vocab_size, r), self.dtype)
        self.conf_w = last.param("confidence_head.proj.weight", (1, d + r), torch.float32)
        temps = c.dspark_confidence_temperatures or [1.0] * c.dspark_block_size
        #: ``[γ]`` the confidence logits' per-position temperatures
        self.confidence_temperature = torch.tensor(temps, dtype=torch.float32, device=target.device)

    def _stage(self, config: ModelConfig, plan: QuantPlan) -> ParamTree:
        """One stage: a V4 decoder layer of the one-layer stage ``config``."""
        return DecoderLayer(config, 0, self.dtype, self.device, plan)

    def _head_collapse(self, last: ParamTree) -> None:
        """The last stage's learned collapse of the streams (``hc_head_*``)."""
        n, d = self.model_config.hc_mult, self.model_config.hidden_size
        self.hc_fn = last.param("hc_head_fn", (n, n * d), torch.float32)
        self.hc_base = last.param("hc_head_base", (n,), torch.float32)
        self.hc_scale = last.param("hc_head_scale", (1,), torch.float32)

    @classmethod
    def from_target(cls, target, raw_config: dict[str, Any], quantization: str | None = None) -> "DSparkDraft":
        """Build the draft of a loaded target from the ``mtp.*`` tensors it kept aside.

        ``quantization="auto"`` keeps what the checkpoint stores quantized (FP8 linears, FP4 experts) quantized;
        ``"dequantize"`` holds every weight in the target's dtype; None does as the target did (``"auto"`` when
        it holds any weight quantized).
        """
        stored = {name: t for name, t in target.extra_tensors.items() if name.startswith("mtp.")}
        cfg = DSparkConfig.from_hf(raw_config, target.config, stored)
        if cfg is None:
            raise ConfigError(f"{NO_DRAFT}; run without speculative decoding")
        if cfg.dspark_num_stages == 0:
            raise CheckpointError("config.json declares a DSpark draft but the checkpoint has no mtp.0.* stage tensors; use a checkpoint with its draft stages")
        mode = quantization or ("auto" if target.plan.roles else "dequantize")
        if mode not in ("auto", "dequantize"):
            raise ConfigError(f"quantization {mode!r} is not one of 'auto', 'dequantize'")
        q = target.config.quantization
        block = tuple(q.weight_block_size) if q is not None else DEFAULT_BLOCK
        kind = type(target).draft_class if cls is DSparkDraft else cls
        if kind is None:
            raise ConfigError(f"{type(target).__name__} has no DSpark draft network; run without speculative decoding")
        draft = kind(target, cfg, draft_plan(stored, block) if mode == "auto" else QuantPlan())
        draft.load(stored, block)
        return draft

    # ----- loading -----

    def named_parameters(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The parameters under the release's names: a stage's kv norm is ``attn.kv_norm.weight`` (its decoder
        layer calls it ``attn.norm.weight``, as the target's do)."""
        return {_LAYER_KV_NORM.sub(r"\1kv_norm.weight", name): t for name, t in super().named_parameters(prefix).items()}

    def load(self, stored: dict[str, torch.Tensor], block: tuple[int, int] = DEFAULT_BLOCK) -> None:
        """Copy the stored ``mtp.*`` tensors (model names) into the parameters: codes and scales as stored where
        the parameter is quantized, dequantized where it is plain; every tensor checked first."""
        params = self.named_parameters()
        scales = _dequantized_scales(params, stored)
        missing = sorted(set(params) - set(stored))
        if missing:
            raise CheckpointError(
                f"the checkpoint lacks DSpark tensors {_names(missing)} ({len(missing)} in all); "
                "use a checkpoint with its complete mtp.* draft stages"
            )
        unexpected = sorted(set(stored) - set(params) - set(scales.values()))
        if unexpected:
            raise CheckpointError(
                f"checkpoint tensors {_names(unexpected)} ({len(unexpected)} in all) belong to no DSpark draft parameter; "
                "the mtp.* tensors do not match config.json's dspark_* fields"
            )
        steps = [(p, self._value_of(name, p, stored, scales.get(name), block)) for name, p in params.items()]
        with torch.no_grad():
            for p, value in steps:
                p.copy_(value())

    @staticmethod
    def _value_of(name: str, p: torch.Tensor, stored: dict[str, torch.Tensor], scale_name: str | None, block: tuple[int, int]):
        """A check of ``stored[name]`` against parameter ``p`` now, and the value to copy into ``p`` later."""
        t = stored[name]
        where = f"checkpoint tensor {name!r}"
        if scale_name is not None:
            logical = (*t.shape[:-1], 2 * t.shape[-1]) if t.dtype in FP4_DTYPES else tuple(t.shape)
            scale = stored[scale_name]
            tile = block_for(logical, tuple(scale.shape), block)
            if tuple(logical) != tuple(p.shape) or tile is None:
                raise CheckpointError(
                    f"{where} holds a {_shape(logical)} weight with {_shape(scale.shape)} block scales but the draft expects "
                    f"{_shape(p.shape)}; the mtp.* tensors do not match config.json"
                )
            return lambda: dequantize(t, scale, tile)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(f"{where} has shape {_shape(t.shape)} but the draft expects {_shape(p.shape)}; the mtp.* tensors do not match config.json")
        if p.dtype == torch.uint8 and t.element_size() == 1:
            return lambda: t.view(torch.uint8)  # codes or UE8M0 exponents, byte for byte
        if t.dtype == p.dtype or (t.dtype in PLAIN_DTYPES and p.dtype in PLAIN_DTYPES):
            return lambda: t
        raise CheckpointError(
            f"{where} is stored as {str(t.dtype).removeprefix('torch.')} but the draft holds it as "
            f"{str(p.dtype).removeprefix('torch.')}; store a quantized weight with its block-scale tensor, or unquantized"
        )

    # ----- context -----

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, L, D]`` target hidden states (one per target layer) → ``[T, D]`` context vectors."""
        k = self.kernels
        flat = hidden.reshape(hidden.shape[0], -1).to(self.dtype)
        return k.rms_norm(linear(k, flat, self.main_proj), self.main_norm, self.eps)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[S, T, head_dim]``: each stage's K=V rows of context vectors ``[T, D]`` at ``positions``."""
        k = self.kernels
        cos, sin = self.rope(positions)
        rows = [k.rope(k.rms_norm(linear(k, ctx, s.attn.wkv), s.attn.kv_norm, self.eps), cos, sin) for s in self.stages]
        return torch.stack(rows)

    # ----- one pass -----

    def _queries(self, attn, q_lat: torch.Tensor) -> torch.Tensor:
        """``[T, heads, head_dim]`` queries of the normed q latents ``[T, q_lora_rank]`` (V4 norms each head)."""
        q = linear(self.kernels, q_lat, attn.wq_b).view(q_lat.shape[0], attn.heads, attn.head_dim)
        return self.kernels.rms_norm(q, None, self.eps)

    def _attention(self, stage: ParamTree, x: torch.Tensor, cos, sin, ctx_kv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The stage's attention of block rows ``x`` over its context rows and the block."""
        k, a = self.kernels, stage.attn
        t = x.shape[0]
        q_in, kv_in = a.proj_in(k, x)
        q = k.rope(self._queries(a, k.rms_norm(q_in, a.q_norm, self.eps)), cos, sin)
        kv = k.rope(k.rms_norm(kv_in, a.kv_norm, self.eps), cos, sin)
        out = k.sparse_attention(q, torch.cat([ctx_kv, kv]), rows, a.sinks, a.head_dim**-0.5)
        out = k.rope(out, cos, sin, inverse=True)
        grouped = out.reshape(t, a.groups, a.heads * a.head_dim // a.groups)
        return linear(k, grouped_output(k, grouped, a.wo_a, a.groups), a.wo_b)

    def hidden(self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv: torch.Tensor, ring_rows: torch.Tensor) -> torch.Tensor:
        """``[N, γ, D]`` hidden states of the blocks, the streams collapsed (before the final norm).

        ``anchor_ids`` / ``anchor_pos`` ``[N]``: each sequence's last committed token
        and its position. ``ctx_kv`` ``[S, P, head_dim]`` holds every stage's context
        rows; ``ring_rows`` ``[N, W]`` names the rows (into ``P``, ``-1`` padding)
        each block may see.
        """
        c, mc = self.config, self.model_config
        g, n = c.dspark_block_size, anchor_ids.shape[0]
        dev = anchor_ids.device
        ids = torch.full((n, g), c.dspark_noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchor_ids
        pos = (anchor_pos[:, None] + torch.arange(g, device=dev)).reshape(-1)
        cos, sin = self.rope(pos)
        block = ctx_kv.shape[1] + torch.arange(n * g, device=dev).view(n, 1, g).expand(n, g, g)
        rows = torch.cat([ring_rows[:, None, :].expand(n, g, ring_rows.shape[1]), block], dim=2).reshape(n * g, -1)
        flat_ids = ids.reshape(-1)
        streams = self.embed[flat_ids][:, None, :].expand(-1, mc.hc_mult, -1).contiguous()
        return self._stages_forward(streams, flat_ids, cos, sin, ctx_kv, rows).view(n, g, -1)

    def _stages_forward(self, streams: torch.Tensor, ids: torch.Tensor, cos, sin, ctx_kv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The stages over the block's ``[T, hc_mult, D]`` streams, collapsed to ``[T, D]``: V4 mHC (each site
        collapses with its own ``pre``), then ``hc_head``."""
        k, mc = self.kernels, self.model_config
        for s, stage in enumerate(self.stages):
            x, post, comb = stage.hc_attn.pre(k, streams)
            y = self._attention(stage, k.rms_norm(x, stage.attn_norm, self.eps), cos, sin, ctx_kv[s], rows)
            streams = k.mhc_post(y, streams, post, comb)
            x, post, comb = stage.hc_ffn.pre(k, streams)
            y = stage.ffn(k, k.rms_norm(x, stage.ffn_norm, self.eps), ids)
            streams = k.mhc_post(y, streams, post, comb)
        return k.mhc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, mc.rms_norm_eps, mc.hc_eps)

    def logits(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """LM-head logits of ``hidden`` states ``[..., D]`` (normed here) plus the Markov bias of the previous tokens ``[...]``."""
        return self.head_logits(h) + self.markov_bias(prev_ids)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over ``hidden`` states ``[..., D]`` (normed here): what does not depend on the previous token."""
        return self.kernels.linear(self.kernels.rms_norm(h, self.norm, self.eps), self.head)

    def markov_bias(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """The Markov head's bias ``markov_w2 · markov_w1[previous token]`` over the vocabulary."""
        return self.kernels.linear(self.markov_w1[prev_ids], self.markov_w2)

    def accept_logit(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """The confidence head's fp32 logit that a position survives verification given that the earlier ones did,
        from its ``hidden`` state ``[..., D]`` and its previous token ``[...]`` (never from its own token)."""
        feats = torch.cat([h.float(), self.markov_w1[prev_ids].float()], dim=-1)
        return self.kernels.linear(feats, self.conf_w)[..., 0]

    def accept_probs(self, logit: torch.Tensor) -> torch.Tensor:
        """``[..., γ]`` calibrated survival chances of confidence logits ``[..., γ]``: ``sigmoid(logit / T_i)``."""
        return torch.sigmoid(logit / self.confidence_temperature)

    @torch.inference_mode()
    def draft(
        self,
        anchor_ids: torch.Tensor,
        anchor_pos: torch.Tensor,
        ctx_kv: torch.Tensor,
        ring_rows: torch.Tensor,
        temperature: float | torch.Tensor = 0.0,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
        keep_probs: bool = False,
    ) -> Draft:
        """Propose ``γ`` tokens per sequence, left to right through the Markov head.

        ``temperature`` is one value or one per sequence (``0``: greedy). Sampled rows race
        ``probability / noise``; ``noise`` ``[N, γ, V]`` of Exp(1) draws (each request's own) or, without
        it, draws from ``generator``. ``keep_probs`` also returns each position's sampling distribution,
        which rejection sampling needs."""
        k = self.kernels
        h = self.hidden(anchor_ids, anchor_pos, ctx_kv, ring_rows)
        n, g = h.shape[:2]
        dev = h.device
        temp = torch.as_tensor(temperature, dtype=torch.float32, device=dev).expand(n).contiguous()
        greedy = temp <= 0
        top_k = torch.zeros(n, dtype=torch.long, device=dev)
        top_p, min_p = torch.ones(n, device=dev), torch.zeros(n, device=dev)
        prevs = [anchor_ids]
        tokens, probs, dists = [], [], []
        sampled = bool((~greedy).any())
        head = self.head_logits(h)  # the LM head once for the whole block; only the Markov bias is left to right
        for i in range(g):
            logits = (head[:, i] + self.markov_bias(prevs[-1])).float()
            if not sampled:
                step_noise = torch.ones((), device=dev).expand_as(logits)
            elif noise is not None:
                step_noise = noise[:, i]
            else:
                step_noise = torch.empty_like(logits).exponential_(generator=generator)
            tok = k.sample(logits, temp, top_k, top_p, min_p, step_noise)
            scaled = torch.softmax(logits / torch.where(greedy, torch.ones_like(temp), temp)[:, None], dim=-1)
            probs.append(scaled.gather(-1, tok[:, None])[:, 0])
            if keep_probs:
                onehot = torch.zeros_like(scaled).scatter_(-1, tok[:, None], 1.0)
                dists.append(torch.where(greedy[:, None], onehot, scaled))
            tokens.append(tok)
            prevs.append(tok)
        accept = self.accept_probs(self.accept_logit(h, torch.stack(prevs[:-1], dim=1)))
        return Draft(
            torch.stack(tokens, dim=1), torch.stack(probs, dim=1), accept, torch.cumprod(accept, dim=1),
            torch.stack(dists, dim=1) if keep_probs else None,
        )


class DSparkRing:
    """Each sequence slot's last ``W`` context positions, written at ``position mod W``, in two forms.

    A committed position's context vector (``ctx``, ``[D]``, what ``DSparkDraft.context`` makes of the
    target's hidden states) is kept after every step the sequence runs, drafting or not: one projection and
    one write per step. Each stage's K=V rows of it (``kv``, what the draft pass reads) are derived only when
    the slot drafts (``stale`` names the rows whose K=V lags their context vector, ``convert`` fills them),
    so a sequence that paused drafting resumes with its whole window of context at the cost of converting
    the rows it missed. The host keeps both rows' positions, so finding stale rows never waits for the device.
    """

    def __init__(self, draft: DSparkDraft, num_slots: int) -> None:
        mc, window = draft.model_config, draft.config.dspark_context_window
        dev = draft.device
        self.window = window
        self.kv = torch.zeros(len(draft.stages), num_slots * window, mc.head_dim, dtype=draft.dtype, device=dev)
        #: the position whose K=V each row holds (-1: none), on the device (``rows`` reads it) and on the host
        self.positions = torch.full((num_slots * window,), -1, dtype=torch.long, device=dev)
        self.kv_pos = np.full(num_slots * window, -1, dtype=np.int64)
        self.ctx = torch.zeros(num_slots * window, mc.hidden_size, dtype=draft.dtype, device=dev)
        #: the position whose context vector each row holds (-1: none), on the host
        self.ctx_pos = np.full(num_slots * window, -1, dtype=np.int64)

    @staticmethod
    def bytes_per_slot(draft: DSparkDraft) -> int:
        """Device bytes one slot's ring takes: ``W`` context vectors, their K=V rows per stage and the rows'
        positions (the KV planner counts it)."""
        mc, window = draft.model_config, draft.config.dspark_context_window
        itemsize = torch.empty((), dtype=draft.dtype).element_size()
        rows = (len(draft.stages) * mc.head_dim + mc.hidden_size) * itemsize
        return window * (rows + torch.empty((), dtype=torch.long).element_size())

    def _rows(self, slot: int, positions: np.ndarray) -> np.ndarray:
        return slot * self.window + positions % self.window

    def write(self, slot: int, positions: torch.Tensor, kv: torch.Tensor) -> None:
        """Store one sequence's committed ``positions`` ``[T]`` (ascending) as K=V rows ``kv`` ``[S, T, head_dim]``
        (the last ``W`` are kept)."""
        positions, kv = positions[-self.window :], kv[:, -self.window :]
        pos = positions.cpu().numpy()
        rows = self._rows(slot, pos)
        self.kv[:, torch.from_numpy(rows).to(self.kv.device)] = kv.to(self.kv.dtype)
        self.positions[torch.from_numpy(rows).to(self.kv.device)] = positions.to(self.positions.device)
        self.kv_pos[rows] = pos
        self.ctx_pos[rows] = -1  # no context vector behind them: nothing to convert

    def keep(self, rows: np.ndarray, positions: np.ndarray, ctx: torch.Tensor) -> None:
        """Store context vectors ``ctx`` ``[T, D]`` of ``positions`` at ring ``rows`` (``slot · W + position mod W``;
        each row once)."""
        self.ctx[torch.from_numpy(rows).to(self.ctx.device)] = ctx.to(self.ctx.dtype)
        self.ctx_pos[rows] = positions

    def stale(self, slots: list[int], anchor_pos: np.ndarray) -> np.ndarray:
        """Rows of ``slots`` whose context vector is inside the window before its anchor (``[p − W, p)``) and
        whose K=V rows do not hold it yet."""
        rows = (np.asarray(slots, dtype=np.int64)[:, None] * self.window + np.arange(self.window)).reshape(-1)
        anchor = np.repeat(np.asarray(anchor_pos, dtype=np.int64), self.window)
        pos = self.ctx_pos[rows]
        lag = (pos >= 0) & (pos < anchor) & (pos >= anchor - self.window) & (pos != self.kv_pos[rows])
        return rows[lag]

    def convert(self, rows: np.ndarray, kv: torch.Tensor) -> None:
        """Fill ``rows``' K=V with ``kv`` ``[S, T, head_dim]`` made from their context vectors."""
        index = torch.from_numpy(rows).to(self.kv.device)
        self.kv[:, index] = kv.to(self.kv.dtype)
        pos = self.ctx_pos[rows]
        self.positions[index] = torch.from_numpy(pos).to(self.positions.device)
        self.kv_pos[rows] = pos

    def clear(self, slot: int) -> None:
        """Forget a slot's context (a new sequence takes it, or its state is recomputed)."""
        w = self.window
        self.positions[slot * w : (slot + 1) * w] = -1
        self.kv_pos[slot * w : (slot + 1) * w] = -1
        self.ctx_pos[slot * w : (slot + 1) * w] = -1

    def copy(self, src: int, dst: int) -> None:
        """Give slot ``dst`` the context of slot ``src`` (a parallel-sampling sibling starting as its copy)."""
        w = self.window
        s, d = slice(src * w, (src + 1) * w), slice(dst * w, (dst + 1) * w)
        self.kv[:, d] = self.kv[:, s]
        self.ctx[d] = self.ctx[s]
        self.positions[d] = self.positions[s]
        self.kv_pos[d] = self.kv_pos[s]
        self.ctx_pos[d] = self.ctx_pos[s]

    def rows(self, slots: list[int], anchor_pos: torch.Tensor) -> torch.Tensor:
        """``[N, W]`` ring rows each anchor may see (context positions in ``[p − W, p)``), ``-1`` elsewhere."""
        base = torch.tensor(slots, device=self.kv.device)[:, None] * self.window
        rows = base + torch.arange(self.window, device=self.kv.device)
        pos = self.positions[rows]
        ok = (pos >= 0) & (pos < anchor_pos[:, None]) & (pos >= anchor_pos[:, None] - self.window)
        return torch.where(ok, rows, torch.full_like(rows, -1))

"""DSpark: the checkpoint's draft stages (``mtp.0`` .. ``mtp.{S-1}``) that propose a block of tokens in one pass.

The target's hidden states at the layers ``dspark_target_layer_ids`` (each the
mean of the layer's output hyper-connection streams) are concatenated, normed
(``mtp.0.main_norm``) and projected (``mtp.0.main_proj``) into one context
vector per committed position. Every stage turns those vectors into K=V rows at
their positions and keeps the last ``dspark_context_window`` of them in its ring.

One draft pass takes the last committed token followed by ``block_size − 1``
noise tokens (``dspark_noise_token_id``) at the next positions, embeds them with
the target's embedding, adds the newest context vector (that of the position
before the anchor) to every block position, and runs the stages: V4 blocks with sliding-window
attention only (no compressor, no indexer), a routed MoE and mHC streams. Each
block position attends to its ring and to every position of the block (not
causal within the block). The last stage collapses the streams (``hc_head``),
norms them and applies the target's LM head. Position ``i`` proposes the token
after position ``i``; tokens are chosen left to right because the Markov head
(a rank-``dspark_markov_rank`` bigram) adds a bias from the previous token. The
confidence head scores, from each position's hidden state and the probability
of its drafted token, the chance that the token survives verification given
that the ones before it did; the running product is the survival probability.

All compute goes through ``Kernels`` ops; the tensors use the checkpoint's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from deepinfer_interfaces import Kernels

from ..errors import CheckpointError, ConfigError
from .config import SLIDING, ModelConfig
from .layer import DecoderLayer
from .params import ParamTree


class DSparkConfig(BaseModel):
    """The ``dspark_*`` fields of config.json."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    dspark_num_stages: int = 3
    dspark_block_size: int = 5
    dspark_target_layer_ids: list[int]
    dspark_noise_token_id: int
    dspark_markov_rank: int
    dspark_context_window: int = 128

    @classmethod
    def from_hf(cls, raw: dict[str, Any], model: ModelConfig) -> "DSparkConfig | None":
        """The draft's config, or None when config.json declares no DSpark draft."""
        if "dspark_block_size" not in raw:
            return None
        try:
            cfg = cls.model_validate(raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ConfigError(f"invalid DSpark config: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        bad = [i for i in cfg.dspark_target_layer_ids if not 0 <= i < model.num_hidden_layers]
        if bad or not cfg.dspark_target_layer_ids:
            raise ConfigError(
                f"dspark_target_layer_ids {cfg.dspark_target_layer_ids} must name layers in [0, {model.num_hidden_layers}); fix config.json"
            )
        if not 0 <= cfg.dspark_noise_token_id < model.vocab_size:
            raise ConfigError(f"dspark_noise_token_id {cfg.dspark_noise_token_id} is outside the vocabulary [0, {model.vocab_size})")
        if cfg.dspark_block_size < 1 or cfg.dspark_num_stages < 1 or cfg.dspark_markov_rank < 1 or cfg.dspark_context_window < 1:
            raise ConfigError("dspark_block_size, dspark_num_stages, dspark_markov_rank and dspark_context_window must be positive")
        return cfg


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


def _stage_config(config: ModelConfig) -> ModelConfig:
    """A one-layer config whose layer is sliding-window attention with a routed MoE."""
    return config.model_copy(update=dict(num_hidden_layers=1, layer_types=[SLIDING], mlp_layer_types=["moe"]))


class DSparkDraft(ParamTree):
    """The draft stages and heads; the embedding, LM head and main rotary are the target's."""

    def __init__(self, target, config: DSparkConfig) -> None:
        super().__init__(target.device)
        c, mc = config, target.config
        self.config, self.model_config = c, mc
        self.kernels: Kernels = target.kernels
        self.embed, self.head, self.rope = target.embed, target.head, target.rope_main
        self.dtype = target.dtype
        self.eps = mc.rms_norm_eps
        d, n = mc.hidden_size, mc.hc_mult
        root = self.child("mtp", ParamTree(target.device))
        stage_cfg = _stage_config(mc)
        self.stages = [DecoderLayer(stage_cfg, 0, self.dtype, target.device) for _ in range(c.dspark_num_stages)]
        for i, stage in enumerate(self.stages):
            root.child(str(i), stage)
        first, last = self.stages[0], self.stages[-1]
        width = len(c.dspark_target_layer_ids) * d
        self.main_norm = first.param("main_norm.weight", (width,), torch.float32)
        self.main_proj = first.param("main_proj.weight", (d, width), self.dtype)
        self.hc_fn = last.param("hc_head.hc_fn", (n, n * d), torch.float32)
        self.hc_base = last.param("hc_head.hc_base", (n,), torch.float32)
        self.hc_scale = last.param("hc_head.hc_scale", (1,), torch.float32)
        self.norm = last.param("norm.weight", (d,), torch.float32)
        r = c.dspark_markov_rank
        self.markov_embed = last.param("markov_head.embed.weight", (mc.vocab_size, r), self.dtype)
        self.markov_proj = last.param("markov_head.proj.weight", (mc.vocab_size, r), self.dtype)
        self.conf_w = last.param("confidence_head.proj.weight", (1, d + 1), torch.float32)
        self.conf_b = last.param("confidence_head.proj.bias", (1,), torch.float32)

    @classmethod
    def from_target(cls, target, raw_config: dict[str, Any]) -> "DSparkDraft":
        """Build the draft of a loaded target from the ``mtp.*`` tensors it kept aside."""
        cfg = DSparkConfig.from_hf(raw_config, target.config)
        if cfg is None:
            raise ConfigError("config.json has no dspark_* fields, so the checkpoint carries no DSpark draft; run without speculative decoding")
        draft = cls(target, cfg)
        params = draft.named_parameters()
        stored = target.extra_tensors
        missing = sorted(set(params) - set(stored))
        if missing:
            raise CheckpointError(f"the checkpoint lacks DSpark tensors {missing[:3]} ({len(missing)} in all); use a checkpoint with its mtp.* draft stages")
        with torch.no_grad():
            for name, p in params.items():
                t = stored[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise CheckpointError(f"checkpoint tensor {name!r} has shape {list(t.shape)} but the draft expects {list(p.shape)}")
                p.copy_(t.to(p.dtype))
        return draft

    # ----- context -----

    def context(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, L, D]`` target hidden states (one per target layer) → ``[T, D]`` context vectors."""
        k = self.kernels
        flat = hidden.reshape(hidden.shape[0], -1).to(self.dtype)
        return k.rms_norm(flat, self.main_norm, self.eps) @ self.main_proj.t()

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[S, T, head_dim]``: each stage's K=V rows of context vectors ``[T, D]`` at ``positions``."""
        k = self.kernels
        cos, sin = self.rope(positions)
        rows = []
        for stage in self.stages:
            a = stage.attn
            x = k.rms_norm(ctx, stage.attn_norm, self.eps)
            rows.append(k.rope(k.rms_norm(x @ a.wkv.t(), a.kv_norm, self.eps), cos, sin))
        return torch.stack(rows)

    # ----- one pass -----

    def _attention(self, stage: DecoderLayer, x: torch.Tensor, cos, sin, ctx_kv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        k, a = self.kernels, stage.attn
        t = x.shape[0]
        q_lat = k.rms_norm(x @ a.wq_a.t(), a.q_norm, self.eps)
        q = k.rms_norm((q_lat @ a.wq_b.t()).view(t, a.heads, a.head_dim), None, self.eps)
        q = k.rope(q, cos, sin)
        kv = k.rope(k.rms_norm(x @ a.wkv.t(), a.kv_norm, self.eps), cos, sin)
        out = k.sparse_attention(q, torch.cat([ctx_kv, kv]), rows, a.sinks, a.head_dim**-0.5)
        out = k.rope(out, cos, sin, inverse=True)
        per_group = a.heads * a.head_dim // a.groups
        w = a.wo_a.view(a.groups, -1, per_group)
        mixed = torch.einsum("tgi,gri->tgr", out.reshape(t, a.groups, per_group), w).reshape(t, a.wo_b.shape[1])
        return mixed @ a.wo_b.t()

    def hidden(
        self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv: torch.Tensor, ring_rows: torch.Tensor, last_ctx: torch.Tensor
    ) -> torch.Tensor:
        """``[N, γ, D]`` final hidden states of the blocks.

        ``anchor_ids`` / ``anchor_pos`` ``[N]``: each sequence's last committed token
        and its position. ``ctx_kv`` ``[S, P, head_dim]`` holds every stage's context
        rows; ``ring_rows`` ``[N, W]`` names the rows (into ``P``, ``-1`` padding)
        each block may see; ``last_ctx`` ``[N, D]`` is the context vector of the
        position before each anchor (zeros at the start of a sequence).
        """
        k, c, mc = self.kernels, self.config, self.model_config
        g, n = c.dspark_block_size, anchor_ids.shape[0]
        dev = anchor_ids.device
        ids = torch.full((n, g), c.dspark_noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchor_ids
        pos = (anchor_pos[:, None] + torch.arange(g, device=dev)).reshape(-1)
        cos, sin = self.rope(pos)
        block = ctx_kv.shape[1] + torch.arange(n * g, device=dev).view(n, 1, g).expand(n, g, g)
        rows = torch.cat([ring_rows[:, None, :].expand(n, g, ring_rows.shape[1]), block], dim=2).reshape(n * g, -1)
        flat_ids = ids.reshape(-1)
        x0 = (self.embed[ids] + last_ctx[:, None, :].to(self.embed.dtype)).reshape(n * g, -1)
        streams = x0[:, None, :].expand(-1, mc.hc_mult, -1).contiguous()
        for s, stage in enumerate(self.stages):
            x, post, comb = stage.hc_attn.pre(k, streams)
            y = self._attention(stage, k.rms_norm(x, stage.attn_norm, self.eps), cos, sin, ctx_kv[s], rows)
            streams = k.mhc_post(y, streams, post, comb)
            x, post, comb = stage.hc_ffn.pre(k, streams)
            y = stage.ffn(k, k.rms_norm(x, stage.ffn_norm, self.eps), flat_ids)
            streams = k.mhc_post(y, streams, post, comb)
        h = k.mhc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, mc.rms_norm_eps, mc.hc_eps)
        return k.rms_norm(h, self.norm, self.eps).view(n, g, -1)

    def logits(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """LM-head logits of hidden states ``[..., D]`` plus the Markov bias of the previous tokens ``[...]``."""
        return h @ self.head.t() + self.markov_embed[prev_ids] @ self.markov_proj.t()

    def accept_logit(self, h: torch.Tensor, token_prob: torch.Tensor) -> torch.Tensor:
        """The confidence head's logit of surviving verification, from ``h`` ``[..., D]`` and the drafted token's probability."""
        feats = torch.cat([h.float(), token_prob.float()[..., None]], dim=-1)
        return (feats @ self.conf_w.t() + self.conf_b)[..., 0]

    @torch.inference_mode()
    def draft(
        self,
        anchor_ids: torch.Tensor,
        anchor_pos: torch.Tensor,
        ctx_kv: torch.Tensor,
        ring_rows: torch.Tensor,
        last_ctx: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Draft:
        """Propose ``γ`` tokens per sequence, left to right through the Markov head (greedy at temperature 0)."""
        k = self.kernels
        h = self.hidden(anchor_ids, anchor_pos, ctx_kv, ring_rows, last_ctx)
        n, g = h.shape[:2]
        dev = h.device
        temp = torch.full((n,), float(temperature), device=dev)
        top_k = torch.zeros(n, dtype=torch.long, device=dev)
        top_p, min_p = torch.ones(n, device=dev), torch.zeros(n, device=dev)
        prev = anchor_ids
        tokens, probs = [], []
        for i in range(g):
            logits = self.logits(h[:, i], prev).float()
            noise = torch.empty_like(logits).exponential_(generator=generator) if temperature > 0 else torch.ones_like(logits)
            tok = k.sample(logits, temp, top_k, top_p, min_p, noise)
            scaled = logits / temperature if temperature > 0 else logits
            probs.append(torch.softmax(scaled, dim=-1).gather(-1, tok[:, None])[:, 0])
            tokens.append(tok)
            prev = tok
        token_probs = torch.stack(probs, dim=1)
        accept = torch.sigmoid(self.accept_logit(h, token_probs))
        return Draft(torch.stack(tokens, dim=1), token_probs, accept, torch.cumprod(accept, dim=1))


class DSparkRing:
    """Each sequence slot's last ``W`` context rows per stage, written at ``position mod W``,
    and its newest context vector."""

    def __init__(self, draft: DSparkDraft, num_slots: int) -> None:
        mc, window = draft.model_config, draft.config.dspark_context_window
        dev = draft.device
        self.window = window
        self.kv = torch.zeros(len(draft.stages), num_slots * window, mc.head_dim, dtype=draft.dtype, device=dev)
        self.positions = torch.full((num_slots * window,), -1, dtype=torch.long, device=dev)
        self.ctx = torch.zeros(num_slots, mc.hidden_size, dtype=draft.dtype, device=dev)

    def write(self, slot: int, positions: torch.Tensor, ctx: torch.Tensor, kv: torch.Tensor) -> None:
        """Store one sequence's committed ``positions`` ``[T]`` (ascending): their context vectors ``[T, D]``
        and every stage's rows ``kv`` ``[S, T, head_dim]`` (the last ``W`` are kept)."""
        self.ctx[slot] = ctx[-1].to(self.ctx.dtype)
        positions, kv = positions[-self.window :], kv[:, -self.window :]
        rows = slot * self.window + positions % self.window
        self.kv[:, rows] = kv.to(self.kv.dtype)
        self.positions[rows] = positions

    def last_ctx(self, slots: list[int]) -> torch.Tensor:
        """``[N, D]`` newest context vector of each slot."""
        return self.ctx[torch.tensor(slots, device=self.ctx.device)]

    def rows(self, slots: list[int], anchor_pos: torch.Tensor) -> torch.Tensor:
        """``[N, W]`` ring rows each anchor may see (context positions in ``[p − W, p)``), ``-1`` elsewhere."""
        base = torch.tensor(slots, device=self.kv.device)[:, None] * self.window
        rows = base + torch.arange(self.window, device=self.kv.device)
        pos = self.positions[rows]
        ok = (pos >= 0) & (pos < anchor_pos[:, None]) & (pos >= anchor_pos[:, None] - self.window)
        return torch.where(ok, rows, torch.full_like(rows, -1))

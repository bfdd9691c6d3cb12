"""DeepSeek V4.1's DSpark draft: V4's draft layout with V4.1 stages.

What differs from V4's draft (``dspark.py``), as V4.1's release runs it:

- each stage is a V4.1 layer (sliding-window attention only: ``compress_ratios``
  gives the draft layers 0; no Engram) whose routed MoE has the draft's own
  ``dspark_n_routed_experts`` experts and ``dspark_num_experts_per_tok`` top-k;
- queries are the low-rank projection without V4's per-head norm;
- mHC is V4.1's: every site mixes from its streams but collapses them with the
  previous site's ``pre`` (stream 0 before the first stage's attention), and
  the block's streams end collapsed with the last stage's FFN ``pre``; there is
  no ``hc_head``.

Everything else is shared: the context (``main_proj`` / ``main_norm`` over the
mean of each target layer's output streams), each stage's K=V ring, the
non-causal block of anchor and noise tokens, the Markov and confidence heads,
the tensor names under ``mtp.{i}.`` and FP8 / FP4 storage.
"""

from __future__ import annotations

import torch

from ..common.config import ModelConfig
from .text_config import V41Layer
from ..common.dspark import DSparkDraft
from .layer import DecoderLayerV41
from ..common.linear import QuantPlan, linear
from ..common.params import ParamTree

#: a draft stage's role: its own layer, sliding window only, no Engram table
STAGE_ROLE = V41Layer(index=0, compress_ratio=0, kv_source=None, index_source=None, candidates=None, engram_table=None)


class DSparkDraftV41(DSparkDraft):
    """The V4.1 draft stages and heads; the embedding, LM head and main rotary are the target's."""

    def _stage(self, config: ModelConfig, plan: QuantPlan) -> ParamTree:
        """One stage: a V4.1 decoder layer with the draft's MoE (``config`` already carries its expert count)."""
        return DecoderLayerV41(config, STAGE_ROLE, self.dtype, self.device, plan)

    def _head_collapse(self, last: ParamTree) -> None:
        """None: V4.1 collapses with the last stage's FFN ``pre`` instead of a learned ``hc_head``."""

    def _queries(self, attn, q_lat: torch.Tensor) -> torch.Tensor:
        """V4.1's queries: the projection of the normed q latents, no per-head norm."""
        return linear(self.kernels, q_lat, attn.wq_b).view(q_lat.shape[0], attn.heads, attn.head_dim)

    def _stages_forward(self, streams: torch.Tensor, ids: torch.Tensor, cos, sin, ctx_kv: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The stages over the block's ``[T, hc_mult, D]`` streams, each site collapsing with the previous
        site's ``pre``; ``[T, D]``: the streams collapsed with the last FFN ``pre``."""
        k = self.kernels
        pre = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0  # the first site reads stream 0
        for s, stage in enumerate(self.stages):
            attn_pre, post, comb = stage.hc_attn.mix(k, streams)
            x = k.rms_norm(k.mhc_collapse(streams, pre), stage.attn_norm, self.eps)
            streams = k.mhc_post(self._attention(stage, x, cos, sin, ctx_kv[s], rows), streams, post, comb)
            pre, post, comb = stage.hc_ffn.mix(k, streams)
            x = k.rms_norm(k.mhc_collapse(streams, attn_pre), stage.ffn_norm, self.eps)
            streams = k.mhc_post(stage.ffn(k, x, ids), streams, post, comb)
        return k.mhc_collapse(streams, pre)

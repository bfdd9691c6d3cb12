"""An auxiliary loss that teaches the CSA lightning indexer where attention looks.

The indexer's top-k choice has no gradient, so, as in DeepSeek's sparse-attention
training, its scores are fitted by KL divergence to the main attention's weight
on the compressed entries (summed over heads, detached). Forward hooks capture
the indexer scores and each CSA attention's probabilities during the normal
forward; the loss is over the entries the query could see (all causal entries
while ``dense``, else the indexer's own top-k).
"""

from __future__ import annotations

import torch


class IndexerDistillation:
    def __init__(self, model) -> None:
        self.model = model
        self.captured: list[dict[str, torch.Tensor]] = []
        self._handles = []
        self.csa = [layer.self_attn for layer in model.model.layers if layer.self_attn.layer_type == "compressed_sparse_attention"]
        for attn in self.csa:
            slot: dict[str, torch.Tensor] = {}
            self.captured.append(slot)
            indexer = attn.compressor.indexer
            self._handles.append(indexer.register_forward_pre_hook(self._detach_inputs))
            self._handles.append(indexer.scorer.register_forward_hook(self._keep(slot, "scores")))
            self._handles.append(attn.register_forward_hook(self._keep(slot, "probs")))

    @staticmethod
    def _detach_inputs(_module, args):
        """The indexer learns from its own loss only: its inputs carry no gradient back into the model."""
        return tuple(a.detach() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)

    @staticmethod
    def _keep(slot: dict, key: str):
        def hook(_module, _inputs, output) -> None:
            slot[key] = output[1] if isinstance(output, tuple) else output

        return hook

    def set_dense(self, dense: bool) -> None:
        """Dense: every causal compressed entry is attended (indexer warm-up); else the configured top-k."""
        topk = 1 << 30 if dense else self.model.config.index_topk
        for attn in self.csa:
            attn.compressor.indexer.index_topk = topk

    def loss(self, seq_len: int) -> torch.Tensor:
        """Mean KL(attention || indexer) over the CSA layers of the last forward."""
        total = torch.zeros(())
        ratio = self.model.config.compress_rates["compressed_sparse_attention"]
        for attn, slot in zip(self.csa, self.captured):
            scores, probs = slot["scores"], slot["probs"]  # [B, S, T], [B, H, S, S + T]
            num_entries = scores.shape[-1]
            target = probs[..., seq_len:].detach().sum(dim=1)  # [B, S, T]
            pos = torch.arange(seq_len)
            visible = torch.arange(num_entries)[None, :] < ((pos + 1) // ratio)[:, None]  # [S, T]
            k = min(attn.compressor.indexer.index_topk, num_entries)
            masked = scores.detach().masked_fill(~visible, float("-inf"))
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, masked.topk(k, dim=-1).indices, True)
            support = chosen & visible
            mass = (target * support).sum(-1, keepdim=True)
            rows = mass.squeeze(-1) > 1e-6
            if not rows.any():
                continue
            p = (target * support) / mass.clamp_min(1e-6)
            logq = torch.log_softmax(scores.masked_fill(~support, -1e9), dim=-1)
            kl = (p * (torch.log(p.clamp_min(1e-12)) - logq)).sum(-1)
            total = total + kl[rows].mean()
        for slot in self.captured:
            slot.clear()
        return total / max(len(self.csa), 1)

    def close(self) -> None:
        for h in self._handles:
            h.remove()

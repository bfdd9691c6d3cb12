"""Watching and steering MoE routing while the target trains.

Routers are observed with forward hooks (which experts each token went to), the
routed layers' ``e_score_correction_bias`` is nudged toward balance after each
step the way DeepSeek-V3/V4 balance without an auxiliary loss, and hash layers
get a fixed seeded token → experts table.
"""

from __future__ import annotations

import torch


def seed_hash_tables(model, gen: torch.Generator) -> None:
    """Give every hash-routed layer a seeded table: each token id to ``top_k`` distinct experts."""
    cfg = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok] for _ in range(cfg.vocab_size)]
                gate.tid2eid.copy_(torch.stack(rows))


class RoutingMonitor:
    """Counts, per layer, how many token slots each routed expert received since the last reset."""

    def __init__(self, model, by_token: bool = False) -> None:
        self.model = model
        self.num_experts = model.config.n_routed_experts
        self.counts = [torch.zeros(self.num_experts) for _ in model.model.layers]
        #: with ``by_token``, per layer a ``[vocab, experts]`` count of routes by input token; set ``token_ids`` before each forward
        self.token_counts = [torch.zeros(model.config.vocab_size, self.num_experts) for _ in model.model.layers] if by_token else None
        self.token_ids: torch.Tensor | None = None
        self._handles = [
            layer.mlp.gate.register_forward_hook(self._hook(i)) for i, layer in enumerate(model.model.layers)
        ]

    def _hook(self, i: int):
        def record(_module, _inputs, output) -> None:
            chosen = output[2].detach()
            indices = chosen.reshape(-1)
            self.counts[i] += torch.bincount(indices, minlength=self.num_experts).float()
            if self.token_counts is not None and self.token_ids is not None:
                tokens = self.token_ids.reshape(-1, 1).expand_as(chosen).reshape(-1)
                self.token_counts[i].index_put_((tokens, indices), torch.ones(indices.numel()), accumulate=True)

        return record

    def reset(self) -> None:
        for c in self.counts:
            c.zero_()

    def balance(self, rate: float) -> None:
        """Move routed layers' correction bias by ``rate`` toward under-loaded experts."""
        with torch.no_grad():
            for layer, count in zip(self.model.model.layers, self.counts):
                gate = layer.mlp.gate
                if hasattr(gate, "e_score_correction_bias") and count.sum() > 0:
                    gate.e_score_correction_bias += rate * torch.sign(count.mean() - count)

    def load_summary(self, min_occurrences: int = 20) -> list[dict[str, float]]:
        """Per layer: the busiest expert's load over the mean load, the least busy one's, the share of each,
        and (with ``by_token``) how concentrated each frequent token's routes are: the share of its routes
        that go to its own ``top_k`` most used experts (1.0: a fixed choice per token; ``top_k / experts``: uniform)."""
        top_k = self.model.config.num_experts_per_tok
        out = []
        for i, (layer, count) in enumerate(zip(self.model.model.layers, self.counts)):
            mean = count.mean().item()
            entry = dict(
                kind="hash" if hasattr(layer.mlp.gate, "tid2eid") else "routed",
                max_over_mean=count.max().item() / mean if mean else 0.0,
                min_over_mean=count.min().item() / mean if mean else 0.0,
                shares=[round(c / count.sum().item(), 4) for c in count.tolist()] if mean else [],
            )
            if self.token_counts is not None:
                per_token = self.token_counts[i]
                frequent = per_token.sum(1) >= min_occurrences * top_k
                if frequent.any():
                    rows = per_token[frequent]
                    entry["token_route_concentration"] = (rows.topk(top_k, dim=1).values.sum() / rows.sum()).item()
            out.append(entry)
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()

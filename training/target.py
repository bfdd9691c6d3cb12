"""Training and measuring the tiny DeepSeek-V4 target with transformers' ``DeepseekV4ForCausalLM``."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .data import fixed_windows, random_windows
from .indexer_loss import IndexerDistillation
from .routing import RoutingMonitor


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of ``peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_target(model, stream: torch.Tensor, *, steps: int, batch: int, seq_len: int, lr: float, seed: int,
                 dense_indexer_steps: int, indexer_weight: float = 0.1, balance_rate: float = 1e-3,
                 log_every: int = 20) -> list[dict[str, float]]:
    """Next-token training with the indexer's distillation loss and bias-based expert balancing; returns the log."""
    gen = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    indexer = IndexerDistillation(model)
    routing = RoutingMonitor(model)
    model.train()
    log: list[dict[str, float]] = []
    start = time.monotonic()
    try:
        for step in range(steps):
            indexer.set_dense(step < dense_indexer_steps)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, steps, lr, warmup=max(steps // 20, 1))
            x = random_windows(stream, batch, seq_len, gen)
            logits = model(input_ids=x, use_cache=False).logits
            lm = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            aux = indexer.loss(seq_len)
            (lm + indexer_weight * aux).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            routing.balance(balance_rate)
            routing.reset()
            if step % log_every == 0 or step == steps - 1:
                entry = dict(step=step, loss=lm.item(), indexer_kl=aux.item(), seconds=time.monotonic() - start)
                log.append(entry)
                print(f"target step {step:4d}  loss {entry['loss']:.3f}  indexer KL {entry['indexer_kl']:.3f}  {entry['seconds']:.0f}s", flush=True)
    finally:
        indexer.set_dense(False)
        indexer.close()
        routing.close()
    model.eval()
    return log


@torch.no_grad()
def heldout_metrics(model, heldout: torch.Tensor, train: torch.Tensor, seq_len: int, max_windows: int | None = None) -> dict:
    """Held-out perplexity of the model and of the add-one unigram model of ``train``, and expert loads."""
    model.eval()
    windows = fixed_windows(heldout, seq_len, max_windows)
    routing = RoutingMonitor(model, by_token=True)
    nll, count = 0.0, 0
    try:
        for i in range(0, windows.shape[0], 8):
            x = windows[i : i + 8]
            routing.token_ids = x
            logits = model(input_ids=x, use_cache=False).logits
            nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
            count += x[:, 1:].numel()
        loads = routing.load_summary()
    finally:
        routing.close()
    vocab = model.config.vocab_size
    freq = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (freq / freq.sum()).log()
    targets = windows[:, 1:].reshape(-1)
    unigram_nll = -logp[targets].mean().item()
    return dict(
        heldout_tokens=count,
        perplexity=math.exp(nll / count),
        unigram_perplexity=math.exp(unigram_nll),
        expert_load=loads,
    )


@torch.no_grad()
def greedy_continue(model, prompt_ids: list[int], max_tokens: int, eos_id: int) -> list[int]:
    """Greedy continuation with full recomputation each step (short prompts only)."""
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        nxt = int(logits.argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt == eos_id:
            break
    return out

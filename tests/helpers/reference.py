"""Generation without the engine: the model alone over a contiguous cache, one request at a time."""

from __future__ import annotations

import torch

from deepinfer.models.common.batch import Batch
from deepinfer.models.common.cache import ContiguousCache
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_interfaces import Kernels


def load_model(model_dir, dtype: torch.dtype = torch.float32) -> DeepseekV4Model:
    return DeepseekV4Model.from_pretrained(model_dir, Kernels(), dtype=dtype)


def greedy_alone(model: DeepseekV4Model, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation of one prompt: prefill, then one token per step."""
    cache = ContiguousCache(model.config, 1, len(prompt) + max_tokens + 1, dtype=model.dtype)
    slot = cache.allocate()
    out: list[int] = []
    logits = model(Batch.build([prompt], [slot], [0]), cache)
    for _ in range(max_tokens):
        tok = int(logits[-1].float().argmax())
        out.append(tok)
        logits = model(Batch.build([[tok]], [slot], [len(prompt) + len(out) - 1]), cache)
    return out

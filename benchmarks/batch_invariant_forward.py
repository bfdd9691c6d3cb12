"""The model forward in batch-invariant mode against the default mode: a decode step and a prefill chunk.

For each batch size, on the reference kernels (CPU): the mean time of one decode step (each sequence one
token after a 64-token prompt) and of one prefill step (each sequence a 64-token chunk), default mode and
batch-invariant mode (``Kernels.set_batch_invariant(True)``) side by side, with their ratio.

    .venv/bin/python benchmarks/batch_invariant_forward.py [--model DIR] [--batch-sizes 1 16 64] [--reps N] [--json]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import add_json_flag, emit_json, model_dir, random_tokens

from deepinfer.models.common.batch import Batch
from deepinfer.models.common.cache import ContiguousCache
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_interfaces import Kernels

PROMPT = 64


def step_times(model: DeepseekV4Model, batch: int, reps: int) -> tuple[float, float]:
    """Mean seconds of a prefill step (``batch`` chunks of ``PROMPT`` tokens) and of a decode step after it."""
    vocab = model.config.vocab_size
    prompts = [random_tokens(PROMPT, s, vocab) for s in range(batch)]
    cache = ContiguousCache(model.config, batch, PROMPT + reps + 2, dtype=model.dtype)
    slots = [cache.allocate() for _ in range(batch)]
    prefill = Batch.build(prompts, slots, [0] * batch)
    step = Batch.build([[p[-1]] for p in prompts], slots, [PROMPT] * batch)

    def timed(inputs: Batch, keep: int) -> float:
        total = 0.0
        for _ in range(reps + 1):  # the first is a warm-up
            for slot in slots:
                cache.truncate(slot, keep)
            start = time.perf_counter()
            model(inputs, cache)
            total = 0.0 if total == 0.0 and _ == 0 else total + time.perf_counter() - start
        return total / reps

    with torch.inference_mode():
        t_prefill = timed(prefill, 0)  # leaves the prompts cached for the decode steps
        t_decode = timed(step, PROMPT)
    return t_prefill, t_decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=5)
    add_json_flag(ap)
    args = ap.parse_args()
    kernels = Kernels()
    model = DeepseekV4Model.from_pretrained(model_dir(args.model), kernels, dtype=torch.float32)
    figures: dict[str, dict[str, float]] = {}
    print(f"{'batch':>5} {'step':>8} {'default ms':>11} {'invariant ms':>13} {'ratio':>6}")
    for b in args.batch_sizes:
        kernels.set_batch_invariant(False)
        base = step_times(model, b, args.reps)
        kernels.set_batch_invariant(True)
        inv = step_times(model, b, args.reps)
        for name, d, i in (("prefill", base[0], inv[0]), ("decode", base[1], inv[1])):
            print(f"{b:>5} {name:>8} {d * 1e3:>11.2f} {i * 1e3:>13.2f} {i / d:>6.2f}")
            figures[f"{name}_b{b}"] = {"default_ms": d * 1e3, "invariant_ms": i * 1e3, "ratio": i / d}
    emit_json(args.json, figures)


if __name__ == "__main__":
    main()

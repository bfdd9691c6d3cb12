"""Overlap scheduling: throughput and device idle fraction with and without, side by side.

    .venv/bin/python benchmarks/overlap.py [--model DIR] [--concurrency 1 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse

from common import model_dir, random_tokens

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


def run(path, overlap: bool, n: int, max_tokens: int) -> tuple[float, float, float]:
    llm = LLM(model=str(path), backend="cpu", kv_cache_memory=256 << 20, max_model_len=1024, max_num_seqs=max(n, 1), overlap_scheduling=overlap)
    vocab = min(llm.engine.vocab_size, 256)
    prompts = [random_tokens(16 + (i % 7), i, vocab) for i in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))
    llm.engine.stats.__init__()
    llm.generate(prompts, sp)
    s = llm.engine.stats
    return s.generated_tokens / s.wall_seconds, s.device_idle_fraction, 1e3 * s.schedule_seconds / max(s.steps, 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    path = model_dir(args.model)
    print(f"model {path}")
    print(f"{'concurrency':>11} | {'off tok/s':>9} {'idle':>6} | {'on tok/s':>9} {'idle':>6} | {'speed-up':>8} | sched ms/step")
    for n in args.concurrency:
        off = run(path, False, n, args.max_tokens)
        on = run(path, True, n, args.max_tokens)
        print(f"{n:>11} | {off[0]:>9.1f} {off[1]:>6.1%} | {on[0]:>9.1f} {on[1]:>6.1%} | {on[0] / off[0]:>7.2f}x | {on[2]:.2f}")


if __name__ == "__main__":
    main()

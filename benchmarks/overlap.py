"""Overlap scheduling: throughput and device idle fraction with and without, side by side.

    .venv/bin/python benchmarks/overlap.py [--model DIR] [--concurrency 1 64] [--max-tokens 32] [--json]
"""

from __future__ import annotations

import argparse

from common import add_json_flag, emit_json, model_dir, random_tokens

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


def run(path, overlap: bool, n: int, max_tokens: int) -> tuple[float, float, float]:
    llm = LLM(model=str(path), backend="cpu", kv_cache_memory=256 << 20, max_model_len=1024, max_num_seqs=max(n, 1), overlap_scheduling=overlap)
    vocab = min(llm.engine.vocab_size, 256)
    prompts = [random_tokens(16 + (i % 7), i, vocab) for i in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))
    before = llm.get_metrics()
    llm.generate(prompts, sp)
    m = llm.get_metrics()
    wall = m["wall_seconds"] - before["wall_seconds"]
    steps = max(m["steps"] - before["steps"], 1)
    idle = max(0.0, 1.0 - (m["forward_seconds"] - before["forward_seconds"]) / wall) if wall else 0.0
    return (m["generated_tokens"] - before["generated_tokens"]) / wall, idle, 1e3 * (m["schedule_seconds"] - before["schedule_seconds"]) / steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=32)
    add_json_flag(ap)
    args = ap.parse_args(argv)
    path = model_dir(args.model)
    print(f"model {path}")
    print(f"{'concurrency':>11} | {'off tok/s':>9} {'idle':>6} | {'on tok/s':>9} {'idle':>6} | {'speed-up':>8} | sched ms/step")
    rows = []
    for n in args.concurrency:
        off = run(path, False, n, args.max_tokens)
        on = run(path, True, n, args.max_tokens)
        print(f"{n:>11} | {off[0]:>9.1f} {off[1]:>6.1%} | {on[0]:>9.1f} {on[1]:>6.1%} | {on[0] / off[0]:>7.2f}x | {on[2]:.2f}")
        rows.append({"concurrency": n, "off_tokens_per_second": off[0], "off_idle": off[1], "on_tokens_per_second": on[0],
                     "on_idle": on[1], "speedup": on[0] / off[0], "schedule_ms_per_step": on[2]})
    emit_json(args.json, {"benchmark": "overlap", "model": str(path), "results": rows})


if __name__ == "__main__":
    main()

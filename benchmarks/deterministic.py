"""Deterministic mode: what it costs, and what coupled verification costs seeded requests in acceptance.

Part 1 runs the bundled model (CPU, fp32, ``--threads`` torch threads, 1 by default) with the
default engine and with ``deterministic=True`` side by side in this process, at 1, 16 and 64
concurrent requests (prompts of 8 to 120 tokens, greedy and seeded at temperature 0.8, each
``--max-tokens`` tokens, speculation adaptive as by default, prefix caching off so every round
computes its prompts). The two engines run each workload in turn for ``--repeat`` rounds,
alternating, so they share this machine's drift; each figure is its best round. Per concurrency:
output tokens per second of both and the ratio deterministic / default, by the wall clock and by this
process's CPU time (the steadier figure where others share the machine).

Part 2 measures the engine's ``spec_mean_accepted_length`` (tokens a verification emits per
request: accepted drafts + 1) with every drafted token verified (policy ``all``), at temperatures
0.6, 0.8 and 1.0: seeded requests (coupled verification: a draft is kept when it equals the
target's own draw under the position's noise) against unseeded ones (rejection sampling), the
same prompts and ``--samples`` completions of each. Coupled verification's gain is that a seeded
request's tokens do not depend on what was drafted; this part shows what it does to acceptance.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import add_json_flag, emit_json, random_tokens  # noqa: E402
from deepinfer import LLM, SamplingParams  # noqa: E402

CONCURRENCY = (1, 16, 64)
TEMPERATURES = (0.6, 0.8, 1.0)
CODE = ["def read_file(path):", "class Stack:\n    def push(self, item):", "import os\n\ndef walk(top):",
        "Return the number of", "def get_name(self):", "class Queue:", "def close(self):", "def parse(text):"]


def workload(n: int, max_tokens: int, vocab: int) -> tuple[list, list[SamplingParams]]:
    """``n`` prompts of 8 to 120 random tokens, half greedy, half seeded at temperature 0.8."""
    prompts = [random_tokens(8 + (37 * i) % 113, seed=i, vocab=vocab) for i in range(n)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=None if i % 2 == 0 else 1000 + i,
                             max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    return prompts, params


def throughput(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[float, float]:
    """Output tokens per wall-clock second and per CPU second of this process, of one run of the workload
    (on a shared machine the CPU figure is the steadier one)."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    elapsed, used = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return tokens / elapsed, tokens / used


def cost(max_tokens: int, repeat: int) -> dict[str, dict[str, float]]:
    # no prefix caching: every round computes its prompts again (a round's hits would favour the default's shorter replay)
    engines = {name: LLM(backend="cpu", max_num_seqs=max(CONCURRENCY), max_model_len=512, deterministic=det, enable_prefix_caching=False)
               for name, det in (("default", False), ("deterministic", True))}
    vocab = engines["default"].engine.model_config.vocab_size
    for llm in engines.values():  # warm up: start-up profiles measured, first-call allocations made
        llm.generate(*workload(2, 4, vocab))
    out: dict[str, dict[str, float]] = {}
    print(f"{'requests':>8} {'default tok/s':>14} {'deterministic tok/s':>20} {'ratio':>7}   "
          f"{'default tok/cpu-s':>18} {'deterministic tok/cpu-s':>24} {'ratio':>7}")
    for n in CONCURRENCY:
        prompts, params = workload(n, max_tokens, vocab)
        wall = {name: 0.0 for name in engines}
        cpu = {name: 0.0 for name in engines}
        for _ in range(repeat):
            for name, llm in engines.items():
                w, c = throughput(llm, prompts, params)
                wall[name], cpu[name] = max(wall[name], w), max(cpu[name], c)
        ratio, cpu_ratio = wall["deterministic"] / wall["default"], cpu["deterministic"] / cpu["default"]
        out[str(n)] = {"default_tok_s": wall["default"], "deterministic_tok_s": wall["deterministic"], "ratio": ratio,
                       "default_tok_cpu_s": cpu["default"], "deterministic_tok_cpu_s": cpu["deterministic"], "cpu_ratio": cpu_ratio}
        print(f"{n:>8} {wall['default']:>14.1f} {wall['deterministic']:>20.1f} {ratio:>7.3f}   "
              f"{cpu['default']:>18.1f} {cpu['deterministic']:>24.1f} {cpu_ratio:>7.3f}")
    for llm in engines.values():
        llm.close()
    return out


def accepted_length(llm: LLM, prompts: list[str], temperature: float, seeded: bool, n: int, max_tokens: int) -> float:
    """The engine's mean accepted length over this run alone (its counters' growth)."""
    before = llm.get_metrics()
    params = [SamplingParams(n=n, temperature=temperature, seed=(7 * i if seeded else None), max_tokens=max_tokens, ignore_eos=True)
              for i in range(len(prompts))]
    llm.generate(prompts, params)
    after = llm.get_metrics()
    v = after["spec_verifications"] - before["spec_verifications"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return (accepted + v) / v if v else 0.0


def acceptance(max_tokens: int, samples: int, deterministic: bool) -> dict[str, dict[str, float]]:
    llm = LLM(backend="cpu", max_num_seqs=64, max_model_len=512, speculative_policy="all", deterministic=deterministic)
    out: dict[str, dict[str, float]] = {}
    print(f"\n{'temperature':>11} {'coupled (seeded)':>17} {'rejection (unseeded)':>21} {'ratio':>7}")
    for t in TEMPERATURES:
        coupled = accepted_length(llm, CODE, t, True, samples, max_tokens)
        rejection = accepted_length(llm, CODE, t, False, samples, max_tokens)
        out[str(t)] = {"coupled": coupled, "rejection": rejection, "ratio": coupled / rejection if rejection else 0.0}
        print(f"{t:>11.1f} {coupled:>17.3f} {rejection:>21.3f} {out[str(t)]['ratio']:>7.3f}")
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates")
    ap.add_argument("--repeat", type=int, default=3, help="alternating rounds per concurrency (the best counts)")
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt in the acceptance runs (n)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--deterministic-acceptance", action="store_true",
                    help="measure acceptance in deterministic mode (default: the default engine; the figures are the same rules)")
    add_json_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"bundled model, CPU, {args.threads} thread(s), {args.max_tokens} tokens per request, best of {args.repeat} alternating rounds\n")
    figures = {
        "throughput": cost(args.max_tokens, args.repeat),
        "accepted_length": acceptance(args.max_tokens, args.samples, args.deterministic_acceptance),
        "max_tokens": args.max_tokens, "repeat": args.repeat, "threads": args.threads,
    }
    emit_json(args.json, figures)


if __name__ == "__main__":
    main()

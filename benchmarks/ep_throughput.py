"""Expert parallelism on this machine: output tokens/s at several EP degrees, the dispatch/combine share of
the forward, and balancedness before and after EPLB on a workload skewed to a few experts.

Every EP degree runs the same greedy workload on the bundled model (CPU ranks over gloo, the machine's
cores split between the ranks). On a two-core machine more ranks mean fewer cores each and more
collectives per layer, so EP is slower here than one rank: the figures show the protocol's cost, not a
speed-up (that needs one device per rank).

    .venv/bin/python benchmarks/ep_throughput.py [--ep 1,2,4] [--prompts 8] [--max-tokens 32] [--json]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

from common import add_json_flag, emit_json

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "def read_file(path):", "class Stack:\n    def push(self, item):", "import os\n\ndef walk(top):", "Return the number of",
    "def __init__(self, name):", "for key, value in", "if __name__ == '__main__':", "raise ValueError(",
]


@dataclass
class EPRun:
    ep: int
    seconds: float
    output_tokens: int
    tokens_per_second: float
    #: share of the ranks' forward time spent in dispatch and combine (0 at EP 1)
    dispatch_combine_share: float
    balancedness: float | None


def _run(ep: int, prompts: list[str], params: SamplingParams, **kw) -> tuple[EPRun, dict]:
    llm = LLM(backend="cpu", seed=0, expert_parallel_size=ep, **kw)
    try:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2))  # warm up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        metrics = llm.get_metrics()
    finally:
        llm.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ep_m = metrics.get("expert_parallel") or {}
    run = EPRun(ep, seconds, tokens, tokens / seconds, ep_m.get("dispatch_combine_share", 0.0), ep_m.get("balancedness_total"))
    return run, ep_m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", default="1,2,4", help="EP degrees, comma-separated")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    add_json_flag(ap)
    args = ap.parse_args()
    prompts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[: args.prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = [_run(int(e), prompts, params)[0] for e in args.ep.split(",")]
    base = runs[0].tokens_per_second
    print(f"{'EP':>3} {'seconds':>8} {'tokens':>7} {'tok/s':>8} {'vs first':>8} {'dispatch+combine':>17} {'balancedness':>13}")
    for r in runs:
        bal = "n/a" if r.balancedness is None else f"{r.balancedness:.3f}"
        print(f"{r.ep:>3} {r.seconds:>8.2f} {r.output_tokens:>7} {r.tokens_per_second:>8.1f} {r.tokens_per_second / base:>7.2f}x "
              f"{r.dispatch_combine_share:>16.1%} {bal:>13}")

    skewed = ["the the the the the the the the the the the the"] * 6
    _, ep_m = _run(2, skewed, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                   num_redundant_experts=2, eplb_interval=8, eplb_window=8)
    before, after = ep_m["balancedness_total_before"], ep_m["balancedness_total"]
    print(f"\nEPLB at EP 2, 2 redundant experts, skewed workload: balancedness {before:.3f} before, {after:.3f} after "
          f"({ep_m['rebalances']} rebalances, {ep_m['experts_moved']} expert slots moved)")
    emit_json(args.json, {
        "runs": [asdict(r) for r in runs],
        "eplb": {"balancedness_before": before, "balancedness_after": after, "rebalances": ep_m["rebalances"],
                 "experts_moved": ep_m["experts_moved"], "per_layer_before": ep_m["balancedness_before"],
                 "per_layer_after": ep_m["balancedness"]},
    })


if __name__ == "__main__":
    main()

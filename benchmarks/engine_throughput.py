"""Throughput of deepinfer (CPU backend: the defaults, speculation off, graph mode) against transformers' batched generate, side by side.

Same model, same prompts, greedy, at several concurrency levels, on two
workloads: ``equal`` (every prompt and output the same length) and ``mixed``
(prompts of 16-400 tokens, outputs of 8-128, fixed seed). transformers gets the
prompts left-padded in one batch and runs to the longest output; only the
tokens each request asked for count. Each engine runs the workload ``--repeat``
times with fresh tokens (no prefix-cache hits) and the best run counts (this
machine's timings vary from run to run). Prints output tokens/s per engine and
the ratios to transformers; graph mode also reports what capture cost at start-up.

    .venv/bin/python benchmarks/engine_throughput.py [--model DIR] [--concurrency 1 16 64]
        [--workloads equal mixed] [--modes eager nospec graph transformers] [--json]

``eager`` is the engine with its defaults (DSpark speculation on, the adaptive policy, for a
checkpoint with a draft) and ``nospec`` the same without speculation; their ratio is printed
beside the row. The engine modes take turns on each repeat.

Graph mode on the CPU compiles each decode graph with inductor (seconds each
with a warm cache, about a minute cold), so it captures only a few sizes here.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch
from common import add_json_flag, emit_json, model_dir

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def longest(self) -> int:
        return max(len(p) for p in self.prompts) + max(self.outputs)


def make_workload(kind: str, n: int, vocab: int, seed: int, equal_prompt: int, equal_output: int, repeat: int = 0) -> Workload:
    """Lengths from ``seed``; prompt tokens from ``seed`` and ``repeat`` (each repeat: the same lengths, fresh tokens)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "equal":
        lens, outs = [equal_prompt] * n, [equal_output] * n
    else:
        lens = torch.randint(16, 401, (n,), generator=g).tolist()
        outs = torch.randint(8, 129, (n,), generator=g).tolist()
    tokens = torch.Generator().manual_seed(seed * 1000 + repeat)
    prompts = [torch.randint(3, vocab, (m,), generator=tokens).tolist() for m in lens]
    return Workload(kind, prompts, outs)


def capture_sizes(n: int) -> list[int]:
    """A few decode sizes up to ``n`` (powers of 4, then ``n``)."""
    sizes, s = [], 1
    while s < n:
        sizes.append(s)
        s *= 4
    return [*sizes, n]


#: the engine's modes: eager (the defaults, speculation on where the checkpoint has a draft), eager with
#: speculation off, and decode graphs
ENGINE_MODES = {"eager": dict(enforce_eager=True), "nospec": dict(enforce_eager=True, speculative_method=None), "graph": dict(enforce_eager=False)}


def run_deepinfer(path, works: list[Workload], modes: list[str], max_model_len: int) -> dict[str, dict]:
    """Per engine mode, the best of one timed run per workload (same shape, different tokens: no prefix-cache
    hits); the modes' engines live side by side and take turns on each workload, so drift hits them alike."""
    n = len(works[0].prompts)
    llms, startup = {}, {}
    for mode in modes:
        t = time.perf_counter()
        kw = dict(ENGINE_MODES[mode])
        if mode == "graph":
            kw["graph_capture_sizes"] = capture_sizes(n)
        llms[mode] = LLM(model=str(path), backend="cpu", kv_cache_memory=512 << 20, max_model_len=max_model_len, max_num_seqs=max(n, 1), **kw)
        startup[mode] = time.perf_counter() - t
        llms[mode].generate(works[0].prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    best: dict[str, dict] = {}
    for i, work in enumerate(works):
        params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in work.outputs]
        for mode in modes[i % len(modes):] + modes[: i % len(modes)]:
            llm = llms[mode]
            before = llm.get_metrics()
            t = time.perf_counter()
            outs = llm.generate(work.prompts, params)
            wall = time.perf_counter() - t
            m = llm.get_metrics()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            run = {
                "tokens_per_second": tokens / wall, "seconds": wall, "tokens": tokens,
                "graph_replays": m["graph_replays"] - before["graph_replays"], "steps": m["steps"] - before["steps"],
                "drafting_request_share": _share(m, before, "spec_drafting_requests", "spec_draft_candidates"),
            }
            if mode not in best or run["tokens_per_second"] > best[mode]["tokens_per_second"]:
                best[mode] = run
    out = {}
    for mode, llm in llms.items():
        m = llm.get_metrics()
        out[mode] = {**best[mode], "startup_seconds": startup[mode], "graphs_captured": m["graphs_captured"],
                     "graph_capture_seconds": m["graph_capture_seconds"]}
        llm.close()
    return out


def _share(after: dict, before: dict, part: str, whole: str) -> float:
    n = after.get(whole, 0) - before.get(whole, 0)
    return (after.get(part, 0) - before.get(part, 0)) / n if n else 0.0


def _left_padded(work: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in work.prompts)
    ids = torch.zeros(len(work.prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(work.prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def run_transformers(path, works: list[Workload]) -> dict:
    """The best of one timed batched ``generate`` per workload."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    best = None
    with torch.no_grad():
        ids, mask = _left_padded(works[0])
        model.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=8, do_sample=False)  # warm-up
        for work in works:
            ids, mask = _left_padded(work)
            t = time.perf_counter()
            model.generate(ids, attention_mask=mask, max_new_tokens=max(work.outputs), do_sample=False)
            wall = time.perf_counter() - t
            tokens = sum(work.outputs)
            run = {"tokens_per_second": tokens / wall, "seconds": wall, "tokens": tokens}
            best = run if best is None or run["tokens_per_second"] > best["tokens_per_second"] else best
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--workloads", nargs="+", default=["equal", "mixed"], choices=["equal", "mixed"])
    ap.add_argument("--modes", nargs="+", default=["eager", "nospec", "graph", "transformers"], choices=["eager", "nospec", "graph", "transformers"],
                    help="eager: the defaults (speculation on); nospec: eager without speculation; graph: decode graphs; transformers")
    ap.add_argument("--equal-prompt", type=int, default=32, help="prompt length of the equal workload")
    ap.add_argument("--equal-output", type=int, default=32, help="output length of the equal workload")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per engine (fresh prompts each, same shape); the best counts")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    config = json.loads((path / "config.json").read_text())
    vocab, max_pos = config["vocab_size"], config["max_position_embeddings"]
    print(f"model {path}, greedy, CPU threads {torch.get_num_threads()}")
    header = f"{'workload':>8} {'n':>3} | " + " | ".join(f"{m:>12} tok/s" for m in args.modes)
    if "transformers" in args.modes:
        header += " | " + " ".join(f"{m + '/hf':>10}" for m in args.modes if m != "transformers")
    print(header)
    rows = []
    for kind in args.workloads:
        for n in args.concurrency:
            works = [make_workload(kind, n, vocab, args.seed, args.equal_prompt, args.equal_output, r) for r in range(args.repeat)]
            max_len = min(max_pos, max(256, 1 << (works[0].longest - 1).bit_length()))
            row = {"workload": kind, "concurrency": n}
            engine_modes = [m for m in args.modes if m != "transformers"]
            if engine_modes:
                row.update(run_deepinfer(path, works, engine_modes, max_len))
            if "transformers" in args.modes:
                row["transformers"] = run_transformers(path, works)
            line = f"{kind:>8} {n:>3} | " + " | ".join(f"{row[m]['tokens_per_second']:>18.1f}" for m in args.modes)
            if "eager" in args.modes and "nospec" in args.modes:
                row["speculation_vs_off"] = row["eager"]["tokens_per_second"] / row["nospec"]["tokens_per_second"]
                line += f" | defaults/no speculation {row['speculation_vs_off']:.3f} (drafting for {row['eager']['drafting_request_share']:.0%} of requests)"
            if "transformers" in args.modes:
                hf = row["transformers"]["tokens_per_second"]
                for m in args.modes:
                    if m != "transformers":
                        row[f"{m}_vs_transformers"] = row[m]["tokens_per_second"] / hf
                line += " | " + " ".join(f"{row[f'{m}_vs_transformers']:>9.2f}x" for m in args.modes if m != "transformers")
            if "graph" in args.modes:
                g = row["graph"]
                line += f"   (graph: {g['graphs_captured']} captured in {g['graph_capture_seconds']:.0f} s, {g['graph_replays']}/{g['steps']} steps replayed)"
            print(line, flush=True)
            rows.append(row)
    emit_json(args.json, {"benchmark": "engine_throughput", "model": str(path), "threads": torch.get_num_threads(), "results": rows})


if __name__ == "__main__":
    main()

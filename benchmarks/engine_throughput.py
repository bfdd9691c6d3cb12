"""Throughput of deepinfer (CPU backend) against transformers' batched generate, side by side.

Same tiny model, same prompts, greedy, at several concurrency levels. Prompts
have equal length so transformers needs no padding. Prints output tokens/s,
mean time per output token, and the deepinfer / transformers ratios.

    .venv/bin/python benchmarks/engine_throughput.py [--model DIR] [--concurrency 1 16 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    sys.path.insert(0, str(ROOT))
    from tests.helpers.checkpoints import make_tiny_checkpoint

    return make_tiny_checkpoint(Path(tempfile.mkdtemp()), "mixed")


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, min(vocab, 256), (length,), generator=g).tolist() for _ in range(n)]


def run_deepinfer(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(model=str(model_dir), backend="cpu", kv_cache_memory=256 << 20, max_model_len=512, max_num_seqs=max(len(prompts), 1))
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpot = sum(o.metrics.time_per_output_token or 0 for o in outs) / len(outs)
    return tokens / wall, tpot


def run_transformers(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, do_sample=False)
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        wall = time.perf_counter() - t
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return tokens / wall, wall / max_tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a tiny random one)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=24)
    args = ap.parse_args(argv)
    model_dir = _model_dir(args.model)
    import json

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(f"model {model_dir}, greedy, {args.max_tokens} new tokens, prompt length {args.prompt_len}, threads {torch.get_num_threads()}")
    print(f"{'concurrency':>11} | {'deepinfer tok/s':>15} {'tpot ms':>8} | {'transformers tok/s':>18} {'tpot ms':>8} | {'speed-up':>8}")
    for n in args.concurrency:
        prompts = _prompts(n, args.prompt_len, vocab)
        d_tps, d_tpot = run_deepinfer(model_dir, prompts, args.max_tokens)
        h_tps, h_tpot = run_transformers(model_dir, prompts, args.max_tokens)
        print(f"{n:>11} | {d_tps:>15.1f} {1e3 * d_tpot:>8.2f} | {h_tps:>18.1f} {1e3 * h_tpot:>8.2f} | {d_tps / h_tps:>7.2f}x")


if __name__ == "__main__":
    main()

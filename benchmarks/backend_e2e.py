"""End-to-end check: greedy generation on an accelerator backend (``--backend cuda`` or ``ascend``) against ``--backend cpu``, token by token.

Without ``--model`` it builds a tiny random DeepSeek-V4 checkpoint with
transformers (every layer type, hash and learned routing), so it needs no
download. Both runs use fp32, where the Triton kernels and the reference
agree to rounding and greedy tokens must match exactly; the script also
reports how far the chosen tokens' log-probabilities differ, (for
information only) how many tokens a bf16 run on the backend shares with the
fp32 reference, and whether its graph replays give eager's tokens. Exits 1
when the fp32 tokens differ.

    python benchmarks/backend_e2e.py [--backend cuda|ascend] [--model DIR] [--max-tokens 16] [--interpret]

``--interpret`` runs the backend's Triton kernels on CPU tensors through
Triton's interpreter (slow; for machines without the device).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _tiny_checkpoint(directory: Path) -> tuple[Path, list[list[int]]]:
    """The tiny ``mixed`` test checkpoint and prompts long enough for every compressor to emit entries."""
    sys.path.insert(0, str(ROOT))
    from tests.helpers.checkpoints import BOS_ID, make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(directory, "mixed")
    g = torch.Generator().manual_seed(0)
    prompts = [[BOS_ID] + torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40)]
    return ckpt, prompts


def _generate(model: str, prompts, backend: str, dtype: str, max_tokens: int, interpret: bool, cache_bytes: int | None,
              enforce_eager: bool | None = None):
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(
        model=model, backend=backend, dtype=dtype, interpret=interpret,
        max_model_len=512, max_num_seqs=len(prompts), kv_cache_memory=cache_bytes, enforce_eager=enforce_eager,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    chosen = [[pos[t].logprob for t, pos in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return tokens, chosen, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="cuda", help="the backend checked against cpu (default: cuda)")
    parser.add_argument("--model", help="HF-layout checkpoint directory (default: a tiny random checkpoint)")
    parser.add_argument("--prompt", action="append", help="prompt text (repeatable; default: three token-id prompts)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--interpret", action="store_true", help="run the Triton kernels through Triton's CPU interpreter")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = parser.parse_args(argv)
    if args.interpret:
        # before anything (transformers, torch) imports Triton
        os.environ["TRITON_INTERPRET"] = "1"

    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model, prompts = args.model, args.prompt or ["The capital of France is", "def fibonacci(n):"]
        else:
            ckpt, prompts = _tiny_checkpoint(Path(tmp))
            model = str(ckpt)
            prompts = args.prompt or prompts
        # a small cache for the tiny model (the interpreter copies every pool at each launch); the engine's default otherwise
        cache_bytes = None if args.model else 8 << 20
        # the device run captures decode graphs (the device's default); an eager run checks them
        dev_tokens, dev_lp, dev_s = _generate(model, prompts, args.backend, "float32", args.max_tokens, args.interpret, cache_bytes)
        cpu_tokens, cpu_lp, cpu_s = _generate(model, prompts, "cpu", "float32", args.max_tokens, False, cache_bytes)
        bf16_tokens = eager_tokens = None
        if not args.interpret:
            bf16_tokens, _, _ = _generate(model, prompts, args.backend, "bfloat16", args.max_tokens, False, cache_bytes)
            eager_tokens, _, eager_s = _generate(model, prompts, args.backend, "float32", args.max_tokens, False, cache_bytes, enforce_eager=True)

    print(f"model: {args.model or 'tiny random DeepSeek-V4 (transformers)'}; {len(prompts)} prompts, {args.max_tokens} greedy tokens each")
    name = args.backend
    print(f"time: {name} {dev_s:.2f}s, cpu {cpu_s:.2f}s")
    for i, (a, b) in enumerate(zip(dev_tokens, cpu_tokens)):
        print(f"  prompt {i}: {'match' if a == b else 'DIFFER'}  {name} {a}")
        if a != b:
            print(f"            cpu  {b}")
    same = dev_tokens == cpu_tokens
    lp_diff = max(
        (abs(x - y) for a, b in zip(dev_lp, cpu_lp) for x, y in zip(a, b)), default=0.0
    ) if same else float("nan")
    print(f"fp32 greedy tokens, {name} vs cpu: {'MATCH' if same else 'MISMATCH'} (chosen-token logprob max diff {lp_diff:.2e})")
    if bf16_tokens is not None:
        agree = sum(x == y for a, b in zip(bf16_tokens, cpu_tokens) for x, y in zip(a, b))
        total = sum(len(b) for b in cpu_tokens)
        print(f"bf16 {name} vs fp32 cpu (information only; rounding may flip near-ties): {agree}/{total} tokens agree")
    graphs_match = eager_tokens is None or eager_tokens == dev_tokens
    if eager_tokens is not None:
        print(f"fp32 {name} graph mode vs eager: {'MATCH' if graphs_match else 'MISMATCH'} (eager {eager_s:.2f}s)")
    if args.json:
        import json

        print(json.dumps({"benchmark": "backend_e2e", "backend": name, "match": same, "graphs_match": graphs_match,
                          "device_seconds": dev_s, "cpu_seconds": cpu_s, "logprob_max_diff": lp_diff}))
    return 0 if same and graphs_match else 1


if __name__ == "__main__":
    sys.exit(main())

"""Prefix caching on a shared-prefix chat workload, and the quality cost of bounded replay.

Part 1: a long common system prompt and many users; total tokens computed and
wall time with no prefix caching, exact replay and bounded replay.
Part 2: continuations after a cached prefix with bounded vs exact replay:
fraction of greedy tokens identical, and mean KL divergence of the first
next-token distribution after the hit.

    .venv/bin/python benchmarks/prefix_cache.py [--model DIR] [--users 32] [--system-len 600] [--continuations 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

from common import add_json_flag, emit_json, model_dir, random_tokens

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), backend="cpu", kv_cache_memory=512 << 20, max_model_len=1024, **kw)


def _text_tokens(llm: LLM, n: int, seed: int) -> list[int]:
    vocab = llm.engine.vocab_size
    return random_tokens(n, seed, min(vocab, 256) if vocab <= 512 else vocab)


def chat_workload(path, users: int, system_len: int, max_tokens: int) -> dict:
    print(f"== shared-prefix chat: {users} users, system prompt {system_len} tokens, {max_tokens} new tokens each")
    print(f"{'mode':<18} {'computed tokens':>16} {'cached':>8} {'replayed':>9} {'wall s':>8}")
    figures = {}
    for label, kw in (("no prefix cache", dict(enable_prefix_caching=False)), ("exact replay", dict(swa_replay="exact")), ("bounded replay", dict(swa_replay="bounded"))):
        llm = _llm(path, **kw)
        system = _text_tokens(llm, system_len, 0)
        prompts = [system + _text_tokens(llm, 20, 100 + u) for u in range(users)]
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts[:1], sp)
        llm.generate(prompts[1:], sp)
        wall = time.perf_counter() - t
        m = llm.get_metrics()
        print(f"{label:<18} {m['computed_tokens']:>16} {m['cached_tokens']:>8} {m['replayed_tokens']:>9} {wall:>8.2f}")
        figures[label] = {"computed_tokens": m["computed_tokens"], "cached_tokens": m["cached_tokens"],
                          "replayed_tokens": m["replayed_tokens"], "seconds": wall}
    return figures


def replay_quality(path, n: int, prefix_len: int, max_tokens: int) -> dict:
    print(f"== bounded vs exact replay: {n} continuations after a cached {prefix_len}-token prefix, {max_tokens} greedy tokens")
    results = {}
    for mode in ("exact", "bounded"):
        llm = _llm(path, swa_replay=mode)
        vocab = llm.engine.vocab_size
        docs = [_text_tokens(llm, prefix_len, 1000 + d) for d in range(max(1, n // 20))]
        llm.generate(docs, SamplingParams(temperature=0, max_tokens=1))
        prompts = [docs[i % len(docs)] + _text_tokens(llm, 8, 5000 + i) for i in range(n)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=vocab))
        results[mode] = outs
        m = llm.get_metrics()
        print(f"  {mode}: replayed {m['replayed_tokens']} tokens, cached {m['cached_tokens']}")
    same = total = 0
    kls = []
    for a, b in zip(results["exact"], results["bounded"]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        total += len(ta)
        for x, y in zip(ta, tb):
            if x != y:
                break
            same += 1
        pa, pb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        kls.append(sum(math.exp(lp.logprob) * (lp.logprob - pb[t].logprob) for t, lp in pa.items() if t in pb))
    print(f"  greedy tokens identical (up to the first difference): {same / total:.1%} of {total}")
    print(f"  mean KL(exact || bounded) of the first next-token distribution: {sum(kls) / len(kls):.2e} nats")
    return {"greedy_identical_fraction": same / total, "mean_first_token_kl": sum(kls) / len(kls)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--continuations", type=int, default=200)
    ap.add_argument("--prefix-len", type=int, default=400)
    add_json_flag(ap)
    args = ap.parse_args(argv)
    path = model_dir(args.model)
    print(f"model {path} ({json.loads((path / 'config.json').read_text())['num_hidden_layers']} layers)")
    chat = chat_workload(path, args.users, args.system_len, args.max_tokens)
    quality = replay_quality(path, args.continuations, args.prefix_len, 16)
    emit_json(args.json, {"benchmark": "prefix_cache", "model": str(path), "chat": chat, "bounded_replay": quality})


if __name__ == "__main__":
    main()

"""Per-step cost of constrained decoding: grammar mask fill, mask application, token acceptance.

Run ``python benchmarks/structured_output.py`` (a byte-level BPE tokenizer is
trained in-process) or pass ``--tokenizer path/to/tokenizer.json`` and the
model's ``--vocab-size`` to measure a checkpoint's real vocabulary. For each
constraint and batch size, every row replays its own valid output (a random
walk through the grammar drawn beforehand) and each decode step is timed:

- fill: ``fill_batch_bitmask`` for the whole batch, per request;
- apply: the ``apply_token_bitmask`` kernel (reference unless ``--kernels``
  names another set) on the batch's ``[B, V]`` float32 logits, per step;
- accept: advancing every matcher by its token, per request.

``throughput_by_constrained_fraction`` measures end-to-end decode throughput
with 0/50/100 % of requests constrained; it needs an engine (``--model``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common import add_json_flag, emit_json

from deepinfer.chat.tool_grammar import tool_call_constraint
from deepinfer.registry import load_part
from deepinfer.sampling_params import SamplingParams, StructuredOutputsParams
from deepinfer.structured_output import GrammarCompilerCache, RequestGrammar, allocate_bitmask, fill_batch_bitmask
from deepinfer_interfaces.kernels import Kernels, unpack_bitmask

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}, "required": ["ids"]}}},
]

CONSTRAINTS: dict[str, StructuredOutputsParams] = {
    "json-object": StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "active": {"type": "boolean"},
            },
            "required": ["name", "age", "active"],
        }
    ),
    "json-nested": StructuredOutputsParams(
        json={
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer"},
                            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                        },
                        "required": ["id", "tags"],
                    },
                    "maxItems": 4,
                }
            },
            "required": ["items"],
        }
    ),
    "any-json-object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,3}, \d{1,3} years"),
    "choice": StructuredOutputsParams(choice=["positive", "negative", "neutral", "mixed feelings"]),
    # forced tool calls (tool_choice "required", parallel): the structural tags of deepinfer.chat.tool_grammar
    **{f"tool-calls-{fmt}": tool_call_constraint(fmt, TOOLS, "required", True) for fmt in ("hermes", "deepseek_v4")},
}


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on synthetic JSON and prose, with an ``<eos>`` special token."""
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog name age active items tags true false null id".split()
    corpus = []
    for _ in range(4000):
        values = [rng.randint(-999, 99999), rng.choice(words), True, None, [1, 2]]
        obj = {rng.choice(words): rng.choice(values) for _ in range(3)}
        corpus.append(json.dumps(obj, indent=rng.choice([None, 2])))
        corpus.append(" ".join(w.capitalize() if rng.random() < 0.2 else w for w in rng.choices(words, k=12)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def valid_output(cache: GrammarCompilerCache, params: StructuredOutputsParams, seed: int, cap: int) -> list[int]:
    """Token ids of one output the grammar accepts, EOS included when reached: uniform over allowed tokens."""
    g = cache.request_grammar(params)
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, cache.vocab_size)
    out: list[int] = []
    while len(out) < cap and not g.is_terminated:
        g.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, cache.vocab_size)[0].nonzero().flatten()
        t = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        if not g.accept(t):
            raise RuntimeError(f"token {t} from the mask was refused")
        out.append(t)
    return out


def time_steps(
    cache: GrammarCompilerCache, kernels: Kernels, params: StructuredOutputsParams, batch: int, cap: int, device: str
) -> dict[str, float]:
    """Median microseconds per step over a batch replaying ``batch`` valid outputs."""
    paths = [valid_output(cache, params, seed, cap) for seed in range(batch)]
    grammars: list[RequestGrammar | None] = [cache.request_grammar(params) for _ in range(batch)]
    bitmask = allocate_bitmask(batch, cache.vocab_size)
    logits = torch.randn(batch, cache.vocab_size, device=device)
    fill_us, apply_us, accept_us = [], [], []
    for step in range(max(len(p) for p in paths)):
        live = [g if step < len(p) else None for g, p in zip(grammars, paths)]
        n = sum(g is not None for g in live)
        t0 = time.perf_counter()
        rows = fill_batch_bitmask(live, bitmask)
        t1 = time.perf_counter()
        masked = kernels.apply_token_bitmask(logits[rows], bitmask[rows].to(device))
        if device != "cpu":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        for r in rows:
            live[r].accept(paths[r][step])
        t3 = time.perf_counter()
        del masked
        fill_us.append((t1 - t0) / n * 1e6)
        apply_us.append((t2 - t1) * 1e6)
        accept_us.append((t3 - t2) / n * 1e6)
    return {
        "steps": statistics.mean(len(p) for p in paths),
        "fill_us_per_req": statistics.median(fill_us),
        "apply_us_per_step": statistics.median(apply_us),
        "accept_us_per_req": statistics.median(accept_us),
    }


def throughput_by_constrained_fraction(
    llm: Any,
    prompts: list[str],
    constraint: StructuredOutputsParams,
    fractions: tuple[float, ...] = (0.0, 0.5, 1.0),
    max_tokens: int = 128,
) -> list[dict[str, float]]:
    """Decode throughput of ``llm.generate`` when a fraction of the requests carry ``constraint``.

    ``llm`` is anything with vLLM's offline ``generate(prompts, [SamplingParams, ...])``
    returning outputs whose ``outputs[0].token_ids`` are the generated tokens.
    """
    rows = []
    for fraction in fractions:
        k = round(fraction * len(prompts))
        params = [
            SamplingParams(
                temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=constraint if i < k else None
            )
            for i in range(len(prompts))
        ]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append(
            {
                "constrained": fraction,
                "requests": len(prompts),
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="a tokenizer.json to measure with (default: train a byte-level BPE)")
    ap.add_argument("--vocab-size", type=int, help="the model's vocabulary size (default: the tokenizer's)")
    ap.add_argument("--eos", default="<eos>", help="the end token's text (for --tokenizer)")
    ap.add_argument("--train-vocab", type=int, default=8000, help="vocabulary of the trained tokenizer")
    ap.add_argument("--batch-sizes", default="1,8,32,128")
    ap.add_argument("--constraints", default=",".join(CONSTRAINTS), help=f"some of {', '.join(CONSTRAINTS)}")
    ap.add_argument("--max-steps", type=int, default=64, help="tokens per replayed output at most")
    ap.add_argument("--device", default="cpu", help="where the logits live for the apply step (cpu or cuda)")
    ap.add_argument("--kernels", default="reference", help="kernel set whose apply_token_bitmask is timed")
    ap.add_argument("--threads", type=int, help="torch CPU threads (1 gives steady numbers on a busy machine)")
    ap.add_argument("--model", help="also measure end-to-end throughput with 0/50/100%% constrained requests")
    ap.add_argument("--requests", type=int, default=32, help="requests per end-to-end run")
    add_json_flag(ap)
    args = ap.parse_args()
    figures: dict = {"benchmark": "structured_output", "masks": [], "end_to_end": []}

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = Tokenizer.from_file(args.tokenizer) if args.tokenizer else train_tokenizer(args.train_vocab)
    vocab = args.vocab_size or tok.get_vocab_size()
    eos = tok.token_to_id(args.eos)
    t0 = time.perf_counter()
    cache = GrammarCompilerCache(tok, vocab, eos)
    print(
        f"vocabulary {vocab} (tokenizer {tok.get_vocab_size()}), eos {eos}; "
        f"compiler set up in {time.perf_counter() - t0:.2f} s; {torch.get_num_threads()} torch threads, "
        f"logits on {args.device}, {args.kernels} kernels"
    )
    kernels: Kernels = load_part("kernels", args.kernels)()

    header = (
        f"{'constraint':<16} {'compile ms':>10} {'batch':>5} {'steps':>6} "
        f"{'fill us/req':>12} {'apply us/step':>14} {'accept us/req':>14}"
    )
    print(header)
    print("-" * len(header))
    for name in args.constraints.split(","):
        params = CONSTRAINTS[name]
        t0 = time.perf_counter()
        cache.compile(params)
        compile_ms = (time.perf_counter() - t0) * 1e3
        for b in (int(x) for x in args.batch_sizes.split(",")):
            r = time_steps(cache, kernels, params, b, args.max_steps, args.device)
            figures["masks"].append({"constraint": name, "compile_ms": compile_ms, "batch": b, **r})
            print(
                f"{name:<16} {compile_ms:>10.1f} {b:>5} {r['steps']:>6.1f} {r['fill_us_per_req']:>12.1f} "
                f"{r['apply_us_per_step']:>14.1f} {r['accept_us_per_req']:>14.1f}"
            )

    if args.model:
        from deepinfer import LLM  # the engine's offline API

        llm = LLM(model=args.model)
        prompts = [f"Describe person number {i} as JSON." for i in range(args.requests)]
        print(f"\n{'constrained':>11} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9}")
        for row in throughput_by_constrained_fraction(llm, prompts, CONSTRAINTS["json-object"]):
            figures["end_to_end"].append(row)
            print(
                f"{row['constrained']:>11.0%} {row['requests']:>8} {row['tokens']:>7} "
                f"{row['seconds']:>8.2f} {row['tokens_per_s']:>9.1f}"
            )
    emit_json(args.json, figures)


if __name__ == "__main__":
    main()

"""Time to first token of a long shared prefix: recomputed, hit in memory, and hit in the KV store from another process.

Three situations, each the median of ``--repeats`` prompts of ``--prefix-len``
prefix tokens plus a fresh ``--suffix-len`` suffix, after one warm-up request:

1. no cache: an engine with prefix caching off computes the whole prompt;
2. in-memory hit: one engine serves the prefix once, then prompts sharing it;
3. store hit: process A serves ``--repeats`` distinct prefixes with ``kv_store``
   and exits (flushing its writes); a fresh process B, with nothing in memory,
   serves prompts sharing those prefixes and loads them from the store (it fails
   loudly when the store is not hit). A's own, cold, TTFT is shown too.

Also printed: the store's bytes per token (bytes written / tokens of the written
blocks) and the tokens each hit replayed. The bundled model's position range is
1,024; when the prompt needs more, it runs with a longer range (its rope is the
default one, so that only extends the position table).

    .venv/bin/python benchmarks/kv_store.py [--model DIR] [--backend cpu] [--kv-cache-dtype auto] [--prefix-len 2000] [--suffix-len 16]
                                            [--repeats 3] [--store DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, add_json_flag, emit_json, model_dir, random_tokens

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from deepinfer.models.registry import parse_config

#: seconds one worker process may take
WORKER_TIMEOUT_S = 1800
WARMUP_TOKENS = 40
#: the engine counters a timed request's figures are read from (differences before and after)
COUNTERS = ("cached_tokens", "replayed_tokens", "computed_tokens", "kv_store_hit_tokens", "kv_store_bytes_read")


def _llm(path: Path, args, max_model_len: int, **kw) -> LLM:
    return LLM(model=str(path), backend=args.backend, kv_cache_memory=512 << 20, max_model_len=max_model_len, max_num_seqs=4,
               kv_cache_dtype=args.kv_cache_dtype, **kw)


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, min(vocab, 256) if vocab <= 512 else vocab)


def _prompt(vocab: int, prefix_len: int, prefix_seed: int, suffix_len: int, suffix_seed: int) -> list[int]:
    """The prefix named by ``prefix_seed`` followed by the suffix named by ``suffix_seed``."""
    return _tokens(vocab, prefix_len, prefix_seed) + _tokens(vocab, suffix_len, 10_000 + suffix_seed)


def ttft(llm: LLM, prompt: list[int]) -> dict:
    """Seconds until ``prompt``'s first token, and what the engine counted for it (cached, replayed, store tokens)."""
    before = llm.get_metrics()
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t = time.perf_counter()
    for out in llm.generate_stream(prompt, sp):
        if out.outputs and out.outputs[0].token_ids:
            break
    seconds = time.perf_counter() - t
    after = llm.get_metrics()
    return {"seconds": seconds, **{k: after[k] - before[k] for k in COUNTERS}}


def _warm_up(llm: LLM) -> None:
    """One short unrelated request, so that start-up work (first forward, allocations) is not timed."""
    ttft(llm, _tokens(llm.engine.vocab_size, WARMUP_TOKENS, 99_999))


def _summary(runs: list[dict]) -> dict:
    """The median TTFT of ``runs`` and the median of each counter."""
    out = {"ttft_ms": 1e3 * statistics.median(r["seconds"] for r in runs), "ttft_ms_each": [1e3 * r["seconds"] for r in runs]}
    out.update({k: statistics.median(r[k] for r in runs) for k in COUNTERS})
    return out


def no_cache(path: Path, args, max_model_len: int) -> dict:
    """Prefix caching off: every prompt is computed in full."""
    llm = _llm(path, args, max_model_len, enable_prefix_caching=False)
    _warm_up(llm)
    vocab = llm.engine.vocab_size
    runs = [ttft(llm, _prompt(vocab, args.prefix_len, 0, args.suffix_len, i)) for i in range(args.repeats)]
    llm.close()
    return _summary(runs)


def memory_hit(path: Path, args, max_model_len: int) -> tuple[dict, int]:
    """One engine serves the prefix once, then prompts sharing it with fresh suffixes; also its block size."""
    llm = _llm(path, args, max_model_len)
    _warm_up(llm)
    vocab = llm.engine.vocab_size
    ttft(llm, _prompt(vocab, args.prefix_len, 0, args.suffix_len, 1000))
    runs = [ttft(llm, _prompt(vocab, args.prefix_len, 0, args.suffix_len, i)) for i in range(args.repeats)]
    block_size = llm.engine.kv.block_size
    llm.close()
    return _summary(runs), block_size


def worker(mode: str, path: Path, args, max_model_len: int) -> dict:
    """One process of the store case: ``store-write`` serves prefixes 1..repeats and flushes the store,
    ``store-read`` (a fresh process) serves prompts sharing them with other suffixes."""
    llm = _llm(path, args, max_model_len, kv_store=args.store)
    _warm_up(llm)
    vocab = llm.engine.vocab_size
    suffix = 2000 if mode == "store-write" else 3000
    runs = [ttft(llm, _prompt(vocab, args.prefix_len, 1 + i, args.suffix_len, suffix + i)) for i in range(args.repeats)]
    llm.close()  # waits for the store's writes
    m = llm.get_metrics()
    return {"runs": runs, "block_size": llm.engine.kv.block_size, "block_bytes": llm.engine.store.block_bytes, **{k: v for k, v in m.items() if k.startswith("kv_store_")}}


def _run_worker(mode: str, path: Path, args, max_model_len: int, store: str) -> dict:
    """Run ``worker(mode)`` in a fresh process of this script and return its JSON line."""
    cmd = [sys.executable, __file__, "--worker", mode, "--model", str(path), "--backend", args.backend, "--store", store,
           "--prefix-len", str(args.prefix_len), "--suffix-len", str(args.suffix_len), "--repeats", str(args.repeats),
           "--max-model-len", str(max_model_len), "--kv-cache-dtype", args.kv_cache_dtype]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"the {mode} process ran past {WORKER_TIMEOUT_S} s") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"the {mode} process failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def store_hit(path: Path, args, max_model_len: int, store: str) -> tuple[dict, dict, dict]:
    """Process A writes the prefixes to ``store`` and exits; process B reads them. A's and B's figures,
    and the store's counters from both."""
    a = _run_worker("store-write", path, args, max_model_len, store)
    b = _run_worker("store-read", path, args, max_model_len, store)
    missed = [i for i, r in enumerate(b["runs"]) if r["kv_store_hit_tokens"] <= 0]
    if missed:
        raise SystemExit(
            f"no KV store hit in the fresh process for prompt(s) {missed}: kv_store_hit_tokens "
            f"{[r['kv_store_hit_tokens'] for r in b['runs']]}; store counters: A {_store_counters(a)}, B {_store_counters(b)}"
        )
    return _summary(a["runs"]), _summary(b["runs"]), {"write": _store_counters(a), "read": _store_counters(b)}


def _store_counters(w: dict) -> dict:
    return {k: v for k, v in w.items() if k.startswith("kv_store_") or k == "block_bytes"}


def _model_for(arg: str | None, need: int, tmp: Path) -> tuple[Path, Path, str]:
    """A model directory whose position range holds ``need`` tokens, the checkpoint it is, and a line saying so.
    The bundled model (``--model`` not given) gets a longer range in ``tmp`` when its own is short."""
    path = model_dir(arg)
    config = json.loads((path / "config.json").read_text())
    positions = config.get("max_position_embeddings", 1 << 20)
    line = f"model {path} ({config['num_hidden_layers']} layers)"
    if positions >= need:
        return path, path, line
    if arg is not None:
        raise SystemExit(f"{path} holds {positions} positions but the prompt needs {need}; lower --prefix-len / --suffix-len")
    view = tmp / path.name
    view.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (view / f.name).symlink_to(f.resolve())
    (view / "config.json").write_text(json.dumps({**config, "max_position_embeddings": need}, indent=2))
    return view, path, f"{line}, position range raised from {positions} to {need}"


def flash_bytes_per_token(block_size: int) -> tuple[dict[str, float], int]:
    """Bytes of compressed state per token one stored block of DeepSeek-V4-Flash holds (from its published
    config), by ``kv_cache_dtype``: ``model`` (bf16 rows) and ``fp8`` (its trained records, what ``auto`` picks for
    the release); and the block size its compress ratios make of ``block_size``."""
    import torch

    sys.path.insert(0, str(ROOT))
    from tests.helpers.published import V4_FLASH

    from deepinfer.models.common.cache_spec import CacheGeometry, block_size_for

    config = parse_config(V4_FLASH)
    block = block_size_for(config, block_size)
    return {kv: CacheGeometry.build(config, block, 8192, 1 << 20, kv).bytes_per_token(torch.bfloat16) for kv in ("model", "fp8")}, block


def _row(label: str, fig: dict, base: float) -> None:
    speedup = base / fig["ttft_ms"] if fig["ttft_ms"] else float("inf")
    print(f"{label:<30} {fig['ttft_ms']:>9.1f} {speedup:>10.2f}x {fig['cached_tokens']:>8.0f} {fig['replayed_tokens']:>9.0f}"
          f" {fig['computed_tokens']:>9.0f} {fig['kv_store_hit_tokens']:>11.0f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "model"], help="how the cache (and so the store) holds rows")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="prompts per situation; the median TTFT is shown")
    ap.add_argument("--store", default=None, help="an empty or new KV store directory (default: a temporary one)")
    ap.add_argument("--worker", choices=("store-write", "store-read"), help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    add_json_flag(ap)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.model), args, args.max_model_len)))
        return
    if args.store is not None and Path(args.store).exists() and any(Path(args.store).iterdir()):
        raise SystemExit(f"--store {args.store} is not empty: stored blocks would make the writing process hit; give a new directory")
    max_model_len = args.prefix_len + args.suffix_len + 8
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        path, source, line = _model_for(args.model, max_model_len, Path(tmp))
        print(line)
        cold = no_cache(path, args, max_model_len)
        memory, block_size = memory_hit(path, args, max_model_len)
        store = args.store or str(Path(tmp) / "store")
        written, read, counters = store_hit(path, args, max_model_len, store)
    wall = time.perf_counter() - t0

    print(f"== TTFT, {args.prefix_len}-token shared prefix + {args.suffix_len}-token suffix, backend {args.backend}, "
          f"block {block_size} tokens, median of {args.repeats}")
    print(f"{'situation':<30} {'TTFT ms':>9} {'vs no cache':>11} {'cached':>8} {'replayed':>9} {'computed':>9} {'store tokens':>11}")
    base = cold["ttft_ms"]
    _row("no cache", cold, base)
    _row("in-memory hit", memory, base)
    _row("store hit (other process)", read, base)
    _row("cold, writing the store (A)", written, base)
    w, r = counters["write"], counters["read"]
    stored_tokens = w["kv_store_blocks_written"] * block_size
    per_token = w["kv_store_bytes_written"] / stored_tokens if stored_tokens else float("nan")
    print(f"store: {w['kv_store_blocks_written']} blocks written ({stored_tokens} tokens, {w['kv_store_bytes_written']} bytes): "
          f"{per_token:.1f} bytes per token; read {r['kv_store_hit_blocks']} blocks ({r['kv_store_bytes_read']} bytes) in "
          f"{r['kv_store_hits']} hits, {r['kv_store_misses']} misses (warm-up included)")
    payload = read["kv_store_bytes_read"] / read["kv_store_hit_tokens"] if read["kv_store_hit_tokens"] else float("nan")
    flash, flash_block = flash_bytes_per_token(block_size)
    # a file's header and checksum grow with the layer count only, not with the block's tokens
    overhead = w["kv_store_bytes_written"] / max(w["kv_store_blocks_written"], 1) - w["block_bytes"]
    print(f"V4-Flash (published config, block {flash_block}): {flash['model']:,.0f} bytes of compressed state per token in bf16 rows, "
          f"{flash['fp8']:,.0f} as fp8 records (kv_cache_dtype auto for the release): {flash['model'] * 2000 / 1e6:.1f} / "
          f"{flash['fp8'] * 2000 / 1e6:.1f} MB for a 2,000-token prefix (each block file adds its header and checksum: {overhead:.0f} bytes here)")
    print(f"store hit vs in-memory hit: {read['ttft_ms'] / memory['ttft_ms']:.2f}x the TTFT; wall {wall:.1f} s")
    emit_json(args.json, {
        "benchmark": "kv_store", "model": str(source), "max_model_len": max_model_len, "backend": args.backend, "prefix_len": args.prefix_len,
        "suffix_len": args.suffix_len, "repeats": args.repeats, "block_size": block_size,
        "no_cache": cold, "memory_hit": memory, "store_hit": read, "store_write": written,
        "speedup_memory_hit": base / memory["ttft_ms"], "speedup_store_hit": base / read["ttft_ms"],
        "store_bytes_per_token": per_token, "store_read_bytes_per_token": payload, "kv_cache_dtype": args.kv_cache_dtype,
        "v4_flash_bytes_per_token": flash["model"], "v4_flash_bytes_per_token_fp8": flash["fp8"],
        "v4_flash_block_size": flash_block, "file_overhead_bytes_per_block": overhead, "store_counters": counters, "wall_seconds": wall,
    })


if __name__ == "__main__":
    main()

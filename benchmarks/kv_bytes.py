"""KV cache bytes per token by kv_cache_dtype: V4-Flash, V4.1-Flash and the bundled model, and decode at long context.

For each model and ``kv_cache_dtype`` (model, fp8, auto) the cache geometry's
figures, the ones the engine's planner budgets and ``deepinfer inspect``
prints: compressed state per token of context by cache kind and in total, the
window rows (bytes per token row over every layer, and per sequence slot with
the compressor states, rings sized for the engine's default step), and how many
sequences of 128K and 1M tokens a budget of ``--budget-gib`` holds (each
sequence its slot's rings and the blocks of its context), side by side with the
ratio to the model dtype. The releases (V4-Flash, V4.1-Flash, from their
published config.json) hold plain rows in bf16 and ``auto`` resolves to the
records they were trained with; the bundled model runs in float32 and, being
unquantized, keeps plain rows under ``auto``.

Then, measured on this machine: the mean decode step of one sequence at
``--context`` tokens with ``model`` and with ``fp8``, on a tiny random config with
V4-Flash's compress ratios (4 and 128) and a million-token position range
(``tests/helpers/checkpoints.py``'s ``long_context``), and their ratio. On the
CPU reference a packed cache gathers fewer bytes per step and decodes them
(more arithmetic), so the ratio is this machine's, not an accelerator's.

    .venv/bin/python benchmarks/kv_bytes.py [--budget-gib 64] [--context 4096] [--steps 8] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import add_json_flag, emit_json  # noqa: E402
from deepinfer.engine import BUNDLED_MODEL  # noqa: E402
from deepinfer.kv_memory import default_step_tokens, kv_memory  # noqa: E402
from deepinfer.loader import read_config  # noqa: E402
from deepinfer.models.common.cache_spec import CacheGeometry, block_size_for  # noqa: E402
from deepinfer.models.registry import parse_config  # noqa: E402
from tests.helpers.published import V4_FLASH, V41_FLASH  # noqa: E402

KV_CACHE_DTYPES = ("model", "fp8", "auto")
CONTEXTS = {"128K": 128 * 1024, "1M": 1 << 20}
GIB = 1 << 30


def models() -> dict[str, tuple[dict, torch.dtype]]:
    """Each model's config.json and the dtype its plain rows are held in."""
    return {"V4-Flash": (dict(V4_FLASH), torch.bfloat16), "V4.1-Flash": (dict(V41_FLASH), torch.bfloat16),
            "bundled": (read_config(BUNDLED_MODEL), torch.float32)}


def sequences_that_fit(geometry: CacheGeometry, dtype: torch.dtype, context: int, budget: int) -> int:
    """Sequences of ``context`` tokens a budget holds: each its slot's rings and its context's blocks."""
    per_sequence = geometry.bytes_per_slot(dtype) + geometry.blocks_for(context) * geometry.bytes_per_block(dtype)
    return budget // per_sequence


def model_figures(raw: dict, dtype: torch.dtype, budget: int) -> dict[str, dict]:
    """Per kv_cache_dtype: bytes per token by kind and in total, window rows, and sequences that fit."""
    config = parse_config(raw)
    out = {}
    for kv in KV_CACHE_DTYPES:
        mem = kv_memory(config, kv, dtype)
        geometry = CacheGeometry.build(config, block_size_for(config, 16), default_step_tokens(), config.max_position_embeddings, kv)
        fits = {label: sequences_that_fit(geometry, dtype, n, budget) for label, n in CONTEXTS.items() if n <= config.max_position_embeddings}
        out[kv] = {**mem.as_dict(), "sequences": fits}
    return out


def print_model(name: str, figures: dict[str, dict], budget_gib: float) -> None:
    base = figures["model"]
    print(f"\n{name}: " + "; ".join(f"{kv} -> {f['storage']}" for kv, f in figures.items() if kv != "model"))
    print(f"  {'bytes per token':<36}" + "".join(f"{kv:>14}" for kv in KV_CACHE_DTYPES) + f"{'fp8 / model':>14}")
    for kind, n in base["by_kind"].items():
        if n:
            print(f"    {kind:<34}" + "".join(f"{figures[kv]['by_kind'][kind]:>14,.2f}" for kv in KV_CACHE_DTYPES)
                  + f"{figures['fp8']['by_kind'][kind] / n:>14.3f}")
    print(f"    {'total (compressed state)':<34}" + "".join(f"{figures[kv]['total']:>14,.2f}" for kv in KV_CACHE_DTYPES)
          + f"{figures['fp8']['total'] / base['total']:>14.3f}")
    row = base["window"]["bytes_per_row"]
    print(f"    {'window rows, per token row':<34}" + "".join(f"{figures[kv]['window']['bytes_per_row']:>14,}" for kv in KV_CACHE_DTYPES)
          + f"{figures['fp8']['window']['bytes_per_row'] / row:>14.3f}")
    slot = base["ring_bytes_per_slot"]
    print(f"  {'rings per sequence slot (MB)':<36}" + "".join(f"{figures[kv]['ring_bytes_per_slot'] / 1e6:>14,.2f}" for kv in KV_CACHE_DTYPES)
          + f"{figures['fp8']['ring_bytes_per_slot'] / slot:>14.3f}")
    for label in base["sequences"]:
        n = base["sequences"][label]
        ratio = figures["fp8"]["sequences"][label] / n if n else float("inf")
        print(f"  {f'sequences of {label} in {budget_gib:g} GiB':<36}" + "".join(f"{figures[kv]['sequences'][label]:>14,}" for kv in KV_CACHE_DTYPES)
              + f"{ratio:>14.2f}")


def decode_step_ms(ckpt: Path, kv: str, context: int, steps: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean decode step of one sequence whose prompt is ``context`` tokens."""
    from deepinfer import LLM, SamplingParams
    from tests.helpers.checkpoints import byte_tokens

    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_dtype=kv, max_model_len=context + steps + 16, max_num_seqs=1,
              kv_cache_memory=256 << 20, speculative_method=None, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    times = []
    for r in range(repeats):
        out = llm.generate([byte_tokens(context, seed=r)], params, use_tqdm=False)[0]
        times.append(1e3 * out.metrics.time_per_output_token)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-gib", type=float, default=64.0, help="KV budget the sequence counts are for")
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens before the measured decode steps")
    ap.add_argument("--steps", type=int, default=8, help="decode steps measured per run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per kv_cache_dtype (the median is shown)")
    ap.add_argument("--no-decode", action="store_true", help="the analytic figures only")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    budget = int(args.budget_gib * GIB)
    started = time.perf_counter()
    figures = {name: model_figures(raw, dtype, budget) for name, (raw, dtype) in models().items()}
    for name, f in figures.items():
        print_model(name, f, args.budget_gib)
    decode: dict = {}
    if not args.no_decode:
        from tests.helpers.checkpoints import make_tiny_checkpoint

        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = make_tiny_checkpoint(Path(tmp), "long_context")
            ms = {kv: decode_step_ms(ckpt, kv, args.context, args.steps, args.repeats) for kv in ("model", "fp8")}
        decode = {"context": args.context, "steps": args.steps, "repeats": args.repeats, "threads": torch.get_num_threads(),
                  "step_ms": ms, "fp8_over_model": ms["fp8"] / ms["model"]}
        print(f"\ndecode at {args.context:,} tokens of context (tiny long_context config, CPU reference, {torch.get_num_threads()} threads, "
              f"median of {args.repeats} runs of {args.steps} steps): model {ms['model']:.2f} ms/step, fp8 {ms['fp8']:.2f} ms/step, "
              f"fp8 / model {ms['fp8'] / ms['model']:.2f}x")
    wall = time.perf_counter() - started
    print(f"wall {wall:.1f} s")
    emit_json(args.json, {"benchmark": "kv_bytes", "budget_gib": args.budget_gib, "models": figures, "decode": decode, "wall_seconds": wall})


if __name__ == "__main__":
    main()

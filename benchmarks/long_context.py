"""Long-context prefill: seconds per chunk and peak memory against the context length, and what a
prefix hit replays (bounded against exact) at long contexts, on a tiny random config with a
million-token position range and V4-Flash's compress ratios (4 and 128).

Each measurement is one process (``tests/helpers/long_prefill.py``): the engine prefills one
random prompt in chunks of 8,192 tokens with the KV budget fixed for every length, then runs the
prompt plus its first token, which hits the prefix cache and replays the sliding-window state.
Printed per context: the last chunk's seconds (the cost of a chunk at that depth), the mean chunk,
the peak RSS and its growth over the loaded engine; per replay context: tokens replayed and
seconds of the hit, bounded and exact. ``--svg FILE`` also draws seconds per chunk and peak RSS
against the context length.

The indexer's work is quadratic in the context (every token scores every entry it sees), so on
the CPU reference 1M tokens take about half an hour of the tiny config; pass ``--contexts`` to
choose (a prompt needs three positions to spare: 1,046,528 is the largest round one under 2^20).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import add_json_flag, emit_json  # noqa: E402
from tests.helpers.checkpoints import make_tiny_checkpoint  # noqa: E402

K = 1024


def measure(ckpt: Path, tokens: int, replay: str, max_model_len: int, kv_budget: int, backend: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "tests.helpers.long_prefill", str(ckpt), str(tokens), str(out), "--replay", replay,
               "--max-model-len", str(max_model_len), "--kv-budget", str(kv_budget), "--backend", backend]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"the {tokens}-token run failed: {proc.stderr.strip().splitlines()[-1]}")
        return json.loads(out.read_text())


def svg(points: list[dict], path: Path) -> None:
    """Two panels, context length (log scale) on x: seconds of the last chunk, and peak RSS in MiB."""
    import math

    width, height, pad = 360, 240, 44
    xs = [math.log2(p["tokens"]) for p in points]
    panels = [("seconds per chunk", [p["last_chunk_s"] for p in points]), ("peak RSS (MiB)", [p["peak_rss_mib"] for p in points])]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height}" font-family="sans-serif" font-size="11">']
    for i, (title, ys) in enumerate(panels):
        x0 = i * width
        lo_x, hi_x = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        hi_y = max(ys) * 1.1 or 1.0

        def at(x: float, y: float) -> tuple[float, float]:
            return x0 + pad + (x - lo_x) / (hi_x - lo_x) * (width - 2 * pad), height - pad - y / hi_y * (height - 2 * pad)

        line = " ".join("%.1f,%.1f" % at(x, y) for x, y in zip(xs, ys))
        parts.append(f'<text x="{x0 + width / 2}" y="16" text-anchor="middle">{title}</text>')
        parts.append(f'<line x1="{x0 + pad}" y1="{height - pad}" x2="{x0 + width - pad}" y2="{height - pad}" stroke="black"/>')
        parts.append(f'<line x1="{x0 + pad}" y1="{pad}" x2="{x0 + pad}" y2="{height - pad}" stroke="black"/>')
        parts.append(f'<polyline points="{line}" fill="none" stroke="steelblue" stroke-width="2"/>')
        for x, y, p in zip(xs, ys, points):
            cx, cy = at(x, y)
            parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="steelblue"/>')
            parts.append(f'<text x="{cx:.1f}" y="{height - pad + 14}" text-anchor="middle">{p["tokens"] // K}K</text>')
            parts.append(f'<text x="{cx:.1f}" y="{cy - 6:.1f}" text-anchor="middle">{y:.3g}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="8192,32768,131072", help="prompt lengths, comma-separated (e.g. add 524288,1048576)")
    ap.add_argument("--replay-contexts", default="102400", help="prompt lengths whose prefix hit is measured bounded and exact")
    ap.add_argument("--kv-budget", type=int, default=256 << 20, help="KV cache bytes, the same for every length")
    ap.add_argument("--backend", default="cpu", help="the engine's backend (peak RSS is host memory)")
    ap.add_argument("--svg", type=Path, help="write the plot here")
    add_json_flag(ap)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",") if c]
    replays = [int(c) for c in args.replay_contexts.split(",") if c]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp), "long_context")
        # room for the prompt, its two tokens and the hit's one, within the model's position range
        limit = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
        max_model_len = min(max(contexts + replays) + 1024, limit)
        points = []
        print(f"{'context':>9} {'chunks':>6} {'last chunk s':>12} {'mean chunk s':>12} {'peak RSS MiB':>12} {'growth MiB':>10} "
              f"{'exact hit s':>11}")
        for n in contexts:
            r = measure(ckpt, n, "exact", max_model_len, args.kv_budget, args.backend)
            chunks = r["step_s"][:-1]  # the last step decodes the second token
            point = dict(tokens=n, chunks=len(chunks), last_chunk_s=chunks[-1], mean_chunk_s=sum(chunks) / len(chunks),
                         prefill_s=sum(chunks), peak_rss_mib=r["peak_rss_mib"], growth_mib=r["peak_rss_mib"] - r["rss_before_mib"],
                         exact_hit_replayed=r["hit_replayed_tokens"], exact_hit_s=r["hit_s"], exact_hit_same_token=r["hit_token"] == r["generated"][1])
            points.append(point)
            print(f"{n:>9} {point['chunks']:>6} {point['last_chunk_s']:>12.3f} {point['mean_chunk_s']:>12.3f} "
                  f"{point['peak_rss_mib']:>12.1f} {point['growth_mib']:>10.1f} {point['exact_hit_s']:>11.3f}")
        print(f"\n{'context':>9} {'replay':>7} {'cached':>8} {'replayed':>8} {'hit s':>8} {'same token':>10}")
        hits = []
        for n in replays:
            row = {}
            for mode in ("bounded", "exact"):
                r = measure(ckpt, n, mode, max_model_len, args.kv_budget, args.backend)
                row[mode] = dict(cached=r["hit_cached_tokens"], replayed=r["hit_replayed_tokens"], hit_s=r["hit_s"],
                                 prefill_s=r["prefill_s"], same_token=r["hit_token"] == r["generated"][1])
                h = row[mode]
                print(f"{n:>9} {mode:>7} {h['cached']:>8} {h['replayed']:>8} {h['hit_s']:>8.3f} {str(h['same_token']):>10}")
            hits.append(dict(tokens=n, **row))
    if len(points) > 1:
        a, b = points[0], points[-1]
        print(f"\npeak RSS {b['peak_rss_mib'] / a['peak_rss_mib']:.3f}x at {b['tokens'] // a['tokens']}x the context; "
              f"last chunk {b['last_chunk_s'] / a['last_chunk_s']:.1f}x")
    if args.svg:
        svg(points, args.svg)
        print(f"plot: {args.svg}")
    emit_json(args.json, {"prefill": points, "replay": hits})


if __name__ == "__main__":
    main()

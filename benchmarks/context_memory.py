"""What a long prompt's prefill adds to the process's peak memory outside the KV pools, per context token.

Each context length runs in its own process (``tests/helpers/long_prefill.py``) on the ``long_context``
tiny config with the KV budget fixed, so the pools are the same size at every length: the engine loads,
the high-water mark is reset (``/proc/self/clear_refs``), and one random prompt is prefilled in chunks of
8,192 tokens. Printed per length: the resident memory before the prompt, the peak during it, their
difference (the growth) and the prefill's seconds; then, between consecutive lengths, the growth's slope
in bytes per extra context token. Lengths above the chunk show the per-token slope (below it a chunk's
own working set still grows with the prompt). ``--repeats N`` runs each length N times and reports the
median growth (the high-water mark is noisy by a few MiB). ``--json`` prints every figure as one JSON
object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import add_json_flag, emit_json  # noqa: E402
from tests.helpers.checkpoints import make_tiny_checkpoint  # noqa: E402
from tests.helpers.long_prefill import CHUNK, MAX_MODEL_LEN  # noqa: E402

MIB = 1 << 20


def run_once(ckpt: Path, tokens: int, max_model_len: int) -> dict:
    """One prefill of ``tokens`` tokens in a fresh process: its report from ``long_prefill``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "tests.helpers.long_prefill", str(ckpt), str(tokens), str(out),
               "--max-model-len", str(max_model_len)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"the {tokens}-token run failed: {proc.stderr.strip().splitlines()[-1]}")
        return json.loads(out.read_text())


def measure(ckpt: Path, tokens: int, repeats: int, max_model_len: int) -> dict:
    """The median growth of ``repeats`` runs of one length, with its spread and the median run's figures."""
    runs = [run_once(ckpt, tokens, max_model_len) for _ in range(repeats)]
    runs.sort(key=lambda r: r["peak_rss_mib"] - r["rss_before_mib"])
    growths = [r["peak_rss_mib"] - r["rss_before_mib"] for r in runs]
    mid = runs[len(runs) // 2]
    return dict(tokens=tokens, rss_before_mib=mid["rss_before_mib"], peak_rss_mib=mid["peak_rss_mib"],
                growth_mib=statistics.median(growths), growth_min_mib=growths[0], growth_max_mib=growths[-1],
                prefill_s=statistics.median(r["prefill_s"] for r in runs))


def slopes(points: list[dict]) -> list[dict]:
    """Bytes of growth per extra context token between each pair of consecutive lengths."""
    out = []
    for a, b in zip(points, points[1:]):
        out.append(dict(from_tokens=a["tokens"], to_tokens=b["tokens"],
                        bytes_per_token=(b["growth_mib"] - a["growth_mib"]) * MIB / (b["tokens"] - a["tokens"])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384,65536,131072", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=1, help="runs per length (the median growth is reported)")
    add_json_flag(ap)
    args = ap.parse_args()
    contexts = sorted(int(c) for c in args.contexts.split(",") if c)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp), "long_context")
        # one length limit for every run (it sizes the engine's tables), with room for the generated tokens
        limit = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
        max_model_len = min(max(max(contexts) + 1024, MAX_MODEL_LEN), limit)
        print(f"{'context':>9} {'RSS before MiB':>14} {'peak MiB':>9} {'growth MiB':>10} {'(min-max)':>13} {'prefill s':>9}")
        points = []
        for n in contexts:
            p = measure(ckpt, n, args.repeats, max_model_len)
            points.append(p)
            spread = f"{p['growth_min_mib']:.1f}-{p['growth_max_mib']:.1f}"
            print(f"{n:>9} {p['rss_before_mib']:>14.1f} {p['peak_rss_mib']:>9.1f} {p['growth_mib']:>10.1f} {spread:>13} "
                  f"{p['prefill_s']:>9.2f}")
    steps = slopes(points)
    if steps:
        print(f"\n{'from':>9} {'to':>9} {'bytes per extra context token':>30}")
        for s in steps:
            print(f"{s['from_tokens']:>9} {s['to_tokens']:>9} {s['bytes_per_token']:>30.0f}")
    above = [p for p in points if p["tokens"] > CHUNK]
    overall = slopes([above[0], above[-1]])[0] if len(above) > 1 else None
    if overall is not None:
        print(f"\nabove the {CHUNK}-token chunk, {overall['from_tokens']} to {overall['to_tokens']} tokens: "
              f"{overall['bytes_per_token']:.0f} bytes per context token")
    emit_json(args.json, {"points": points, "slopes": steps, "slope_above_chunk": overall})


if __name__ == "__main__":
    main()

"""Weight memory of DeepSeek-V4-Flash held quantized (FP8 linears, FP4 experts) against dequantized to bf16.

Builds the model on the meta device from the release's config.json (what
``deepinfer inspect`` does), so nothing is downloaded; prints both side by
side, by kind and for the largest rank at each expert-parallel degree.

    .venv/bin/python benchmarks/weight_memory.py [--model DIR] [--ep 1 8 16] [--json]

Without ``--model`` it writes the published V4-Flash config.json to a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from common import ROOT, add_json_flag, emit_json

from deepinfer.weight_memory import weight_memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory (only config.json and the index are read)")
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 8, 16])
    add_json_flag(ap)
    args = ap.parse_args()
    if args.model:
        directory = Path(args.model)
    else:
        sys.path.insert(0, str(ROOT))
        from tests.helpers.published import V4_FLASH

        directory = Path(tempfile.mkdtemp())
        (directory / "config.json").write_text(json.dumps(V4_FLASH))

    figures: dict = {"model": str(args.model or "DeepSeek-V4-Flash (published config)"), "ep": {}}
    print(f"{'':<22}{'quantized':>14}{'bf16':>14}{'ratio':>8}")
    for ep in args.ep:
        q = weight_memory(directory, ep=ep, dtype=torch.bfloat16, quantization="auto")
        d = weight_memory(directory, ep=ep, dtype=torch.bfloat16, quantization="dequantize")
        if ep == args.ep[0]:
            for kind in q.by_kind:
                print(f"{kind:<22}{q.by_kind[kind] / 1e9:>11.2f} GB{d.by_kind[kind] / 1e9:>11.2f} GB")
            print(f"{'total':<22}{q.total_bytes / 1e9:>11.2f} GB{d.total_bytes / 1e9:>11.2f} GB{d.total_bytes / q.total_bytes:>7.2f}x")
            figures.update(quantized=q.as_dict(), dequantized=d.as_dict(), ratio=d.total_bytes / q.total_bytes)
        print(f"{f'largest rank, ep={ep}':<22}{q.per_rank_bytes / 1e9:>11.2f} GB{d.per_rank_bytes / 1e9:>11.2f} GB"
              f"{d.per_rank_bytes / q.per_rank_bytes:>7.2f}x")
        figures["ep"][ep] = {"quantized_per_rank_bytes": q.per_rank_bytes, "dequantized_per_rank_bytes": d.per_rank_bytes}
    emit_json(args.json, figures)


if __name__ == "__main__":
    main()

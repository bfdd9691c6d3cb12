"""DeepSeek V4.1 decode steps with Engram layers, eager and replayed from a captured graph, per table placement.

A V4.1 checkpoint of about the bundled model's width (hidden 128, two streams,
the tiny V4.1 layer schedule of eight layers with Engram on layers 1 and 4,
tables of ~400K rows each) is written to a temporary directory; for each table
placement the device allows (``EngineConfig.engram_tables``) and each batch
size, the mean time of a decode step (the forward alone, over prepared inputs)
eager and as a graph replay, and their ratio. On the CPU the tables stay
mapped (the CPU reads them in place) and a graph is an inductor compile; on a
CUDA device ``host`` reads them from pinned host memory inside the CUDA graph,
``device`` copies them into GPU memory, and ``mapped`` (eager only: each
lookup gathers on the host) is the path graphs replace.

    .venv/bin/python benchmarks/engram_graphs.py [--backend cpu|cuda] [--batch-sizes 1 8] [--json]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, add_json_flag, emit_json, load_script

from deepinfer.registry import select_backend

#: the bundled model's widths on the tiny V4.1 layer schedule, and Engram tables of realistic row counts
BUNDLED_SIZE = dict(
    hidden_size=128, moe_intermediate_size=128, q_lora_rank=64, o_lora_rank=64, hc_mult=2, sliding_window=32,
    index_topk=16, engram_vocab_size=65536,
)


def placements_for(device) -> list[str]:
    """The placements worth timing on ``device``: what the CPU reads in place, or each accelerator choice."""
    if device.type == "cpu":
        return ["mapped"]
    probe = device.map_host(torch.zeros(1))
    return ["mapped", *(["host"] if probe is not None else []), "device"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=256, help="context bucket of the decode steps (tokens)")
    ap.add_argument("--reps", type=int, default=30)
    add_json_flag(ap)
    args = ap.parse_args(argv)
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.helpers.tiny_v41 import write_tiny_v41
    from deepinfer.models.deepseek_v41.model import DeepseekV41Model

    steps = load_script("decode_steps")
    selected = select_backend(args.backend)
    device = selected.device
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    path = write_tiny_v41(Path(tempfile.mkdtemp()) / "v41-bundled-size", **BUNDLED_SIZE)
    print(f"V4.1 at the bundled width ({path}), backend {selected.name} ({device.describe()}), {dtype}, "
          f"context {args.context}, threads {torch.get_num_threads()}")
    rows = []
    for placement in placements_for(device):
        model = DeepseekV41Model.from_pretrained(path, selected.kernels, dtype=dtype, device=device.torch_device)
        print(f"  {model.place_tables(device, placement)}")
        blocker = model.graph_blocker()
        for b in args.batch_sizes:
            cache, inputs = steps.decode_setup(model, device, b, args.context)

            def step():
                return model.forward(inputs, cache)

            with torch.inference_mode():
                eager_ms = steps.mean_ms(step, device, args.reps)
            row = {"placement": placement, "batch_size": b, "eager_ms": eager_ms}
            line = f"{placement:>7} batch {b:>3}: eager {eager_ms:7.2f} ms/step"
            if blocker is None:
                t = time.perf_counter()
                replay = device.capture_graph(step, device.new_graph_pool())
                row["capture_seconds"] = time.perf_counter() - t
                row["graph_ms"] = steps.mean_ms(replay, device, args.reps)
                row["eager_over_graph"] = eager_ms / row["graph_ms"]
                with torch.inference_mode():
                    eager_logits = step().float()
                diff = (replay().float() - eager_logits).abs().max().item()
                row["max_logit_diff"] = diff
                line += (f" | graph {row['graph_ms']:7.2f} ms/step | {row['eager_over_graph']:.2f}x"
                         f" | capture {row['capture_seconds']:.1f} s | max |logit diff| {diff:.1e}")
            else:
                row["graph_blocker"] = blocker
                line += " | no graph (the lookup gathers on the host)"
            rows.append(row)
            print(line)
    emit_json(args.json, {"benchmark": "engram_graphs", "backend": selected.name, "device": device.describe(),
                          "dtype": str(dtype).removeprefix("torch."), "context": args.context, "results": rows})


if __name__ == "__main__":
    main()

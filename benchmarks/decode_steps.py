"""Decode steps eager and replayed from captured graphs: step time, and launches per step by layer type.

For each batch size, on the chosen backend: the mean time of a decode step
(the forward alone, over prepared inputs) eager and as a graph replay, and how
many operations the host issues per step. Eager, that is the aten ops
dispatched (each one a kernel launch on an accelerator), counted per layer of
each attention type and for the rest of the step (embedding, metadata, head).
Replayed, a CUDA or NPU graph is one launch; a CPU graph (inductor) calls its
fused kernels plus the matmuls it leaves to aten, counted the same way over a
graph of one layer. Also what capturing cost at start-up.

    .venv/bin/python benchmarks/decode_steps.py [--backend cpu] [--model DIR] [--batch-sizes 1 16 64] [--json]

On the CPU, graphs compile with inductor (seconds each with a warm cache,
about a minute cold).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from common import add_json_flag, emit_json, model_dir
from torch.profiler import ProfilerActivity, profile

from deepinfer.models.common import Batch, ContiguousCache, StepLayout, StepShape
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.common.inputs import fill_step_inputs
from deepinfer.models.common.metadata import build_layer_metas
from deepinfer.registry import select_backend


def host_ops(fn, device) -> int:
    """Operations the host issues for one call of ``fn``: top-level aten ops and compiled kernels."""
    activities = [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        fn()
        device.synchronize()
    events = prof.events()
    top = [e for e in events if (e.name.startswith("aten::") or "cpp_fused" in e.name or "triton_" in e.name)
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return len(top)


def mean_ms(fn, device, reps: int) -> float:
    for _ in range(3):
        fn()
    device.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    device.synchronize()
    return 1e3 * (time.perf_counter() - t) / reps


def inductor_kernels() -> int:
    """Kernels inductor generated so far in this process (0 if unknown)."""
    try:
        from torch._inductor import metrics

        return int(metrics.generated_kernel_count)
    except Exception:
        return 0


def decode_setup(model, device, batch_size: int, context: int):
    """A prefilled cache and the static inputs of one decode step for ``batch_size`` sequences."""
    cache = ContiguousCache(model.config, batch_size, context, dtype=model.dtype, device=device.torch_device)
    slots = [cache.allocate() for _ in range(batch_size)]
    prompt = context // 2
    model(Batch.build([[(i * 31 + j) % 200 + 3 for j in range(prompt)] for i in range(batch_size)], slots, [0] * batch_size), cache)
    batch = Batch.build([[5 + i] for i in range(batch_size)], slots, [prompt] * batch_size)
    layout = StepLayout(StepShape.padded(batch_size, batch_size, batch_size, context, cache.geometry), cache.geometry)
    host = np.empty(layout.numel, dtype=np.int64)
    fill_step_inputs(host, layout, batch, cache)
    inputs = layout.forward_inputs(torch.from_numpy(host).to(device.torch_device))
    return cache, inputs


def per_layer_type(model, cache, inputs, device, graphs: bool) -> dict[str, dict[str, int]]:
    """Host launches of one layer of each attention type (eager, and as a captured graph)."""
    metas = build_layer_metas(inputs, cache.geometry, model.rope_main, model.rope_compress)
    x = model.embed[inputs.input_ids]
    streams = x[:, None, :].expand(-1, model.config.hc_mult, -1).contiguous()
    out: dict[str, dict[str, int]] = {}
    for layer in model.layers:
        lt = layer.layer_type
        if lt in out:
            continue

        def one(layer=layer, meta=metas[lt]):
            return layer(model.kernels, streams, inputs.input_ids, meta, cache)

        with torch.inference_mode():
            out[lt] = {"eager": host_ops(one, device)}
        if graphs:
            before = inductor_kernels()
            replay = device.capture_graph(one, device.new_graph_pool())
            fused = inductor_kernels() - before
            launches = 1 if device.capabilities().asynchronous else host_ops(replay, device) + fused
            out[lt]["graph"] = launches
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=256, help="context bucket of the decode steps (tokens)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-graphs", action="store_true", help="eager only")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    selected = select_backend(args.backend)
    device = selected.device
    dtype = {"auto": torch.float32 if device.type == "cpu" else torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    path = model_dir(args.model)
    model = DeepseekV4Model.from_pretrained(path, selected.kernels, dtype=dtype, device=device.torch_device)
    graphs = not args.no_graphs and device.capabilities().graph_capture
    print(f"model {path}, backend {selected.name} ({device.describe()}), {dtype}, context {args.context}, threads {torch.get_num_threads()}")
    rows = []
    for b in args.batch_sizes:
        cache, inputs = decode_setup(model, device, b, args.context)

        def step():
            return model.forward(inputs, cache)

        with torch.inference_mode():
            eager_ms = mean_ms(step, device, args.reps)
            eager_ops = host_ops(step, device)
        row = {"batch_size": b, "eager_ms": eager_ms, "eager_host_ops": eager_ops}
        if graphs:
            t = time.perf_counter()
            free0, _ = device.memory_info()
            before = inductor_kernels()
            replay = device.capture_graph(step, device.new_graph_pool())
            row["capture_seconds"] = time.perf_counter() - t
            row["capture_bytes"] = max(0, free0 - device.memory_info()[0])
            fused = inductor_kernels() - before
            row["graph_ms"] = mean_ms(replay, device, args.reps)
            row["graph_host_ops"] = 1 if device.capabilities().asynchronous else host_ops(replay, device) + fused
            row["speedup"] = eager_ms / row["graph_ms"]
        row["per_layer_type"] = per_layer_type(model, cache, inputs, device, graphs)
        rows.append(row)
        line = f"batch {b:>3}: eager {eager_ms:7.2f} ms/step, {eager_ops} host ops"
        if graphs:
            line += (f" | graph {row['graph_ms']:7.2f} ms/step, {row['graph_host_ops']} host launches"
                     f" | {row['speedup']:.2f}x | capture {row['capture_seconds']:.1f} s")
        print(line)
        for lt, counts in row["per_layer_type"].items():
            print(f"    {lt:<32} eager {counts['eager']:>5} ops" + (f" | graph {counts['graph']:>4} launches" if "graph" in counts else ""))
    emit_json(args.json, {"benchmark": "decode_steps", "backend": selected.name, "model": str(path), "dtype": str(dtype).removeprefix("torch."),
                          "context": args.context, "results": rows})


if __name__ == "__main__":
    main()

"""Microbenchmark: the CUDA backend's Triton kernels against the torch reference, side by side.

For each op and shape it prints the median time of both, the achieved rate of
each and the speed-up, plus the largest difference between the two outputs as
a sanity check. Memory-bound ops (rms_norm, rope, sparse attention at decode,
mhc_pre) report GB/s: the bytes the op must move (inputs read once, gathered
rows counted once per token that reads them, the output written once), to
hold against the GPU's peak bandwidth. The grouped expert matmul reports
TFLOP/s (``6·pairs·I·D``: two matmuls, gate and up then down).

Runs only where a CUDA device and Triton exist; elsewhere it says why and exits 0.

    python benchmarks/cuda_kernels.py [--dtype bfloat16] [--ops rms_norm,rope,...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Row:
    op: str
    shape: str
    #: bytes moved (unit GB/s) or flops done (unit TFLOP/s) by one call
    work: float
    triton_ms: float
    torch_ms: float
    max_diff: float
    unit: str = "GB/s"

    def rate(self, ms: float) -> float:
        return self.work / (ms * 1e-3) / (1e12 if self.unit == "TFLOP/s" else 1e9)


def _why_not_runnable() -> str | None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set; the interpreter's timings mean nothing (unset it)"
    from deepinfer_cuda.device import CUDADevice

    ok, reason = CUDADevice.is_available()
    if not ok:
        return reason
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'deepinfer[cuda]')"
    return None


def _time(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def bench_rms_norm(dtype: torch.dtype, quick: bool) -> list[Row]:
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_interfaces import Kernels

    fast, ref = CUDAKernels(), Kernels()
    es = torch.finfo(dtype).bits // 8
    # hidden-size norms at decode and prefill batch sizes, and the per-head norm over [tokens·heads, 512]
    shapes = [(1, 4096), (64, 4096), (4096, 4096), (16384, 4096), (64, 7168), (8192, 7168), (8192 * 16, 512)]
    if quick:
        shapes = shapes[1:3]
    rows = []
    for n, d in shapes:
        x = torch.randn(n, d, device="cuda", dtype=dtype)
        w = torch.randn(d, device="cuda", dtype=torch.float32)
        moved = 2 * n * d * es + d * 4
        rows.append(
            Row(
                "rms_norm", f"[{n}, {d}]", moved,
                _time(lambda: fast.rms_norm(x, w, 1e-6)), _time(lambda: ref.rms_norm(x, w, 1e-6)),
                _diff(fast.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)),
            )
        )
    return rows


def bench_rope(dtype: torch.dtype, quick: bool) -> list[Row]:
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_interfaces import Kernels

    fast, ref = CUDAKernels(), Kernels()
    es = torch.finfo(dtype).bits // 8
    rope_dim = 64
    # queries [T, H, 512] with a 64-channel rope tail, and the single shared key/value head [T, 512]
    shapes = [(1, 64), (64, 64), (1024, 64), (8192, 64), (1, 0), (8192, 0), (65536, 0)]
    if quick:
        shapes = [(64, 64), (8192, 0)]
    rows = []
    for tokens, heads in shapes:
        shape = (tokens, heads, 512) if heads else (tokens, 512)
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        pos = torch.arange(tokens, device="cuda", dtype=torch.float32)
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rope_dim, 2, device="cuda", dtype=torch.float32) / rope_dim)
        ang = pos[:, None] * inv_freq
        cos, sin = ang.cos(), ang.sin()
        moved = 2 * x.numel() * es + 2 * cos.numel() * 4
        rows.append(
            Row(
                "rope", str(list(shape)), moved,
                _time(lambda: fast.rope(x, cos, sin)), _time(lambda: ref.rope(x, cos, sin)),
                _diff(fast.rope(x, cos, sin), ref.rope(x, cos, sin)),
            )
        )
    return rows


def bench_sparse_attention(dtype: torch.dtype, quick: bool) -> list[Row]:
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_interfaces import Kernels

    fast, ref = CUDAKernels(), Kernels()
    es = torch.finfo(dtype).bits // 8
    heads, dim = 64, 512
    # V4-Flash: 64 heads of 512, one shared K=V head; a token attends to its 128-token window plus
    # 512 indexer picks (CSA) -- decode batches of 1 to 256 tokens, and a prefill chunk
    shapes = [(1, 640), (16, 640), (64, 640), (256, 640), (64, 2176), (1024, 640)]
    if quick:
        shapes = [(64, 640), (1024, 640)]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens, k in shapes:
        # every token reads its own rows (a pool of distinct rows), as decode of separate sequences does
        pool = torch.randn(tokens * k, dim, device="cuda", dtype=dtype)
        idx = torch.randperm(tokens * k, device="cuda", generator=g).view(tokens, k)
        idx[:, -k // 8 :] = -1  # some padding, as short sequences have
        q = torch.randn(tokens, heads, dim, device="cuda", dtype=dtype)
        sinks = torch.randn(heads, device="cuda")
        scale = dim**-0.5
        moved = tokens * k * (dim * es + 8) + 2 * q.numel() * es
        run_fast = lambda: fast.sparse_attention(q, pool, idx, sinks, scale)  # noqa: E731
        run_ref = lambda: ref.sparse_attention(q, pool, idx, sinks, scale)  # noqa: E731
        rows.append(Row("sparse_attention", f"T={tokens} K={k}", moved, _time(run_fast), _time(run_ref), _diff(run_fast(), run_ref())))
    return rows


def bench_moe_experts(dtype: torch.dtype, quick: bool) -> list[Row]:
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_interfaces import Kernels

    fast, ref = CUDAKernels(), Kernels()
    # V4-Flash expert shapes (hidden 4096, intermediate 2048, 6 of the experts per token), 64 local experts
    experts, dim, inter, top_k = 64, 4096, 2048, 6
    w13 = torch.randn(experts, 2 * inter, dim, device="cuda", dtype=dtype) * dim**-0.5
    w2 = torch.randn(experts, dim, inter, device="cuda", dtype=dtype) * inter**-0.5
    shapes = [16, 128, 1024, 4096]
    if quick:
        shapes = [128, 4096]
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens in shapes:
        x = torch.randn(tokens, dim, device="cuda", dtype=dtype, generator=g)
        ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k, dim=-1).indices
        weights = torch.rand(tokens, top_k, device="cuda", generator=g)
        flops = 6.0 * tokens * top_k * inter * dim
        run_fast = lambda: fast.moe_experts(x, ids, weights, w13, w2, 10.0)  # noqa: E731
        run_ref = lambda: ref.moe_experts(x, ids, weights, w13, w2, 10.0)  # noqa: E731
        rows.append(
            Row(
                "moe_experts", f"T={tokens} k={top_k} E={experts}", flops,
                _time(run_fast), _time(run_ref), _diff(run_fast(), run_ref()), "TFLOP/s",
            )
        )
    return rows


def bench_mhc_pre(dtype: torch.dtype, quick: bool) -> list[Row]:
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_interfaces import Kernels

    fast, ref = CUDAKernels(), Kernels()
    es = torch.finfo(dtype).bits // 8
    n, dim = 4, 4096
    fn = torch.randn((2 + n) * n, n * dim, device="cuda") * 0.01
    base = torch.randn((2 + n) * n, device="cuda")
    scale = torch.rand(3, device="cuda") + 0.5
    shapes = [1, 64, 4096] if not quick else [64, 4096]
    rows = []
    for tokens in shapes:
        x = torch.randn(tokens, n, dim, device="cuda", dtype=dtype)
        moved = x.numel() * es + tokens * dim * es + fn.numel() * 4
        run_fast = lambda: fast.mhc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)  # noqa: E731
        run_ref = lambda: ref.mhc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)  # noqa: E731
        rows.append(Row("mhc_pre", f"[{tokens}, {n}, {dim}]", moved, _time(run_fast), _time(run_ref), _diff(run_fast()[0], run_ref()[0])))
    return rows


BENCHES = {
    "rms_norm": bench_rms_norm,
    "rope": bench_rope,
    "sparse_attention": bench_sparse_attention,
    "moe_experts": bench_moe_experts,
    "mhc_pre": bench_mhc_pre,
}


def _print(rows: list[Row], dtype_name: str) -> None:
    head = (
        f"{'op':<17} {'shape':<22} {'dtype':<9} {'triton us':>10} {'rate':>8} {'torch us':>10} {'rate':>8} {'unit':<8}"
        f" {'ratio':>8} {'max diff':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.op:<17} {r.shape:<22} {dtype_name:<9} {r.triton_ms * 1e3:>10.1f} {r.rate(r.triton_ms):>8.1f} "
            f"{r.torch_ms * 1e3:>10.1f} {r.rate(r.torch_ms):>8.1f} {r.unit:<8} {r.torch_ms / r.triton_ms:>7.2f}x {r.max_diff:>9.2e}"
        )
    print("ratio: torch time / triton time (above 1: the Triton kernel is faster)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--ops", default=",".join(BENCHES), help=f"comma-separated among {', '.join(BENCHES)}")
    parser.add_argument("--quick", action="store_true", help="two or three shapes per op")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object on the last line")
    args = parser.parse_args(argv)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in BENCHES]
    if unknown:
        parser.error(f"unknown op '{unknown[0]}' (choose from {', '.join(BENCHES)})")
    reason = _why_not_runnable()
    if reason:
        print(f"cuda_kernels: nothing to benchmark here: {reason}")
        return 0
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows: list[Row] = []
    for op in ops:
        rows += BENCHES[op](DTYPES[args.dtype], args.quick)
    _print(rows, args.dtype)
    if args.json:
        print(json.dumps({"benchmark": "cuda_kernels", "dtype": args.dtype, "results": [
            {"op": r.op, "shape": r.shape, "triton_us": r.triton_ms * 1e3, "torch_us": r.torch_ms * 1e3,
             "ratio": r.torch_ms / r.triton_ms, "max_diff": r.max_diff} for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

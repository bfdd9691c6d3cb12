"""Microbenchmark: the CUDA backend's Triton kernels against the torch reference, side by side.

For each op and shape it prints the median time, the achieved memory bandwidth
(bytes the op must move: read inputs once, write the output once) and the
speed-up, plus the largest difference between the two outputs as a sanity
check. Both ops are memory bound, so GB/s against the GPU's peak is the figure
of merit.

Runs only where a CUDA device and Triton exist; elsewhere it says why and exits 0.

    python benchmarks/cuda_kernels.py [--dtype bfloat16] [--ops rms_norm,rope] [--quick]
"""

from __future__ import annotations

import argparse
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
    bytes_moved: int
    triton_ms: float
    torch_ms: float
    max_diff: float


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


BENCHES = {"rms_norm": bench_rms_norm, "rope": bench_rope}


def _print(rows: list[Row], dtype_name: str) -> None:
    head = f"{'op':<9} {'shape':<18} {'dtype':<9} {'triton us':>10} {'GB/s':>8} {'torch us':>10} {'GB/s':>8} {'speed-up':>9} {'max diff':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        t_gbs = r.bytes_moved / (r.triton_ms * 1e-3) / 1e9
        r_gbs = r.bytes_moved / (r.torch_ms * 1e-3) / 1e9
        print(
            f"{r.op:<9} {r.shape:<18} {dtype_name:<9} {r.triton_ms * 1e3:>10.1f} {t_gbs:>8.0f} "
            f"{r.torch_ms * 1e3:>10.1f} {r_gbs:>8.0f} {r.torch_ms / r.triton_ms:>8.2f}x {r.max_diff:>9.2e}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--ops", default=",".join(BENCHES), help=f"comma-separated among {', '.join(BENCHES)}")
    parser.add_argument("--quick", action="store_true", help="two shapes per op")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())

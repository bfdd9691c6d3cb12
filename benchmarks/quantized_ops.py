"""Quantized-weight ops against the same work on bf16 weights: FP8 block-scaled linears and FP4 / FP8 grouped experts.

CPU (always): the reference ``Kernels().fp8_linear`` (e4m3 codes, 128 x 128
UE8M0 blocks) against a bf16 ``x @ w.t()`` on the dequantized weight, and the
reference ``Kernels().moe_experts_quantized`` (FP4 e2m1 with 1 x 32 UE8M0
blocks, FP8 e4m3 with 128 x 128 blocks) against ``Kernels().moe_experts`` on
the dequantized bf16 stacks, at shapes cut down from DeepSeek-V4-Flash to fit
a small CPU. Each time is the median of several runs after a warm-up. Per row:
both times, their ratio (quantized / bf16; above 1 the quantized path is
slower), the bytes of weight each path holds, and the largest absolute
difference between the two outputs as a sanity figure (both see the same
weight values, so it is rounding only).

GPU (where CUDA and Triton are usable and ``TRITON_INTERPRET`` is unset): the
Triton ``CUDAKernels().fp8_linear`` on bf16 activations at V4-Flash GEMM sizes
against torch's bf16 matmul, timed with ``triton.testing.do_bench``, in
TFLOP/s (``2·T·N·K`` per call) and as a fraction of the device's dense peak
(FP8 when the FP8 tensor-core path runs, bf16 otherwise; unknown for a device
not in the table); and the FP4 ``moe_experts_quantized`` kernel against the
bf16 ``moe_experts`` kernel at V4-Flash expert sizes (``6·T·k·I·D`` flops).

    .venv/bin/python benchmarks/quantized_ops.py [--quick] [--json]

``--quick`` runs fewer and smaller shapes; ``--json`` prints every row as one
JSON object, the output's last line.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
from common import add_json_flag, emit_json

from deepinfer_interfaces import Kernels
from deepinfer_interfaces.quant import QuantizedWeight, quantize

#: dense (no 2:4 sparsity) tensor-core peaks in TFLOP/s, (FP8, bf16), by a substring of the device name;
#: the longest matching key wins, so "H100 PCIe" is not read as the SXM part
DENSE_PEAKS: dict[str, tuple[float, float]] = {
    "H100": (1979.0, 989.4),  # SXM (reported as e.g. "NVIDIA H100 80GB HBM3")
    "H100 PCIe": (1513.0, 756.5),
    "H100 NVL": (1670.5, 835.3),
    "H200": (1979.0, 989.4),  # SXM
    "H200 NVL": (1670.5, 835.3),
    "B200": (4500.0, 2250.0),  # HGX B200, 1000 W
    "GB200": (5000.0, 2500.0),
}

FP8_BLOCK = (128, 128)
FP4_BLOCK = (1, 32)
SWIGLU_LIMIT = 10.0


@dataclass
class Row:
    """One op at one shape: the quantized-weight path against the bf16-weight path."""

    device: str
    op: str
    #: which V4-Flash weight the shape stands for
    what: str
    shape: str
    #: the quantized weight's format and block
    fmt: str
    quant_impl: str
    bf16_impl: str
    quant_ms: float
    bf16_ms: float
    #: bytes of weight each path holds (codes + scales, and the bf16 tensor)
    quant_bytes: int
    bf16_bytes: int
    #: largest |quantized-path output - bf16-path output|
    max_diff: float
    #: floating-point operations of one call
    flops: float
    #: whether the FP8 tensor-core path ran (GPU linears only)
    fp8_dot: bool | None = None
    #: the dense peak the quantized path is held against, and which one ("fp8" or "bf16")
    quant_peak_tflops: float | None = None
    quant_peak: str | None = None
    bf16_peak_tflops: float | None = None

    @property
    def ratio(self) -> float:
        """Quantized time over bf16 time (above 1: the quantized path is slower)."""
        return self.quant_ms / self.bf16_ms

    def tflops(self, ms: float) -> float:
        return self.flops / (ms * 1e-3) / 1e12

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["quant_tflops"] = self.tflops(self.quant_ms)
        d["bf16_tflops"] = self.tflops(self.bf16_ms)
        d["quant_peak_fraction"] = self.tflops(self.quant_ms) / self.quant_peak_tflops if self.quant_peak_tflops else None
        d["bf16_peak_fraction"] = self.tflops(self.bf16_ms) / self.bf16_peak_tflops if self.bf16_peak_tflops else None
        return d


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _bf16_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cpu_ms(fn: Callable[[], object], reps: int, budget_s: float) -> float:
    """Median wall time of ``fn`` in ms over at least ``reps`` runs after one warm-up run
    (more runs, up to 50, when they fit in ``budget_s``)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    n = max(reps, min(50, int(budget_s / max(first, 1e-6))))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _linear_weight(n: int, k: int, gen: torch.Generator, device: str = "cpu") -> QuantizedWeight:
    """A unit-scale ``[n, k]`` weight (std ``1/sqrt(k)``) as e4m3 codes in 128 x 128 UE8M0 blocks."""
    w = torch.randn(n, k, generator=gen, device=device) * k**-0.5
    return quantize(w, "e4m3", FP8_BLOCK)


def _expert_stack(e: int, n: int, k: int, fmt: str, block: tuple[int, int], gen: torch.Generator,
                  device: str = "cpu", chunk: int = 16) -> QuantizedWeight:
    """A random ``[e, n, k]`` expert stack quantized a few experts at a time (bounds the encoder's scratch memory)."""
    parts = [quantize(torch.randn(min(chunk, e - i), n, k, generator=gen, device=device) * k**-0.5 * 2, fmt, block)
             for i in range(0, e, chunk)]
    return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), block, fmt)


def _dequantize_stack(w: QuantizedWeight, chunk: int = 8) -> torch.Tensor:
    """``w`` ``[E, N, K]`` in bf16, decoded a few experts at a time."""
    return torch.cat([w.map(lambda t, i=i: t[i : i + chunk]).dequantize(torch.bfloat16) for i in range(0, w.shape[0], chunk)])


def _fmt_name(fmt: str, block: tuple[int, int]) -> str:
    return f"{fmt} {block[0]}x{block[1]}"


# ---------------------------------------------------------------------------------------------------- CPU


def bench_cpu(quick: bool) -> list[Row]:
    ref = Kernels()
    g = torch.Generator().manual_seed(0)
    reps, budget = (3, 0.3) if quick else (5, 0.6)
    rows: list[Row] = []

    # V4-Flash hidden is 4096: the attention q down-projection, the shared expert's fused gate/up and its
    # down projection, and a weight whose last row and column blocks are half full; all FP8 in 128 x 128 blocks
    linears = [
        ("q_a", 1024, 4096),
        ("partial blocks", 1600, 4160),
        ("shared expert w13", 4096, 4096),
        ("shared expert w2", 4096, 2048),
    ]
    tokens = [1, 16, 128]
    if quick:
        linears, tokens = linears[1:3], [1, 128]
    for what, n, k in linears:
        q = _linear_weight(n, k, g)
        wb = q.dequantize(torch.bfloat16)
        for t in tokens:
            x = torch.randn(t, k, generator=g).to(torch.bfloat16)
            run_q = lambda: ref.fp8_linear(x, q)  # noqa: E731
            run_b = lambda: x @ wb.t()  # noqa: E731
            rows.append(Row(
                "cpu", "fp8_linear", what, f"T={t} N={n} K={k}", _fmt_name("e4m3", FP8_BLOCK), "reference", "bf16 x @ w.t()",
                _cpu_ms(run_q, reps, budget), _cpu_ms(run_b, reps, budget), q.nbytes(), _bf16_bytes(wb),
                _diff(run_q(), run_b()), 2.0 * t * n * k,
            ))

    # V4-Flash experts are D=4096, I=2048 with 6 of 256 chosen; here a quarter of D, an eighth of I, 16 local experts
    e, d, i, top_k = 16, 1024, 256, 6
    formats = [("e2m1", FP4_BLOCK), ("e4m3", FP8_BLOCK)]
    expert_tokens = [64] if quick else [1, 64]
    for fmt, block in formats:
        w13 = _expert_stack(e, 2 * i, d, fmt, block, g)
        w2 = _expert_stack(e, d, i, fmt, block, g)
        b13, b2 = _dequantize_stack(w13), _dequantize_stack(w2)
        for t in expert_tokens:
            x = torch.randn(t, d, generator=g).to(torch.bfloat16)
            ids = torch.rand(t, e, generator=g).topk(top_k, dim=-1).indices
            weights = torch.rand(t, top_k, generator=g)
            run_q = lambda: ref.moe_experts_quantized(x, ids, weights, w13, w2, SWIGLU_LIMIT)  # noqa: E731
            run_b = lambda: ref.moe_experts(x, ids, weights, b13, b2, SWIGLU_LIMIT)  # noqa: E731
            rows.append(Row(
                "cpu", "moe_experts_quantized", "routed experts", f"T={t} E={e} D={d} I={i} k={top_k}", _fmt_name(fmt, block),
                "reference", "reference moe_experts (bf16 weights)",
                _cpu_ms(run_q, reps, budget), _cpu_ms(run_b, reps, budget), w13.nbytes() + w2.nbytes(), _bf16_bytes(b13, b2),
                _diff(run_q(), run_b()), 6.0 * t * top_k * i * d,
            ))
    return rows


def _print_cpu(rows: list[Row]) -> None:
    head = (f"{'op':<22} {'weight':<18} {'shape':<28} {'format':<11} {'ref ms':>9} {'bf16 ms':>9} {'ref/bf16':>9}"
            f" {'quant MB':>9} {'bf16 MB':>9} {'max diff':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r.op:<22} {r.what:<18} {r.shape:<28} {r.fmt:<11} {r.quant_ms:>9.2f} {r.bf16_ms:>9.2f} {r.ratio:>8.2f}x"
              f" {r.quant_bytes / 2**20:>9.2f} {r.bf16_bytes / 2**20:>9.2f} {r.max_diff:>9.2e}")
    print("ref/bf16: reference time over bf16 time (above 1: the quantized reference is slower); "
          "max diff: quantized path vs bf16 path on the same dequantized weights")


# ---------------------------------------------------------------------------------------------------- GPU


def why_no_gpu() -> str | None:
    """Why the GPU section cannot run here, or None when it can."""
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        return "TRITON_INTERPRET is set; the interpreter's timings mean nothing (unset it)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'deepinfer[cuda]')"
    try:
        import deepinfer_cuda.kernels  # noqa: F401
    except Exception as exc:  # a broken install is a reason to skip, not to crash the CPU figures
        return f"deepinfer_cuda does not import: {type(exc).__name__}: {exc}"
    return None


def dense_peaks(name: str) -> tuple[float | None, float | None]:
    """``(FP8, bf16)`` dense peak TFLOP/s of a device by name; ``(None, None)`` when not in the table."""
    keys = sorted((k for k in DENSE_PEAKS if k.lower() in name.lower()), key=len, reverse=True)
    return DENSE_PEAKS[keys[0]] if keys else (None, None)


def _gpu_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_gpu(quick: bool, fp8_peak: float | None, bf16_peak: float | None) -> list[Row]:
    from deepinfer_cuda import triton_fp8
    from deepinfer_cuda.kernels import CUDAKernels

    fast = CUDAKernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[Row] = []

    # V4-Flash FP8 linears (hidden 4096): q down-projection, q up-projection (64 heads x 512 from the 1024 q rank),
    # the shared expert's fused gate/up, and the grouped output projection's second half (8 groups x 1024 -> 4096)
    linears = [
        ("q_a", 1024, 4096),
        ("q_b", 32768, 1024),
        ("shared expert w13", 4096, 4096),
        ("o_b", 4096, 8192),
    ]
    tokens = [1, 64, 512, 4096]
    if quick:
        linears, tokens = [linears[0], linears[2]], [64, 4096]
    for what, n, k in linears:
        q = _linear_weight(n, k, g, "cuda")
        wb = q.dequantize(torch.bfloat16)
        for t in tokens:
            x = torch.randn(t, k, generator=g, device="cuda").to(torch.bfloat16)
            fp8_dot = triton_fp8.uses_fp8_dot(x, q)
            run_q = lambda: fast.fp8_linear(x, q)  # noqa: E731
            run_b = lambda: x @ wb.t()  # noqa: E731
            rows.append(Row(
                "cuda", "fp8_linear", what, f"T={t} N={n} K={k}", _fmt_name("e4m3", FP8_BLOCK), "triton", "torch bf16 matmul",
                _gpu_ms(run_q), _gpu_ms(run_b), q.nbytes(), _bf16_bytes(wb), _diff(run_q(), run_b()), 2.0 * t * n * k,
                fp8_dot=fp8_dot, quant_peak_tflops=fp8_peak if fp8_dot else bf16_peak, quant_peak="fp8" if fp8_dot else "bf16",
                bf16_peak_tflops=bf16_peak,
            ))
        del q, wb

    # V4-Flash routed experts: D=4096, I=2048, 6 chosen per token; 64 local experts (256 over 4 ranks)
    e, d, i, top_k = 64, 4096, 2048, 6
    w13 = _expert_stack(e, 2 * i, d, "e2m1", FP4_BLOCK, g, "cuda", chunk=4)
    w2 = _expert_stack(e, d, i, "e2m1", FP4_BLOCK, g, "cuda", chunk=4)
    b13, b2 = _dequantize_stack(w13), _dequantize_stack(w2)
    for t in ([128, 4096] if quick else [16, 128, 1024, 4096]):
        x = torch.randn(t, d, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.rand(t, e, generator=g, device="cuda").topk(top_k, dim=-1).indices
        weights = torch.rand(t, top_k, generator=g, device="cuda")
        run_q = lambda: fast.moe_experts_quantized(x, ids, weights, w13, w2, SWIGLU_LIMIT)  # noqa: E731
        run_b = lambda: fast.moe_experts(x, ids, weights, b13, b2, SWIGLU_LIMIT)  # noqa: E731
        rows.append(Row(
            "cuda", "moe_experts_quantized", "routed experts", f"T={t} E={e} D={d} I={i} k={top_k}", _fmt_name("e2m1", FP4_BLOCK),
            "triton", "triton moe_experts (bf16 weights)", _gpu_ms(run_q), _gpu_ms(run_b), w13.nbytes() + w2.nbytes(),
            _bf16_bytes(b13, b2), _diff(run_q(), run_b()), 6.0 * t * top_k * i * d,
            quant_peak_tflops=bf16_peak, quant_peak="bf16", bf16_peak_tflops=bf16_peak,
        ))
    return rows


def _pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if x is not None else "unknown"


def _print_gpu(rows: list[Row]) -> None:
    head = (f"{'op':<22} {'weight':<18} {'shape':<28} {'format':<11} {'quant us':>10} {'TFLOP/s':>8} {'of peak':>14}"
            f" {'bf16 us':>10} {'TFLOP/s':>8} {'of peak':>9} {'quant/bf16':>10} {'max diff':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        d = r.as_dict()
        quant_peak = f"{_pct(d['quant_peak_fraction'])} {r.quant_peak}" if r.quant_peak_tflops else "unknown"
        print(f"{r.op:<22} {r.what:<18} {r.shape:<28} {r.fmt:<11} {r.quant_ms * 1e3:>10.1f} {d['quant_tflops']:>8.1f} {quant_peak:>14}"
              f" {r.bf16_ms * 1e3:>10.1f} {d['bf16_tflops']:>8.1f} {_pct(d['bf16_peak_fraction']):>9} {r.ratio:>9.2f}x {r.max_diff:>9.2e}")
    print("quant/bf16: Triton quantized-weight time over the bf16 time (below 1: the quantized kernel is faster); "
          "of peak: against the dense peak of the dot the kernel runs (fp8 or bf16)")


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer and smaller shapes")
    add_json_flag(ap)
    args = ap.parse_args(argv)

    print(f"quantized ops: torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print("\nCPU: reference quantized ops vs bf16 weights (median of runs after a warm-up)")
    rows = bench_cpu(args.quick)
    _print_cpu(rows)

    figures: dict = {"benchmark": "quantized_ops", "quick": args.quick, "torch": torch.__version__,
                     "cpu_threads": torch.get_num_threads(), "device": None, "gpu_skipped": None,
                     "fp8_peak_tflops": None, "bf16_peak_tflops": None, "fp8_dot": None}
    status = 0
    reason = why_no_gpu()
    if reason:
        print(f"\nGPU: skipped: {reason}")
        figures["gpu_skipped"] = reason
    else:
        from deepinfer_cuda import triton_fp8

        name = torch.cuda.get_device_name()
        fp8_peak, bf16_peak = dense_peaks(name)
        cap = torch.cuda.get_device_capability()
        probe_x = torch.zeros(1, 128, device="cuda", dtype=torch.bfloat16)
        probe_w = QuantizedWeight(torch.zeros(128, 128, device="cuda", dtype=torch.uint8),
                                  torch.full((1, 1), 127, device="cuda", dtype=torch.uint8), FP8_BLOCK, "e4m3")
        fp8_dot = triton_fp8.uses_fp8_dot(probe_x, probe_w)
        figures.update(device=name, capability=f"sm_{cap[0]}{cap[1]}", fp8_peak_tflops=fp8_peak, bf16_peak_tflops=bf16_peak, fp8_dot=fp8_dot)
        peaks = (f"dense peak FP8 {fp8_peak:.0f} / bf16 {bf16_peak:.0f} TFLOP/s" if fp8_peak else
                 "dense peak unknown (device not in the table)")
        print(f"\nGPU: {name} (sm_{cap[0]}{cap[1]}), {peaks}; fp8_linear on bf16 activations uses the "
              f"{'FP8 tensor-core path (e4m3 x e4m3 dot)' if fp8_dot else 'decode-in-kernel path (bf16 dot), not FP8 tensor cores'}")
        try:
            gpu_rows = bench_gpu(args.quick, fp8_peak, bf16_peak)
        except Exception as exc:  # keep the CPU figures and say what failed; the exit status reports it
            print(f"GPU: failed: {type(exc).__name__}: {exc}")
            figures["gpu_error"] = f"{type(exc).__name__}: {exc}"
            status = 1
        else:
            _print_gpu(gpu_rows)
            rows += gpu_rows

    figures["rows"] = [r.as_dict() for r in rows]
    emit_json(args.json, figures)
    return status


if __name__ == "__main__":
    sys.exit(main())

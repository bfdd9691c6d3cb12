"""The CUDA backend's Triton kernels, run on CPU tensors through Triton's interpreter.

Every check runs in a subprocess: ``TRITON_INTERPRET`` must be set before
Triton is first imported, and this pytest process may already have imported it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

OWN_OPS = {"rms_norm", "rope", "sample", "apply_token_bitmask"}


def _run(args: list[str], interpret: bool, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("DEEPINFER_BACKEND", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_cuda_kernels_list_their_ops_without_importing_triton() -> None:
    script = textwrap.dedent(
        """
        import contextlib, io, json, sys
        from deepinfer.cli import main
        from deepinfer_cuda.kernels import CUDAKernels
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            main(["backends", "--json"])
        cuda = next(b for b in json.loads(buf.getvalue()) if b["name"] == "cuda")
        print(json.dumps({"class": CUDAKernels.overrides(), "cli": cuda["overrides"],
                          "triton_imported": "triton" in sys.modules}))
        """
    )
    proc = _run(["-c", script], interpret=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert OWN_OPS <= set(got["class"])
    assert got["cli"] == got["class"]
    assert got["triton_imported"] is False


def test_conformance_interpret_passes_every_own_op(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = _run(
        ["-m", "deepinfer.cli", "conformance", "--backend", "cuda", "--interpret", "--report", str(report_path)],
        interpret=True,
    )
    assert report_path.exists(), proc.stderr
    report = json.loads(report_path.read_text())
    assert report["backend"] == "cuda" and report["kernels"] == "cuda"
    from deepinfer_cuda.kernels import CUDAKernels

    overrides = set(CUDAKernels.overrides())
    assert OWN_OPS <= overrides
    for op in sorted(overrides):
        rows = [r for r in report["results"] if r["op"] == op]
        assert rows, f"no conformance results for {op}"
        bad = [(r["case"], r["dtype"], r["status"], r["message"]) for r in rows if r["status"] != "pass"]
        assert not bad, f"{op}: {bad}"
    dtypes = {r["dtype"] for r in report["results"] if r["op"] == "rms_norm"}
    assert dtypes == {"float32", "bfloat16", "float16"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device, so the backend is available")
def test_conformance_without_interpret_needs_cuda() -> None:
    proc = _run(["-m", "deepinfer.cli", "conformance", "--backend", "cuda"], interpret=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "CUDA" in lines[0] and "Traceback" not in proc.stderr


# Shapes past the op specs: several blocks per row, strided inputs, fp64, masked
# logits, short bitmasks. Run under the interpreter, compared with the reference.
_BEYOND_SPECS = textwrap.dedent(
    """
    import sys, torch
    from deepinfer_interfaces import Kernels
    from deepinfer_cuda.kernels import CUDAKernels

    ref, cu = Kernels(), CUDAKernels()
    g = torch.Generator().manual_seed(0)

    def close(a, b, tol):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        err = ((a.double() - b.double()).abs() / (1 + b.double().abs())).max().item()
        assert err <= tol, err

    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)):
        for shape in ((3, 1000), (2, 5, 130), (4, 1)):
            x = torch.randn(*shape, generator=g).to(dt)
            w = torch.randn(shape[-1], generator=g)
            close(cu.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), tol)
            close(cu.rms_norm(x, None, 1e-6), ref.rms_norm(x, None, 1e-6), tol)
    xs = torch.randn(6, 200, generator=g)[:, 10:150]
    close(cu.rms_norm(xs, None, 1e-5), ref.rms_norm(xs, None, 1e-5), 1e-5)
    xt = torch.randn(50, 6, generator=g).t()
    close(cu.rms_norm(xt, None, 1e-5), ref.rms_norm(xt, None, 1e-5), 1e-5)

    def angles(pos, half):
        f = pos.double()[:, None] / 10000.0 ** (torch.arange(half, dtype=torch.float64) / half)
        return f.cos().float(), f.sin().float()

    for shape, half in (((3, 9, 75), 6), ((3, 130), 32), ((2, 3, 64), 32), ((5, 2, 8), 1)):
        c, s = angles(torch.randint(0, 100000, (shape[0],), generator=g), half)
        for dt, tol in ((torch.float32, 2e-5), (torch.bfloat16, 1e-2), (torch.float64, 1e-12)):
            x = torch.randn(*shape, generator=g).to(dt)
            for inv in (False, True):
                close(cu.rope(x, c, s, inv), ref.rope(x, c, s, inv), tol)
            close(cu.rope(cu.rope(x, c, s), c, s, True), x, max(tol, 1e-6) * 4)
    q = torch.randn(4, 8, 96, generator=g)[:, 1:6, 16:]
    c, s = angles(torch.arange(4), 16)
    close(cu.rope(q, c, s), ref.rope(q, c, s), 2e-5)

    temp = torch.tensor([0.0, 0.6, 1.0, 1.4, 0.9, 2.0])
    top_k = torch.tensor([0, 50, 0, 3, 700, 0])
    top_p = torch.tensor([1.0, 0.9, 0.7, 1.0, 0.5, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.2])
    b = 6
    seen = set()
    for trial in range(4):
        v = 1000 + 37 * trial
        logits = torch.randperm(b * v, generator=g).float().view(b, v) / (b * v) * 14.0
        if trial % 2:
            logits[:, ::3] = float("-inf")
        noise = torch.empty(b, v).exponential_(generator=g)
        # bf16 holds 8 significant bits: distinct, exactly representable logits keep the cut free of ties
        small = torch.stack([torch.randperm(256, generator=g)[:200] for _ in range(b)]).float() / 16.0
        for lg, nz in ((logits, noise), (small.to(torch.bfloat16), noise[:, :200])):
            got = cu.sample(lg, temp, top_k, top_p, min_p, nz)
            want = ref.sample(lg, temp, top_k, top_p, min_p, nz)
            assert got.dtype == torch.int64 and torch.equal(got, want), (trial, lg.dtype, got, want)
            seen.update(got.tolist())
        ones, zeros = torch.ones(b), torch.zeros(b)
        no_filter = (ones, torch.zeros(b, dtype=torch.long), ones, zeros, noise)
        assert torch.equal(cu.sample(logits, *no_filter), ref.sample(logits, *no_filter))
    assert len(seen) > 20, seen

    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for v, words in ((1000, 32), (1000, 20), (31, 1)):
            lg = torch.randn(3, v, generator=g).to(dt)
            bm = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
            want = ref.apply_token_bitmask(lg.clone(), bm)
            buf = lg.clone()
            out = cu.apply_token_bitmask(buf, bm)
            assert out.data_ptr() == buf.data_ptr() and torch.equal(buf, want), (dt, v, words)
    big = torch.randn(3, 1200, generator=g)
    view = big[:, 100:1100]
    bm = torch.randint(-(2**31), 2**31 - 1, (3, 32), generator=g, dtype=torch.int64).to(torch.int32)
    want = ref.apply_token_bitmask(view.clone(), bm)
    cu.apply_token_bitmask(view, bm)
    assert torch.equal(view, want) and not big[:, :100].isinf().any() and not big[:, 1100:].isinf().any()

    for mod in ("triton_norm", "triton_rope", "triton_sampling", "triton_bitmask"):
        assert "deepinfer_cuda." + mod in sys.modules, mod
    print("ok")
    """
)


def test_triton_kernels_match_reference_beyond_spec_shapes() -> None:
    proc = _run(["-c", _BEYOND_SPECS], interpret=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_cpu_tensors_without_interpreter_are_refused_clearly() -> None:
    script = textwrap.dedent(
        """
        import torch
        from deepinfer_cuda.kernels import CUDAKernels
        try:
            CUDAKernels().rms_norm(torch.ones(2, 8), None, 1e-6)
        except ValueError as exc:
            print(exc)
        """
    )
    proc = _run(["-c", script], interpret=False)
    assert proc.returncode == 0, proc.stderr
    assert "cuda kernel rms_norm" in proc.stdout and "--interpret" in proc.stdout


# Lowering every kernel to a cubin for Hopper (sm_90) and Blackwell (sm_100) with
# Triton's bundled ptxas catches GPU-only compile errors the interpreter cannot.
_COMPILE_FOR_GPUS = textwrap.dedent(
    """
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.autotuner import Autotuner
    from deepinfer_cuda import triton_bitmask, triton_norm, triton_rope, triton_sampling

    def compile_for(kernel, sig, consts, warps, arch):
        fn = kernel.fn if isinstance(kernel, Autotuner) else kernel
        signature = {n: "constexpr" if n in consts else sig[n] for n in fn.arg_names}
        target = GPUTarget("cuda", arch, 32)
        options = make_backend(target).parse_options({"num_warps": warps}).__dict__
        assert triton.compile(ASTSource(fn, signature, consts), target=target, options=options).asm["cubin"]

    i64, f32 = "i64", "*fp32"
    norm = dict(x_ptr="*bf16", w_ptr=f32, out_ptr="*bf16", D="i32", stride_x=i64, stride_o=i64, eps="fp32")
    rope = dict(x_ptr="*bf16", cos_ptr=f32, sin_ptr=f32, out_ptr="*bf16", H="i32", D="i32", NOPE="i32",
                stride_xt=i64, stride_xh=i64, stride_ot=i64, stride_oh=i64, stride_ct=i64, stride_st=i64)
    cases = [
        (triton_norm._rms_norm_kernel, norm, dict(HAS_WEIGHT=True, ACC=tl.float32, BLOCK=8192, ONE_PASS=True), 16),
        (triton_norm._rms_norm_kernel, norm, dict(HAS_WEIGHT=False, ACC=tl.float32, BLOCK=4096, ONE_PASS=False), 16),
        (triton_rope._rope_kernel, rope, dict(INVERSE=True, ACC=tl.float32, BLOCK_H=8, BLOCK_D=512), 16),
        (triton_bitmask._apply_bitmask_kernel,
         dict(logits_ptr="*bf16", mask_ptr="*i32", V="i32", W="i32", stride_l=i64, stride_m=i64), dict(BLOCK=4096), 8),
        (triton_sampling._softmax_stats_kernel,
         dict(logits_ptr="*bf16", temp_ptr=f32, max_ptr=f32, sum_ptr=f32, V="i32", stride_l=i64), dict(BLOCK=4096), 8),
        (triton_sampling._cutoff_kernel,
         dict(sorted_ptr="*bf16", stride_s=i64, K="i32", V="i32", temp_ptr=f32, top_k_ptr="*i64", top_p_ptr=f32,
              need_ptr="*i8", max_ptr=f32, sum_ptr=f32, cutoff_ptr=f32), dict(BLOCK=1024), 4),
        (triton_sampling._race_kernel,
         dict(logits_ptr="*bf16", noise_ptr=f32, V="i32", stride_l=i64, stride_n=i64, temp_ptr=f32, min_p_ptr=f32,
              max_ptr=f32, sum_ptr=f32, cutoff_ptr=f32, out_ptr="*i64"), dict(BLOCK=4096), 8),
    ]
    for arch in (90, 100):
        for kernel, sig, consts, warps in cases:
            compile_for(kernel, sig, consts, warps, arch)
    print("ok", len(cases) * 2)
    """
)


def test_triton_kernels_compile_for_hopper_and_blackwell() -> None:
    proc = _run(["-c", _COMPILE_FOR_GPUS], interpret=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok 14", proc.stdout + proc.stderr

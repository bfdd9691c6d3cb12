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

OWN_OPS = {
    "rms_norm", "rope", "sample", "apply_token_bitmask",
    # the DeepSeek-V4 model ops
    "cache_write", "sparse_attention", "indexer_scores", "compress_kv", "mhc_pre", "mhc_post", "mhc_head",
    "moe_route", "hash_route", "swiglu", "moe_experts",
    # quantized weights
    "fp8_linear", "moe_experts_quantized",
    # DeepSeek V4.1: its hyper-connections, two-level top-k and Engram
    "mhc_mix", "mhc_collapse", "candidate_blocks", "engram_hash", "engram_lookup", "engram_inject",
    # packed cache records
    "kv_pack", "kv_unpack", "hadamard",
    # the vision tower
    "vit_attention",
}
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


#: op -> case -> why the sweep below leaves it out: each crosses no block boundary that the kept cases and the
#: checks named do not cross, and costs seconds to a minute under the interpreter
#: (``DEEPINFER_FULL_INTERPRET_SWEEP=1`` runs them too)
LEFT_OUT = {
    "apply_token_bitmask": {
        "one_row_vocab_129280": "thousands of programs on one row; several programs per row, a strided row and short "
                                "masks: test_triton_kernels_match_reference_beyond_spec_shapes",
    },
    "moe_experts_quantized": {
        "fp4_t200_grouped": "several row tiles per expert: moe_experts in test_model_kernels_match_reference_beyond_spec_shapes "
                            "(same align_by_expert and kernels) and the e2m1 experts of "
                            "test_quantized_kernels_match_reference_beyond_spec_shapes; the FP4 decode: the fp4_* cases kept",
    },
    "indexer_topk": {
        case: "tests/backends/cuda/test_cuda_long_context.py: several sequences, split and unsplit launches, holes, tokens that see "
              "nothing, integer inputs full of ties, exact picks"
        for case in ("b6_each_token_its_rows", "one_token_decode_h64_d128", "t9_b2_holes_and_nothing_visible",
                     "integer_inputs_equal_scores_in_entry_order")
    },
    "entry_attention": {"b6_each_token_its_rows": "tests/backends/cuda/test_cuda_long_context.py: several sequences, split launches"},
    "rope": {
        case: "real widths; several heads, partial and odd-width rope, strided q, fp64: test_triton_kernels_match_reference_beyond_spec_shapes"
        for case in ("t2_h64_d512_r64_forward", "t2_h64_d512_r64_inverse", "one_token_h64_d512_r64_forward",
                     "one_token_h64_d512_r64_inverse")
    },
    "rms_norm": {
        case: "real widths (one_row_hidden_4096 kept); several blocks per row, 3-D, strided: "
              "test_triton_kernels_match_reference_beyond_spec_shapes"
        for case in ("t2_h64_d512_q_heads_unweighted", "t4_hidden_4096")
    },
    "fp8_linear": {
        "t4_n256_k512_float32_scales": "float32 scales, both FP8 paths: test_quantized_kernels_match_reference_beyond_spec_shapes",
        "t5_n200_k300_partial_blocks_ue8m0": "partial blocks on both axes, UE8M0 scales: "
                                             "test_quantized_kernels_match_reference_beyond_spec_shapes",
    },
    "indexer_scores": {"one_token_h64_d128": "one token of 16 heads: test_model_kernels_match_reference_beyond_spec_shapes"},
    "mhc_head": {"t2_n4_d4096_v4_width": "channels across blocks: test_model_kernels_match_reference_beyond_spec_shapes"},
    "mhc_post": {
        case: "channels across blocks: test_model_kernels_match_reference_beyond_spec_shapes"
        for case in ("t2_n4_d5120_v41_width", "one_token_n4_d4096")
    },
    "mhc_collapse": {
        case: "channels across blocks, strided streams: test_cuda_kernels_match_the_reference_beyond_the_specs (tests/models/deepseek_v41/test_v41_ops.py)"
        for case in ("t3_n4_d5120_v41_width", "t2_n4_d4096_v4_width")
    },
    "compress_kv": {
        "csa_e3_m4_c1024_overlap": "overlapping windows over several channel blocks: "
                                   "test_model_kernels_match_reference_beyond_spec_shapes",
    },
    "candidate_blocks": {
        case: "many blocks and ties across row tiles: test_cuda_kernels_match_the_reference_beyond_the_specs (tests/models/deepseek_v41/test_v41_ops.py)"
        for case in ("t3_n3000_block8_top64", "one_token_n4096_block64_top8_ties")
    },
    "swiglu": {"t4_i2048": "one_row_i2048 kept; several rows, strided gates: test_model_kernels_match_reference_beyond_spec_shapes"},
}
#: every case of these ops passes under the interpreter in tests/backends/cuda/test_cuda_engram.py
ENGRAM_OPS = {"engram_hash", "engram_lookup", "engram_inject"}


def test_conformance_interpret_passes_every_own_op(tmp_path: Path) -> None:
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_interfaces.specs import SPECS
    from tests.helpers.interpret_sweep import assert_left_out_cases_exist, full_sweep, interpret_limited, sweep

    overrides = set(CUDAKernels.overrides())
    assert OWN_OPS <= overrides and overrides <= set(SPECS), overrides - set(SPECS)
    report_path = tmp_path / "report.json"
    # the CLI's route, on one op: cases above a low element limit are reported left to the device
    cli = ["conformance", "--backend", "cuda", "--interpret", "--ops", "rms_norm", "--interpret-max-elements", "1000",
           "--report", str(report_path)]
    ops = sorted(overrides if full_sweep() else overrides - ENGRAM_OPS)
    res = sweep("cuda", cli, ops, LEFT_OUT, timeout=600)
    assert res["cli_status"] == 0, res["cli_table"]
    report = json.loads(report_path.read_text())
    assert report["backend"] == "cuda" and report["kernels"] == "cuda"
    cli_rows = report["results"]
    assert {r["op"] for r in cli_rows} == {"rms_norm"}
    assert {r["dtype"] for r in cli_rows} == {"float32", "bfloat16", "float16"}
    assert all(r["status"] == "pass" or interpret_limited(r) for r in cli_rows), cli_rows
    assert any(r["status"] == "pass" for r in cli_rows) and any(interpret_limited(r) for r in cli_rows)
    assert_left_out_cases_exist(res, LEFT_OUT)
    for op in ops:
        rows = [r for r in res["rows"] if r["op"] == op]
        assert rows, f"no conformance results for {op}"
        # the real-shape cases are left to the device (INTERPRET_MAX_ELEMENTS); every other case passes
        bad = [(r["case"], r["dtype"], r["status"], r["message"]) for r in rows if r["status"] != "pass" and not interpret_limited(r)]
        assert not bad, f"{op}: {bad}"
        assert any(r["status"] == "pass" for r in rows), f"{op}: no case ran under the interpreter"
        ran = {r["case"] for r in rows}
        assert ran == set(res["case_names"][op]) - (set() if full_sweep() else set(LEFT_OUT.get(op, ()))), op


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


# The model ops past the op specs: decode shapes that split the attention rows
# over programs, ragged heads / dims / channels / stream counts that cross block
# boundaries, strided inputs, -1 padding everywhere, every routing variant, and
# cache writes that cast. Compared with the reference run in fp64 on the same
# rounded inputs (routing ids exactly).
_MODEL_OPS_BEYOND_SPECS = textwrap.dedent(
    """
    import sys, torch
    from deepinfer_interfaces import Kernels
    from deepinfer_cuda.kernels import CUDAKernels

    ref, cu = Kernels(), CUDAKernels()
    g = torch.Generator().manual_seed(0)
    TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
    DTS = (torch.float32, torch.bfloat16, torch.float16)

    def rnd(*s, scale=1.0):
        return torch.randn(*s, generator=g) * scale

    def close(a, b, tol, what=""):
        a = a if isinstance(a, tuple) else (a,)
        b = b if isinstance(b, tuple) else (b,)
        for x, y in zip(a, b):
            assert x.shape == y.shape and x.dtype == y.dtype, (what, x.shape, y.shape, x.dtype, y.dtype)
            fin = torch.isfinite(y)
            assert torch.equal(fin, torch.isfinite(x)) and torch.equal(x[~fin], y[~fin]), what
            err = ((x[fin].double() - y[fin].double()).abs() / (1 + y[fin].double().abs())).max().item() if fin.any() else 0.0
            assert err <= tol, (what, err)

    def wide(v):
        return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    def check(op, dt, *args, what=""):
        # the op on the kernels vs the reference in fp64 on the same (already rounded) inputs
        got = getattr(cu, op)(*args)
        want = getattr(ref, op)(*[wide(a) for a in args])
        cast = lambda w, gt: w.to(gt.dtype)
        if isinstance(got, tuple):
            want = tuple(cast(w, x) for w, x in zip(want, got))
        else:
            want = cast(want, got)
        close(got, want, TOL[dt], (op, dt, what))
        return got

    def pad(idx, frac):
        return torch.where(torch.rand(idx.shape, generator=g) < frac, torch.full_like(idx, -1), idx)

    # sparse attention: decode (split over the rows), prefill, ragged heads and dims, strided q, masked rows
    for dt in DTS:
        for t, h, d, n, k in ((1, 4, 64, 90, 40), (2, 3, 48, 30, 70), (9, 5, 48, 30, 13), (3, 16, 16, 12, 9)):
            idx = pad(torch.randint(0, n, (t, k), generator=g), 0.3)
            idx[-1] = -1
            out = check("sparse_attention", dt, rnd(t, h, d).to(dt), rnd(n, d).to(dt), idx, rnd(h), d ** -0.5, what=(t, h, d, k))
            assert out[-1].abs().max() == 0
        q = rnd(4, 6, 40)[:, 1:5, 8:].to(dt)
        check("sparse_attention", dt, q, rnd(10, 32).to(dt), torch.randint(0, 10, (4, 7), generator=g), rnd(4), 0.2)

    # indexer scores: ragged heads, dims and candidates, padded rows
    for dt in DTS:
        for t, h, d, n, k in ((3, 5, 24, 50, 37), (1, 16, 32, 9, 9)):
            idx = pad(torch.randint(0, n, (t, k), generator=g), 0.25)
            check("indexer_scores", dt, rnd(t, h, d).to(dt), rnd(t, h).to(dt), rnd(n, d).to(dt), idx, d ** -0.5)

    # compressor: long windows (several slot tiles), overlapping windows, ragged channels
    for dt in DTS:
        for e, m, c, overlap in ((3, 16, 40, True), (5, 13, 24, False), (2, 32, 12, False)):
            n = 3 * m
            idx = pad(torch.randint(0, n, (e, m), generator=g), 0.2)
            prev = pad(torch.randint(0, n, (e, m), generator=g), 0.2) if overlap else None
            check("compress_kv", dt, rnd(n, c).to(dt), rnd(n, c, scale=2.0).to(dt), rnd(m, c), idx, prev)

    # hyper-connections: non-power-of-two streams, split mixing reduction (decode), many tokens
    for dt in DTS:
        for t, s, d, iters in ((7, 3, 40, 20), (1, 4, 64, 20), (21, 2, 24, 3)):
            x = rnd(t, s, d).to(dt)
            fn, base, scale = rnd((2 + s) * s, s * d, scale=0.1), rnd((2 + s) * s, scale=0.5), torch.rand(3, generator=g) + 0.5
            out, post, comb = check("mhc_pre", dt, x, fn, base, scale, 1e-6, 1e-6, iters, what=(t, s, d))
            check("mhc_post", dt, rnd(t, d).to(dt), x, post, comb)
            check("mhc_head", dt, x, rnd(s, s * d, scale=0.1), rnd(s, scale=0.5), torch.rand(1, generator=g) + 0.5, 1e-6, 1e-6)
        x = rnd(5, 8, 24)[:, 2:6].to(dt)
        check("mhc_pre", dt, x, rnd(24, 96, scale=0.1), rnd(24, scale=0.5), torch.rand(3, generator=g) + 0.5, 1e-6, 1e-6, 20)

    # routing: many experts, ragged expert counts, every scoring function, with and without bias
    for dt in DTS:
        for t, e, k in ((9, 64, 6), (4, 10, 3)):
            logits = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).float().mul(0.125).sub(e / 16).to(dt)
            for scoring in ("sqrtsoftplus", "sigmoid", "softmax"):
                for bias in (None, torch.randperm(e, generator=g).float() * 0.01):
                    w, ids = cu.moe_route(logits, bias, k, 2.5, scoring, True)
                    rw, rids = ref.moe_route(logits.double(), None if bias is None else bias.double(), k, 2.5, scoring, True)
                    assert torch.equal(ids, rids), (scoring, ids, rids)
                    close(w, rw.float(), 1e-5, ("route", scoring))
            table = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(50)])
            tok = torch.randint(0, 50, (t,), generator=g)
            w, ids = cu.hash_route(logits, tok, table, 1.5, "softmax", False)
            rw, rids = ref.hash_route(logits.double(), tok, table, 1.5, "softmax", False)
            assert torch.equal(ids, rids)
            close(w, rw.float(), 1e-5, "hash")
    # softplus of very negative and large logits keeps full relative precision
    z = torch.tensor([[-30.0, -20.0, -5.0, 0.0, 15.0, 25.0]])
    w, _ = cu.moe_route(z, None, 6, 1.0, "sqrtsoftplus", False)
    rw, _ = ref.moe_route(z.double(), None, 6, 1.0, "sqrtsoftplus", False)
    assert ((w.double() - rw).abs() / rw).max() < 1e-6, (w, rw)

    # experts: several tiles per expert, ragged sizes, -1 and foreign ids, clamp and no clamp
    for dt in DTS:
        for t, d, i, e, k, limit in ((13, 24, 20, 5, 3, 0.7), (30, 16, 8, 2, 2, None), (1, 32, 16, 8, 4, 10.0)):
            ids = pad(torch.randint(0, e + 2, (t, k), generator=g), 0.15)
            w13, w2 = rnd(e, 2 * i, d, scale=0.3).to(dt), rnd(e, d, i, scale=0.3).to(dt)
            check("moe_experts", dt, rnd(t, d).to(dt), ids, torch.rand(t, k, generator=g), w13, w2, limit, what=(t, d, i, e, k))
        check("swiglu", dt, rnd(3, 5, 70, scale=3).to(dt), rnd(3, 5, 70, scale=3).to(dt), 2.0)
        gate = rnd(6, 90, scale=3)[:, 5:75].to(dt)
        check("swiglu", dt, gate, rnd(6, 70).to(dt), None)

    # cache writes: matrix rows, a cast into the pool dtype, strided values, -1 slots
    for pool_dt in (torch.float32, torch.bfloat16):
        pool = rnd(20, 3, 50).to(pool_dt)
        vals = rnd(5, 3, 60)[:, :, 5:55]
        slots = torch.tensor([7, -1, 0, 19, -1])
        want = pool.clone()
        ref.cache_write(want, slots, vals)
        cu.cache_write(pool, slots, vals)
        assert torch.equal(pool, want)

    mods = ("attention", "indexer", "compressor", "mhc", "moe", "experts", "cache")
    for mod in mods:
        assert "deepinfer_cuda.triton_" + mod in sys.modules, mod
    print("ok")
    """
)


def test_model_kernels_match_reference_beyond_spec_shapes() -> None:
    proc = _run(["-c", _MODEL_OPS_BEYOND_SPECS], interpret=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


# The quantized-weight kernels past the op specs: both FP8 linear paths forced, split-K decode
# shapes, partial blocks on both axes, FP4 codes in the linear, codes stored as float8 or bytes,
# strided activations, FP8 expert stacks with partial 128-blocks. The FP8 tensor-core path is
# held to a torch emulation of its own numerics (per-token 1 x 128 e4m3 activations), far tighter
# than the op spec's bound; scales the kernels cannot read fall back to the reference.
_QUANT_OPS_BEYOND_SPECS = textwrap.dedent(
    """
    import sys, torch
    from deepinfer_interfaces import Kernels
    from deepinfer_interfaces.quant import QuantizedWeight, quantize
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_cuda import triton_fp8

    ref, cu = Kernels(), CUDAKernels()
    g = torch.Generator().manual_seed(0)

    def close(a, b, tol):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        err = ((a.double() - b.double()).abs() / (1 + b.double().abs())).max().item()
        assert err <= tol, err

    def weight(n, k, fmt, block, ue8m0=True):
        w = torch.randn(n, k, generator=g) * k**-0.5
        w = w * (torch.rand(-(-n // block[0]), 1, generator=g) * 3 + 0.25).repeat_interleave(block[0], 0)[:n]
        return quantize(w, fmt, block, ue8m0)

    def emulate_fp8(x, w):
        # what the FP8 path computes: e4m3 activations per token and 128 columns, fp32 products
        xf = x.float()
        t, k = xf.shape
        pad = -k % 128
        groups = torch.nn.functional.pad(xf, (0, pad)).view(t, -1, 128)
        scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
        q = (groups / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return (q.view(t, -1)[:, :k] @ w.dequantize(torch.float32).t()).to(x.dtype)

    for t, n, k, ue8m0, dt in ((1, 200, 1000, True, torch.bfloat16), (33, 136, 300, False, torch.float16), (9, 64, 256, True, torch.bfloat16)):
        w = weight(n, k, "e4m3", (128, 128), ue8m0)
        raw = QuantizedWeight(w.codes.view(torch.uint8), w.scales, w.block, w.fmt)
        x32 = torch.randn(t, k, generator=g)
        close(cu.fp8_linear(x32, w), ref.fp8_linear(x32, w), 1e-5)
        x = x32.to(dt)
        assert triton_fp8.uses_fp8_dot(x, w)
        close(triton_fp8.fp8_linear(x, raw, fp8_dot=True), emulate_fp8(x, w), 2e-2)
        if t > 1:  # the one-token shape's decoded-tile path in fp32 above: the same kernel
            close(triton_fp8.fp8_linear(x, w, fp8_dot=False), ref.fp8_linear(x, w), 2e-2)
    wide = torch.randn(4, 700, generator=g)[:, 50:650]
    w = weight(72, 600, "e4m3", (128, 128))
    close(cu.fp8_linear(wide, w), ref.fp8_linear(wide, w), 1e-5)
    for n, k, block in ((48, 320, (1, 32)), (40, 96, (16, 32))):
        w = weight(n, k, "e2m1", block)
        x = torch.randn(5, k, generator=g)
        assert not triton_fp8.uses_fp8_dot(x.bfloat16(), w)
        close(cu.fp8_linear(x, w), ref.fp8_linear(x, w), 1e-5)
        close(cu.fp8_linear(x.bfloat16(), w), ref.fp8_linear(x.bfloat16(), w), 2e-2)
    odd = weight(64, 256, "e4m3", (128, 128), ue8m0=False)
    odd = QuantizedWeight(odd.codes, odd.scales.to(torch.bfloat16), odd.block, odd.fmt)
    x = torch.randn(3, 256, generator=g)
    close(cu.fp8_linear(x, odd), ref.fp8_linear(x, odd), 1e-6)

    # each format in fp32 and bf16, each with and without the clamp, the clamp in both dtypes (pairwise)
    for fmt, block, d, i, runs in (("e4m3", (128, 128), 160, 192, ((torch.float32, None), (torch.bfloat16, 3.0))),
                                   ("e2m1", (1, 32), 96, 64, ((torch.float32, 3.0), (torch.bfloat16, None)))):
        e, t, top = 5, 13, 3
        w13 = quantize(torch.randn(e, 2 * i, d, generator=g) * d**-0.5 * 2, fmt, block)
        w2 = quantize(torch.randn(e, d, i, generator=g) * i**-0.5 * 2, fmt, block, ue8m0=fmt == "e2m1")
        ids = torch.stack([torch.randperm(e + 1, generator=g)[:top] - 1 for _ in range(t)])
        tw = torch.rand(t, top, generator=g)
        x = torch.randn(t, d, generator=g)
        for dt, limit in runs:
            xd = x.to(dt)
            close(cu.moe_experts_quantized(xd, ids, tw, w13, w2, limit), ref.moe_experts_quantized(xd, ids, tw, w13, w2, limit),
                  1e-5 if dt == torch.float32 else 3e-2)
    for mod in ("triton_fp8", "triton_dequant", "triton_experts"):
        assert "deepinfer_cuda." + mod in sys.modules, mod
    print("ok")
    """
)


def test_quantized_kernels_match_reference_beyond_spec_shapes() -> None:
    proc = _run(["-c", _QUANT_OPS_BEYOND_SPECS], interpret=True, timeout=400)
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


# Lowering the kernels to cubins for sm_90 and sm_100 at the launch configs a GPU takes is
# tests/backends/cuda/test_cuda_compile.py (deepinfer_cuda.compile_check).

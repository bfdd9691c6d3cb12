"""The CUDA backend's Engram kernels (``deepinfer_cuda.triton_engram``): conformance under Triton's interpreter,
cases past the specs (tile edges, strided and mixed-dtype inputs, wrapping and floored hashes, rounding and
extreme scales), where ``engram_lookup`` runs the reference, and the compile check's V4.1 sizes and figures.

Every check runs in a subprocess: ``TRITON_INTERPRET`` must be set (or unset) before Triton is first imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepinfer_interfaces.specs import SPECS

ROOT = Path(__file__).resolve().parents[3]
OPS = ("engram_hash", "engram_lookup", "engram_inject")
# find_spec, not importorskip: importing Triton here would stop later tests from choosing the interpreter
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[cuda]')")


def _python(script: str, interpret: bool, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEEPINFER_BACKEND")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("TRITON_CACHE_DIR", str(ROOT / "build" / "triton-cache"))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _last_json(done: subprocess.CompletedProcess):
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- conformance under the interpreter ---------------------------------------------------------------

_CONFORMANCE = textwrap.dedent(
    """
    import json
    import torch
    from deepinfer_conformance.ops import run_spec
    from deepinfer_cpu.device import CPUDevice
    from deepinfer_interfaces.specs import SPECS
    from deepinfer_cuda.kernels import CUDAKernels

    k = CUDAKernels()
    rows = [[r.op, r.case, r.dtype, r.status, r.message] for op in OPS for r in run_spec(SPECS[op], k, CPUDevice())]
    # each op reached its kernel: only the kernels check these shapes (or read an id outside the table as zeros)
    reached = {}
    i64 = lambda *v: torch.tensor(v, dtype=torch.int64)
    for op, call in (
        ("engram_hash", lambda: k.engram_hash(torch.zeros(2, 3, dtype=torch.int64), i64(1, 3), i64(7, 11).view(2, 1), i64(0, 7))),
        ("engram_inject", lambda: k.engram_inject(torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.ones(1, 8), torch.ones(8), 1e-6)),
    ):
        try:
            call()
            reached[op] = False
        except Exception as exc:  # the reference raises something else, or nothing
            reached[op] = isinstance(exc, ValueError) and str(exc).startswith(op + ":")
    table = torch.arange(12, dtype=torch.float32).view(3, 4)
    try:  # the reference's index_select raises for an id past the table; the kernel reads zeros
        reached["engram_lookup"] = torch.equal(k.engram_lookup(table, None, i64(2, 3).view(1, 2), torch.float32),
                                               torch.stack([table[2], torch.zeros(4)])[None])
    except IndexError:
        reached["engram_lookup"] = False
    result = {"rows": rows, "reached": reached}
    """
).replace("OPS", repr(OPS))


_RUNNER = textwrap.dedent(
    """
    import json, traceback
    results = []
    for script in SCRIPTS:
        ns = {}
        try:
            exec(compile(script, "check", "exec"), ns)
            results.append(ns["result"])
        except BaseException:
            results.append({"error": traceback.format_exc()})
    print(json.dumps(results))
    """
)


def _checks(*scripts: str, interpret: bool, timeout: float = 240) -> list:
    """What each script leaves in ``result`` (or its traceback as ``{"error": ...}``), the scripts run in order
    in one process: each process start imports torch, which is most of a small check's time."""
    return _last_json(_python(_RUNNER.replace("SCRIPTS", repr(list(scripts))), interpret, timeout))


def _result(res):
    assert not (isinstance(res, dict) and "error" in res), res.get("error") if isinstance(res, dict) else res
    return res


@pytest.fixture(scope="module")
def interpreted() -> list:
    """Conformance, then the checks past the specs, in one interpreter process."""
    return _checks(_CONFORMANCE, _BEYOND_SPECS, interpret=True)


@pytest.fixture(scope="module")
def native() -> list:
    """The host-table lookup (first: before anything imports the kernels), then the compile check, in one
    process without the interpreter."""
    return _checks(_HOST_TABLE, _COMPILE, interpret=False, timeout=300)


def test_engram_kernels_pass_conformance_under_the_interpreter(interpreted: list) -> None:
    res = _result(interpreted[0])
    assert res["reached"] == {op: True for op in OPS}
    for op in OPS:
        rows = [r for r in res["rows"] if r[0] == op]
        spec = SPECS[op]
        assert {r[2] for r in rows} == {str(d).removeprefix("torch.") for d in spec.dtypes}
        assert len(rows) == len(spec.dtypes) * len(spec.cases())
    bad = [r for r in res["rows"] if r[3] != "pass"]
    assert not bad, bad


# ---- past the specs ----------------------------------------------------------------------------------

_BEYOND_SPECS = textwrap.dedent(
    """
    import torch
    from deepinfer_interfaces import Kernels
    from deepinfer_cuda.kernels import CUDAKernels

    ref, cu = Kernels(), CUDAKernels()
    g = torch.Generator().manual_seed(3)

    def exact(a, b):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    # hash: strided int64 and int32 windows, 9 tokens over 4-token tiles, 3 heads in a 4-wide tile, 5-grams,
    # full-range multipliers (negative too, so products and the XOR wrap and go negative) and a negative modulus
    big = torch.randint(-2**62, 2**62, (9, 10), generator=g)
    mult = torch.randint(-2**62, 2**62, (5,), generator=g) * 2 + 1
    primes = torch.randint(1, 2**40, (4, 3), generator=g)
    primes[2, 1] = -primes[2, 1]
    offsets = torch.randint(-2**20, 2**20, (12,), generator=g)
    windows = big[:, ::2]
    assert not windows.is_contiguous()
    got = cu.engram_hash(windows, mult, primes, offsets)
    exact(got, ref.engram_hash(windows, mult, primes, offsets))
    rem = got - offsets  # floored: in [0, p) for a positive modulus, in (p, 0] for the negative one (column 7)
    positive = torch.arange(12) != 7
    assert ((rem[:, positive] >= 0) & (rem[:, positive] < primes.flatten()[positive])).all()
    assert (rem[:, 7] <= 0).all() and (rem[:, 7] < 0).any() and (rem[:, 7] > primes[2, 1]).all()
    small = torch.randint(0, 99092, (6, 4), generator=g, dtype=torch.int32)
    exact(cu.engram_hash(small, mult[:4], primes[:3], offsets[:9]), ref.engram_hash(small, mult[:4], primes[:3], offsets[:9]))

    # lookup: 96 channels (3 scales, 3 channel tiles), strided ids, raw and float8 codes, every scale byte from
    # 0 (2^-127: subnormal products) to 255 (inf, and NaN times a zero code), NaN codes, each output dtype
    rows, hd = 40, 96
    codes = torch.randint(0, 256, (rows, hd), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (rows, hd // 32), generator=g, dtype=torch.uint8)
    scales[:3] = torch.tensor([0, 255, 127], dtype=torch.uint8)[:, None]
    ids = torch.randint(0, rows, (5, 14), generator=g)[:, 1::2]
    ids[0, :3] = torch.tensor([0, 1, 2])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        want = ref.engram_lookup(codes, scales, ids, dt)
        exact(cu.engram_lookup(codes, scales, ids, dt), want)
        exact(cu.engram_lookup(codes.view(torch.float8_e4m3fn), scales.view(torch.float8_e8m0fnu), ids, dt), want)
    # plain tables: fp32 values on bf16 rounding ties (to even, both ways) and carries, into bf16; fp16 <-> bf16
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0xBF818000, 0x7F7FFFFF, 0x00008000, 0x3F7FFFFF, 0x3F800001],
                        dtype=torch.int64).to(torch.int32).view(torch.float32)
    table = torch.cat([ties.view(1, 8).expand(3, 8), torch.randn(3, 8, generator=g)])
    tid = torch.tensor([[0, 3, 5], [1, 1, 4]])
    for src, dt in ((torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float16, torch.bfloat16),
                    (torch.bfloat16, torch.float16), (torch.bfloat16, torch.float32)):
        exact(cu.engram_lookup(table.to(src), None, tid, dt), ref.engram_lookup(table.to(src), None, tid, dt))
    exact(cu.engram_lookup(table, None, tid, torch.float64), ref.engram_lookup(table, None, tid, torch.float64))

    # inject: 100 channels (a partial last tile), 3 streams, key and value as views of one kv row as the model makes
    # them, 16-bit streams with an fp32 weight, tokens that differ in scale
    def rel(a, b):
        return ((a.double() - b.double()).abs() / (1 + b.double().abs())).max().item()

    t, n, d = 6, 3, 100
    streams = torch.randn(t, n, d, generator=g) * torch.logspace(-2, 2, t)[:, None, None]
    kv = torch.randn(t, (n + 1) * d + 7, generator=g)[:, 7:]
    key, value = kv[:, : n * d].reshape(t, n, d), kv[:, n * d :]
    weight = torch.randn(n, d, generator=g)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2), (torch.float16, 2e-3)):
        args = (streams.to(dt), key.to(dt), value.to(dt))
        got = cu.engram_inject(*args, weight, 1e-6)
        want = ref.engram_inject(*(a.double() for a in args), weight.double(), 1e-6)
        assert got.dtype == dt and got.shape == (t, n, d) and rel(got, want) < tol, (dt, rel(got, want))
    strided = torch.randn(t, 2 * n, d, generator=g)[:, ::2]
    assert rel(cu.engram_inject(strided, key, value, weight, 1e-6),
               ref.engram_inject(strided.double(), key.double(), value.double(), weight.double(), 1e-6)) < 1e-5
    # a zero key gives dot 0 and gate exactly 1/2; fp64 runs the reference bit for bit
    zero = cu.engram_inject(streams, torch.zeros(t, n, d), value, weight, 1e-6)
    assert torch.equal(zero, streams + 0.5 * value[:, None, :])
    s64, k64, v64, w64 = (x.double() for x in (streams, key, value, weight))
    assert torch.equal(cu.engram_inject(s64, k64, v64, w64, 1e-6), ref.engram_inject(s64, k64, v64, w64, 1e-6))
    result = "ok"
    """
)


def test_engram_kernels_match_the_reference_beyond_the_specs(interpreted: list) -> None:
    assert _result(interpreted[1]) == "ok"


# ---- where the lookup runs ---------------------------------------------------------------------------

_HOST_TABLE = textwrap.dedent(
    """
    import json, sys
    import torch
    from deepinfer_interfaces import Kernels
    from deepinfer_cuda.kernels import CUDAKernels

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 120, (50, 64), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (50, 2), generator=g, dtype=torch.uint8)
    ids = torch.randint(0, 50, (3, 24), generator=g)
    same = torch.equal(CUDAKernels().engram_lookup(codes, scales, ids, torch.bfloat16),
                       Kernels().engram_lookup(codes, scales, ids, torch.bfloat16))
    try:
        CUDAKernels().engram_lookup(codes, scales, torch.tensor([[50]]), torch.float32)
        raised = False
    except IndexError:
        raised = True
    try:
        CUDAKernels().engram_inject(torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.ones(1, 8), torch.ones(2, 8), 1e-6)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    result = {"same": same, "raised": raised, "refused": refused,
              "imported": "deepinfer_cuda.triton_engram" in sys.modules, "triton": "triton" in sys.modules}
    """
)


def test_a_host_table_is_gathered_by_the_reference_without_triton(native: list) -> None:
    """Without the interpreter CPU tensors are not Triton's: the lookup runs the reference (its host gather, and
    its IndexError for an id outside the table) and loads no Triton module of the backend; the injection refuses
    them clearly."""
    res = _result(native[0])
    assert res["same"] and res["raised"]
    assert not res["imported"] and not res["triton"]
    assert res["refused"] is not None and "cuda kernel engram_inject" in res["refused"]


# ---- the compile check -------------------------------------------------------------------------------

_COMPILE = textwrap.dedent(
    """
    import json
    from dataclasses import asdict
    from deepinfer_cuda.compile_check import V4_FLASH, compile_case, enumerate_cases
    from tests.helpers.published import V41_FLASH

    v, text = V4_FLASH.v41, V41_FLASH["text_config"]
    sizes = [[v.engram_ngram, v.engram_heads, v.engram_head_dim, v.engram_columns, v.engram_rows, v.hidden, v.hc_mult],
             [text["engram_max_ngram_size"], text["engram_n_heads"], text["engram_head_dim"],
              (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"], text["engram_num_embeddings"][0],
              text["hidden_size"], text["hc_mult"]]]
    cases = [c for c in enumerate_cases(90, dtypes=["bf16"]) if c.kernel.startswith("engram_")]
    records = [asdict(compile_case(c, t)) | {"args": {k: v for k, v in c.args.items() if isinstance(v, int)}}
               for t in (90, 100) for c in cases]
    result = {"sizes": sizes, "records": records}
    """
)


def test_the_engram_kernels_compile_at_v41_sizes_without_spills(native: list) -> None:
    res = _result(native[1])
    assert res["sizes"][0] == res["sizes"][1]
    records = res["records"]
    assert {(r["kernel"], r["target"]) for r in records} == {(k, t) for k in OPS for t in (90, 100)}
    assert len(records) == 2 * 4  # per target: the hash, the lookup of an FP8 and of a bf16 table, the injection
    for r in records:
        assert r["status"] == "ok" and r["spill_bytes"] == 0 and r["registers"] <= 128, r
    inject = next(r for r in records if r["kernel"] == "engram_inject")
    assert inject["args"]["D"] == 5120 and 5120 % inject["args"]["BLOCK_D"] == 0
    lookup = next(r for r in records if r["kernel"] == "engram_lookup")
    assert (lookup["args"]["C"], lookup["args"]["J"], lookup["args"]["BLOCK_J"]) == (24, 256, 256)

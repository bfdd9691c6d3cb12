"""The CUDA backend's vision-tower attention (``deepinfer_cuda.triton_vit``): under Triton's interpreter against the
reference past the op spec (q, k, v as strided views of one qkv as the tower passes them, images straddling tiles,
empty and one-patch images, int64 boundaries, bf16), and compiled ahead of time for sm_90 and sm_100.

Each check runs in a subprocess: ``TRITON_INTERPRET`` must be set (or unset) before Triton is first imported.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest

from tests.helpers.subprocesses import run_python

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[cuda]')")

_PARITY = textwrap.dedent(
    """
    import json, torch
    from deepinfer_interfaces import Kernels
    from deepinfer_cuda.kernels import CUDAKernels

    ref, cu = Kernels(), CUDAKernels()
    g = torch.Generator().manual_seed(3)
    errs = []
    for lengths, h, d, dt, idx in (([20, 1, 0, 13], 2, 16, torch.float32, torch.int32),
                                   ([37, 2, 30], 3, 24, torch.bfloat16, torch.int64),
                                   ([16, 16], 1, 32, torch.float16, torch.int32)):
        t = sum(lengths)
        qkv = torch.randn(t, 3, h, d, generator=g).to(dt)  # q, k, v: views of one tensor, strided like the tower's
        q, k, v = qkv.unbind(1)
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=idx)
        got = cu.vit_attention(q, k, v, bounds, d ** -0.5)
        want = ref.vit_attention(q, k, v, bounds, d ** -0.5)
        assert got.dtype == dt and got.shape == (t, h, d)
        errs.append((got.float() - want.float()).abs().max().item())
    # a token never sees another image: changing image 2's keys leaves image 1's rows alone
    q, k, v = (torch.randn(40, 2, 16, generator=g) for _ in range(3))
    bounds = torch.tensor([0, 17, 40], dtype=torch.int32)
    a = cu.vit_attention(q, k, v, bounds, 0.25)
    k2 = k.clone(); k2[17:] += 5.0
    b = cu.vit_attention(q, k2, v, bounds, 0.25)
    print(json.dumps({"errs": errs, "isolated": torch.equal(a[:17], b[:17]), "changed": not torch.equal(a[17:], b[17:])}))
    """
)


def test_kernel_matches_the_reference_past_the_spec_under_the_interpreter():
    proc = run_python(["-c", _PARITY], interpret=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    fp32, bf16, fp16 = res["errs"]
    assert fp32 < 1e-5 and bf16 < 2e-2 and fp16 < 2e-3, res["errs"]
    assert res["isolated"] and res["changed"]


_COMPILE = textwrap.dedent(
    """
    import json
    from dataclasses import asdict
    from deepinfer_cuda.compile_check import compile_case, enumerate_cases

    cases = [c for c in enumerate_cases(90, dtypes=["bf16", "fp16"]) if c.kernel == "vit_attention"]
    print(json.dumps([asdict(compile_case(c, t)) for c in cases for t in (90, 100)]))
    """
)


def test_kernel_compiles_for_sm90_and_sm100_without_spills_in_16_bits():
    proc = run_python(["-c", _COMPILE], interpret=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["dtype"], r["target"]) for r in records} == {(dt, t) for dt in ("bf16", "fp16") for t in (90, 100)}
    assert all(r["status"] == "ok" and r["spill_bytes"] == 0 for r in records), records

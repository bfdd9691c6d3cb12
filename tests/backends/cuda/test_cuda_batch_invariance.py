"""The CUDA kernels' batch-invariant mode under Triton's interpreter: a row's bits are the same alone and in a
batch, where the default launch configuration (splits chosen from the batch size) gives different bits.

Runs in a subprocess: ``TRITON_INTERPRET`` must be set before Triton is first imported. The interpreter's
bf16 dots are not the GPU's, so everything is compared within one interpreted run, never against the reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import json, torch
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_cuda.triton_attention import sparse_attention
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(4, 4, 32, generator=g), torch.randn(300, 32, generator=g)
    idx, sinks = torch.randint(0, 300, (4, 128), generator=g), torch.randn(4, generator=g)
    out = {}
    for inv in (False, True):
        full = sparse_attention(q, kv, idx, sinks, 0.2, invariant=inv)
        out[f"attention_{inv}"] = all(torch.equal(sparse_attention(q[i:i+1], kv, idx[i:i+1], sinks, 0.2, invariant=inv), full[i:i+1])
                                      for i in (0, 3))
    k = CUDAKernels()
    k.set_batch_invariant(True)
    x, w = torch.randn(20, 48, generator=g), torch.randn(24, 48, generator=g)
    full = k.linear(x, w)
    out["linear"] = all(torch.equal(k.linear(x[i:i+1], w), full[i:i+1]) for i in (0, 19))
    out["linear_err"] = (full - x @ w.t()).abs().max().item()
    streams, fn = torch.randn(5, 2, 64, generator=g), torch.randn(8, 128, generator=g) * 0.1
    base, scale = torch.randn(8, generator=g) * 0.1, torch.rand(3, generator=g)
    pre = k.mhc_pre(streams, fn, base, scale, 1e-6, 1e-6, 3)
    out["mhc_pre"] = all(torch.equal(a[i:i+1], b) for i in (0, 4)
                         for a, b in zip(pre, k.mhc_pre(streams[i:i+1], fn, base, scale, 1e-6, 1e-6, 3)))
    print(json.dumps(out))
    """
)


def test_mode_makes_interpreted_kernels_batch_invariant():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["attention_False"] is False, "the default split-KV launch was expected to depend on the batch here"
    assert got["attention_True"] and got["linear"] and got["mhc_pre"], got
    assert got["linear_err"] < 1e-4

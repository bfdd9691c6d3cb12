"""Greedy generation of a tiny DeepSeek-V4 through the CUDA backend's Triton kernels (Triton's
interpreter, CPU tensors) against the reference kernels: same tokens, close logits.

The checkpoint has every layer type (sliding, compressed sparse with the
indexer, heavily compressed) and both hash and learned routing, and the
prompts are long enough for both compressors to emit entries, so every model
op runs through its kernel. The run happens in a subprocess because
``TRITON_INTERPRET`` must be set before Triton is first imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.checkpoints import BOS_ID, make_tiny_checkpoint

_GENERATE = textwrap.dedent(
    """
    import json, sys
    import torch
    from deepinfer.models.common import Batch, ContiguousCache
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer.registry import select_backend
    from deepinfer_interfaces import Kernels

    model_dir, prompts, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    cuda = select_backend("cpu", kernels="cuda", interpret=True).kernels
    assert type(cuda).__name__ == "CUDAKernels", type(cuda)

    def generate(kernels):
        model = DeepseekV4Model.from_pretrained(model_dir, kernels, dtype=torch.float32)
        cache = ContiguousCache(model.config, len(prompts), max(map(len, prompts)) + steps + 1, dtype=torch.float32)
        slots = [cache.allocate() for _ in prompts]
        # the whole prompts in one step (prefill), then every sequence one token per step (decode)
        logits = model(Batch.build(prompts, slots, [0] * len(prompts)), cache)
        tokens, all_logits = [[] for _ in prompts], [logits]
        for _ in range(steps):
            nxt = logits.float().argmax(-1).tolist()
            for out, tok in zip(tokens, nxt):
                out.append(tok)
            starts = [len(p) + len(out) - 1 for p, out in zip(prompts, tokens)]
            logits = model(Batch.build([[t] for t in nxt], slots, starts), cache)
            all_logits.append(logits)
        return tokens, torch.stack(all_logits)

    got_tokens, got_logits = generate(cuda)
    want_tokens, want_logits = generate(Kernels())
    triton_modules = sorted(m for m in sys.modules if m.startswith("deepinfer_cuda.triton_"))
    print(json.dumps({
        "got": got_tokens, "want": want_tokens,
        "max_abs_diff": float((got_logits - want_logits).abs().max()),
        "logit_scale": float(want_logits.abs().max()),
        "modules": triton_modules,
    }))
    """
)


@pytest.mark.slow
def test_greedy_generation_through_triton_kernels_matches_reference(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, "mixed")
    g_prompts = [
        [BOS_ID] + list(b"Sparse attention with sinks!"),  # 29 tokens: past the 16-token heavy-compression window
        [BOS_ID] + list(b"mHC streams"),
    ]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("DEEPINFER_BACKEND", None)
    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE, str(ckpt), json.dumps(g_prompts), "8"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["got"] == res["want"]
    assert all(len(t) == 8 for t in res["got"])
    assert res["max_abs_diff"] <= 1e-4 * max(1.0, res["logit_scale"]), res
    for family in ("attention", "indexer", "compressor", "mhc", "moe", "experts", "cache", "norm", "rope"):
        assert f"deepinfer_cuda.triton_{family}" in res["modules"], res["modules"]

"""The CUDA backend's Triton kernels compiled ahead of time for sm_90 and sm_100 (``deepinfer_cuda.compile_check``).

No GPU needed: Triton's bundled ptxas lowers the kernels to cubins here. The
checks run in a subprocess (``TRITON_INTERPRET`` must be unset when Triton is
first imported, and this process may have set it) with the Triton cache in
``build/triton-cache`` (or ``TRITON_CACHE_DIR``), so later runs reuse it.
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

# find_spec, not importorskip: importing Triton here would stop later tests from choosing the interpreter
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (pip install -e '.[cuda]'); the CUDA compile check needs it",
)

ROOT = Path(__file__).resolve().parents[3]
CACHE = ROOT / "build" / "triton-cache"


def _python(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEEPINFER_BACKEND")}
    env.setdefault("TRITON_CACHE_DIR", str(CACHE))
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


_QUICK = textwrap.dedent(
    """
    import json
    from dataclasses import asdict
    from deepinfer_cuda.compile_check import backend_kernels, check, enumerate_cases

    records = check((90, 100), quick=True)
    quick = {id(c.fn) for c in enumerate_cases(90) if c.quick}
    missing = [name for name, fn in backend_kernels().items() if id(fn) not in quick]
    print(json.dumps({"records": [asdict(r) for r in records], "missing": missing, "kernels": len(backend_kernels())}))
    """
)


def test_every_kernel_compiles_within_the_limits_of_sm90_and_sm100() -> None:
    proc = _python(["-c", _QUICK], timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["kernels"] >= 22 and not res["missing"], res["missing"]
    records = res["records"]
    assert {r["target"] for r in records} == {90, 100}
    assert {(r["kernel"], r["target"]) for r in records} >= {(r["kernel"], t) for r in records for t in (90, 100)}
    bad = [r for r in records if r["status"] not in ("ok", "spills")]
    assert not bad, "\n".join(f"{r['kernel']} {r['config']} {r['dtype']} sm_{r['target']}: {r['status']} {r['error']}" for r in bad)
    assert all(r["shared_bytes"] is not None and r["registers"] for r in records)


_OVERSIZED = textwrap.dedent(
    """
    import json
    from dataclasses import asdict, replace
    from deepinfer_cuda.compile_check import compile_case, enumerate_cases

    up = next(c for c in enumerate_cases(90, dtypes=["bf16"]) if c.quick and c.kernel == "moe_experts.up" and "bf16 weights" in c.config)
    big = replace(up, config="oversized", args={**up.args, "BLOCK_N": 256, "BLOCK_K": 128}, options={**up.options, "num_stages": 4})
    print(json.dumps([asdict(compile_case(big, t)) for t in (90, 100)]))
    """
)


def test_a_real_kernel_with_an_oversized_tile_is_reported_over_the_shared_memory_limit() -> None:
    proc = _python(["-c", _OVERSIZED], timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for record in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert record["error"] is None and record["shared_bytes"] > 227 * 1024, record
        assert record["status"] == "shared>limit", record


_CLASSIFY = textwrap.dedent(
    """
    from deepinfer_cuda.compile_check import SM90, Record, classify

    def status(**fields):
        return classify(Record("k", "c", "bf16", 90, shared_bytes=1024, **fields), SM90)

    assert status(registers=128, spill_bytes=0, threads=512) == "ok"
    assert status(registers=130, spill_bytes=0, threads=512) == "regs>limit"  # 136 allocated per thread x 512 > 64 K
    assert status(registers=64, spill_bytes=0, threads=2048) == "threads>limit"
    assert status(registers=255, spill_bytes=400, threads=256) == "spills"
    assert not Record("k", "c", "bf16", 90, status="spills").failed and Record("k", "c", "bf16", 90, status="shared>limit").failed
    print("ok")
    """
)


def test_registers_and_threads_beyond_a_block_are_failures_and_spills_are_not() -> None:
    proc = _python(["-c", _CLASSIFY], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


_SIZES = textwrap.dedent(
    """
    from deepinfer_cuda.compile_check import V4_FLASH as s
    from tests.helpers.published import V4_FLASH as release

    got = (s.hidden, s.heads, s.head_dim, s.rope_dim, s.q_lora, s.index_heads, s.index_dim, s.index_topk, s.experts,
           s.top_k, s.moe_inter, s.window, {s.csa_ratio, s.hca_ratio}, s.hc_mult, s.sinkhorn_iters, s.vocab,
           s.fp8_block, s.linear)
    want = tuple(release[k] for k in ("hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
                                      "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
                                      "num_experts_per_tok", "moe_intermediate_size", "sliding_window"))
    want += ({r for r in release["compress_ratios"] if r}, release["hc_mult"], release["hc_sinkhorn_iters"],
             release["vocab_size"], tuple(release["quantization_config"]["weight_block_size"]),
             (release["hidden_size"], release["o_groups"] * release["o_lora_rank"]))
    assert got == want, (got, want)
    assert release["expert_dtype"] == "fp4" and release["quantization_config"]["scale_fmt"] == "ue8m0"
    print("ok")
    """
)


def test_the_sizes_are_deepseek_v4_flash() -> None:
    proc = _python(["-c", _SIZES], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


_FORMATS = textwrap.dedent(
    """
    from deepinfer.models.registry import parse_config
    from deepinfer_cuda.compile_check import PACKED
    from tests.helpers.published import V4_FLASH, V41_FLASH

    v4, v41 = parse_config(V4_FLASH), parse_config(V41_FLASH)
    fp8, fp8_float = v4.kv_cache_formats("fp8"), v4.packed_cache_formats("float")
    v41_fp8 = v41.kv_cache_formats("fp8")
    got = (PACKED.v4_kv, PACKED.v4_kv, PACKED.v4_index, PACKED.v4_kv_fp32, PACKED.v41_window, PACKED.v41_entry, PACKED.v41_index)
    want = (fp8.window, fp8.entry, fp8.index, fp8_float.window, v41_fp8.window, v41_fp8.entry, v41_fp8.index)
    assert got == want, (got, want)
    print("ok")
    """
)


def test_the_packed_formats_are_the_engines() -> None:
    proc = _python(["-c", _FORMATS], timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("DEEPINFER_COMPILE_SWEEP") != "1",
    reason="the full sweep takes ~9 min cold on 2 cores: `make compile-check` (or DEEPINFER_COMPILE_SWEEP=1) runs it",
)
def test_full_sweep_every_config_dtype_and_target_compiles_within_the_limits(tmp_path: Path) -> None:
    out = tmp_path / "records.json"
    proc = _python(["-m", "deepinfer_cuda.compile_check", "--json", str(out)], timeout=3600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    records = json.loads(out.read_text())
    assert {r["dtype"] for r in records} == {"bf16", "fp16", "fp32"} and {r["target"] for r in records} == {90, 100}

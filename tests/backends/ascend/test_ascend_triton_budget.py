"""The Triton-Ascend kernels against the unified-buffer (UB) budget and the reported miscompiles.

(a) every kernel's tiles at DeepSeek-V4-Flash shapes fit the UB of each SoC
generation, an oversized request is refused by the launcher with a clear
message, and the documented footprint table is the one the planner computes;
(b) each kernel, run under Triton's interpreter, matches the reference at
shapes whose reduction extents are padded (an inner extent of 4 to 16, 8 to
16, 20 to 32); (c) a static check of the kernel sources: no 3-D tiles, and
every 2-D reduction along the last axis.

Whatever imports Triton runs in a subprocess (``TRITON_INTERPRET`` must be set
before Triton's first import).
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

import pytest

from deepinfer.models.common.config import CSA, HCA
from deepinfer_ascend.flash_plans import V4_FLASH
from deepinfer_ascend.launch import REDUCE_MIN, UNIFIED_BUFFERS, KiB
from tests.helpers.published import V4_FLASH as V4_FLASH_RELEASE
from tests.helpers.subprocesses import run_python
from deepinfer.models.registry import parse_config

ROOT = Path(__file__).resolve().parents[3]
KERNEL_FILES = [ROOT / "backends/ascend/deepinfer_ascend" / f"triton_ascend_{k}.py" for k in ("mhc", "indexer", "compressor", "kv_quant")]


def _run(script: str, timeout: float = 300) -> str:
    proc = run_python(["-c", script], interpret=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


# ---- (a) the budget at V4-Flash shapes ------------------------------------------------------

_PLANS = textwrap.dedent(
    """
    import json, torch
    from deepinfer_ascend.flash_plans import footprint_table, v4_flash_plans
    from deepinfer_ascend.launch import UNIFIED_BUFFERS
    out = {"table": footprint_table(), "plans": []}
    for gen in UNIFIED_BUFFERS:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for p in v4_flash_plans(gen, dtype):
                out["plans"].append(dict(gen=gen, dtype=str(dtype), kernel=p.kernel, shape=p.shape, blocks=p.blocks,
                                         bytes=p.bytes, budget=p.ub.budget_bytes, fits=p.fits))
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def v4_plans() -> dict:
    return json.loads(_run(_PLANS))


def test_v4_flash_shapes_are_the_release_config():
    cfg = parse_config(V4_FLASH_RELEASE)
    assert (V4_FLASH.hidden, V4_FLASH.hc_mult, V4_FLASH.head_dim) == (cfg.hidden_size, cfg.hc_mult, cfg.head_dim)
    assert (V4_FLASH.index_heads, V4_FLASH.index_head_dim) == (cfg.index_n_heads, cfg.index_head_dim)
    assert (V4_FLASH.csa_ratio, V4_FLASH.hca_ratio) == (cfg.compress_ratio(CSA), cfg.compress_ratio(HCA))
    assert V4_FLASH.max_positions == cfg.max_position_embeddings


def test_ub_table_per_generation():
    assert {g: ub.budget_bytes // KiB for g, ub in UNIFIED_BUFFERS.items()} == {"a2": 192, "a3": 192, "950": 216}
    assert all(ub.budget_bytes <= ub.physical_bytes and ub.source for ub in UNIFIED_BUFFERS.values())


def test_every_kernel_fits_every_generation_at_v4_flash_shapes(v4_plans):
    plans = v4_plans["plans"]
    kernels = {p["kernel"] for p in plans}
    assert kernels == {"mhc_pre", "mhc_head", "mhc_post", "indexer_scores", "compress_kv"}
    assert len(plans) == len(UNIFIED_BUFFERS) * 3 * 7
    for p in plans:
        assert p["fits"] and 0 < p["bytes"] <= p["budget"], p
        # the reduced axes are padded to at least REDUCE_MIN lanes
        for axis in ("BLOCK_G", "BLOCK_F", "BLOCK_S"):
            assert p["blocks"].get(axis, REDUCE_MIN) >= REDUCE_MIN, p
        if p["kernel"] == "indexer_scores":
            assert p["blocks"]["BLOCK_D"] == V4_FLASH.index_head_dim, p
    # V4's CSA window of 4 overlaps into 8 slots, padded to 16; the HCA window of 128 needs no padding
    csa = [p for p in plans if p["kernel"] == "compress_kv" and p["shape"].startswith("overlapping m=4")]
    hca = [p for p in plans if p["kernel"] == "compress_kv" and p["shape"].startswith("m=128")]
    assert csa and all(p["blocks"]["BLOCK_S"] == 16 for p in csa)
    assert hca and all(p["blocks"]["BLOCK_S"] == 128 for p in hca)


def test_the_docs_report_the_planned_footprints(v4_plans):
    doc = (ROOT / "docs/ascend-bring-up.md").read_text()
    assert v4_plans["table"] in doc, "regenerate the table: python -c 'from deepinfer_ascend.flash_plans import footprint_table; print(footprint_table())'"


# ---- (b) the kernels against the reference, at padded reduction extents ---------------------

_PADDED = textwrap.dedent(
    """
    import torch
    from deepinfer_interfaces import Kernels
    from deepinfer_ascend.kernels import AscendKernels
    from deepinfer_ascend.launch import SMALLEST_UB
    from deepinfer_ascend.triton_ascend_compressor import plan_compress_kv
    from deepinfer_ascend.triton_ascend_indexer import plan_indexer_scores
    from deepinfer_ascend.triton_ascend_mhc import plan_mhc_pre

    ref, asc = Kernels(), AscendKernels(strict=True)
    g = torch.Generator().manual_seed(7)

    from tests.helpers.subprocesses import assert_close as close

    # the padding the plans choose for these shapes
    ub = SMALLEST_UB
    assert plan_mhc_pre(4, 20, torch.float32, ub, interpret=True).blocks["BLOCK_G"] == 16
    assert plan_indexer_scores(3, 4, 10, torch.float32, ub, interpret=True).blocks["BLOCK_D"] == 16
    assert plan_compress_kv(4, 6, True, torch.float32, torch.float32, ub, interpret=True).blocks["BLOCK_S"] == 16
    assert plan_compress_kv(20, 6, False, torch.float32, torch.float32, ub, interpret=True).blocks["BLOCK_S"] == 32

    # mHC with 4 streams (the Sinkhorn matrix padded 4 -> 16 per axis) and 3, over 20 channels
    for n in (4, 3):
        d = 20
        x = torch.randn(3, n, d, generator=g)
        fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.1
        base = torch.randn((2 + n) * n, generator=g) * 0.5
        scale = torch.rand(3, generator=g) + 0.5
        pre = asc.mhc_pre(x, fn, base, scale, 1e-6, 1e-6, 20)
        close(pre, ref.mhc_pre(x, fn, base, scale, 1e-6, 1e-6, 20))
        y = torch.randn(3, d, generator=g)
        close(asc.mhc_post(y, x, pre[1], pre[2]), ref.mhc_post(y, x, pre[1], pre[2]))
        hf = torch.randn(n, n * d, generator=g) * 0.1
        close(asc.mhc_head(x, hf, base[:n], scale[:1], 1e-6, 1e-6), ref.mhc_head(x, hf, base[:n], scale[:1], 1e-6, 1e-6))
    # bf16 streams: the kernel's fp32 math against the reference on the same bf16 inputs
    xb = x.bfloat16()
    close(asc.mhc_head(xb, hf, base[:3], scale[:1], 1e-6, 1e-6), ref.mhc_head(xb, hf, base[:3], scale[:1], 1e-6, 1e-6), 1e-2)

    # indexer heads of width 4 (padded to 16), 3 heads over 10 candidates with holes
    q = torch.randn(2, 3, 4, generator=g)
    keys = torch.randn(12, 4, generator=g)
    cand = torch.randint(-1, 12, (2, 10), generator=g)
    w = torch.randn(2, 3, generator=g)
    close(asc.indexer_scores(q, w, keys, cand, 0.5), ref.indexer_scores(q, w, keys, cand, 0.5))

    # windows of 4 overlapping into 8 slots (padded to 16), of 3 (padded to 16) and of 20 (padded to 32)
    for m, overlap in ((4, True), (3, False), (20, False)):
        c = 12 if overlap else 6
        kv, gate = torch.randn(40, c, generator=g), torch.randn(40, c, generator=g) * 2
        bias = torch.randn(m, c, generator=g)
        idx = torch.randint(-1, 40, (5, m), generator=g)
        prev = torch.randint(-1, 40, (5, m), generator=g) if overlap else None
        idx[2] = -1
        if overlap:
            prev[2] = -1
        close(asc.compress_kv(kv, gate, bias, idx, prev), ref.compress_kv(kv, gate, bias, idx, prev))
    print("ok")
    """
)


def test_kernels_match_the_reference_at_padded_reduction_extents():
    assert _run(_PADDED) == "ok"


_OVERSIZED = textwrap.dedent(
    """
    import json, torch
    from deepinfer_interfaces import NotSupportedError
    from deepinfer_ascend.kernels import AscendKernels
    from deepinfer_ascend.launch import UbBudgetError

    asc = AscendKernels(strict=True)
    requests = {
        # an index head dim of 65536: its keys tile alone is over 1 MiB at one candidate
        "indexer_scores": lambda: asc.indexer_scores(
            torch.randn(1, 2, 65536), torch.randn(1, 2), torch.randn(3, 65536), torch.zeros(1, 2, dtype=torch.long), 1.0),
        # a window of 8192 slots: one channel of it is 480 KiB
        "compress_kv": lambda: asc.compress_kv(
            torch.randn(8192, 4), torch.randn(8192, 4), torch.randn(8192, 4), torch.arange(8192).view(1, -1), None),
        # 256 streams: the padded 256 x 256 Sinkhorn matrix and its copies are 3 MiB
        "mhc_pre": lambda: asc.mhc_pre(
            torch.randn(1, 256, 1), torch.randn(258 * 256, 256), torch.randn(258 * 256), torch.ones(3), 1e-6, 1e-6, 2),
    }
    out = {}
    for op, call in requests.items():
        try:
            call()
        except UbBudgetError as exc:
            assert isinstance(exc, NotSupportedError)
            out[op] = str(exc)
        else:
            raise AssertionError(f"{op} launched an oversized tile")
    print(json.dumps(out))
    """
)


def test_an_oversized_request_is_refused_with_a_clear_message():
    messages = json.loads(_run(_OVERSIZED))
    assert set(messages) == {"indexer_scores", "compress_kv", "mhc_pre"}
    for op, msg in messages.items():
        assert msg.startswith(f"{op} (") and "does not fit the unified buffer of an Ascend a2 vector core" in msg, msg
        assert "KiB of 192 KiB even at the smallest blocks" in msg and f"DEEPINFER_ASCEND_DISABLE={op}" in msg, msg
    assert "BLOCK_K=1" in messages["indexer_scores"] and "keys" in messages["indexer_scores"]
    assert "BLOCK_S=8192, BLOCK_C=1" in messages["compress_kv"]


# ---- (c) the kernel sources avoid the reported patterns ---------------------------------------

_REDUCTIONS = {"sum", "max", "min", "argmax", "argmin", "reduce", "xor_sum"}


def _jit_functions(path: Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    return [f for f in tree.body if isinstance(f, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in f.decorator_list)]


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.stem)
def test_kernels_build_no_3d_tiles_and_reduce_only_the_last_axis(path):
    functions = _jit_functions(path)
    assert functions
    for fn in functions:
        for node in ast.walk(fn):
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
                assert len(node.slice.elts) <= 2, f"{path.name}:{node.lineno}: a 3-D tile ({ast.unparse(node)})"
            if isinstance(node, ast.Call) and ast.unparse(node.func) in {f"tl.{r}" for r in _REDUCTIONS}:
                axis = next((k.value for k in node.keywords if k.arg == "axis"), None)
                where = f"{path.name}:{node.lineno}: {ast.unparse(node)}"
                assert isinstance(axis, ast.Constant), f"{where}: give the axis"
                # 2-D tiles reduce axis 1; only the 1-D helper reduces axis 0, its only axis
                assert axis.value == 1 or (fn.name == "_total" and axis.value == 0), f"{where}: not the last axis of a 2-D tile"

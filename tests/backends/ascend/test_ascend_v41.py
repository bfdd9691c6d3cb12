"""The Ascend overrides of DeepSeek V4.1's ops, checked without an NPU.

- ``mhc_mix``, ``mhc_collapse``, ``candidate_blocks``, ``engram_inject`` as
  Triton-Ascend kernels under Triton's interpreter (a subprocess:
  ``TRITON_INTERPRET`` must be set before Triton's first import) against the
  reference, at shapes beyond the op specs (which the conformance run in
  ``tests/backends/ascend/test_ascend.py`` already covers): several channel blocks, a
  non-power-of-two stream count, strided inputs, and the candidate selection's
  corners (``-0.0`` tying ``+0.0``, ``+inf`` below the pinned block, a top-1
  that is the pinned block, ``visible`` past the row, blocks wider than a
  column chunk);
- ``mhc_mix`` on Ascend 950 through ``npu_mhc_pre`` (``out_flag=1``, its
  ``h_pre``) + ``npu_mhc_sinkhorn`` against the stand-ins of
  ``tests/backends/ascend/test_ascend_fused_v4.py`` (written from CANN's goldens, with the
  wheel's signatures), its SoC gate and limits, and its fallback on error;
- the unified-buffer budget of the new launches at V4.1-Flash shapes, and the
  footprint table the docs print.
"""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer_ascend.kernels import AscendKernels
from deepinfer_interfaces import Kernels, NotSupportedError
from tests.helpers.subprocesses import run_python
from tests.backends.ascend.test_ascend_fused_v4 import A2, A3, ASCEND_950, HALF, DocumentedV4Ops, close
from tests.backends.ascend.test_ascend_triton_budget import test_kernels_build_no_3d_tiles_and_reduce_only_the_last_axis as _check_kernel_source

ROOT = Path(__file__).resolve().parents[3]
REF = Kernels()
V41_OPS = {"mhc_mix", "mhc_collapse", "candidate_blocks", "engram_inject"}


def _run(script: str, timeout: float = 300) -> str:
    proc = run_python(["-c", script], interpret=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


# ---- the declared paths ---------------------------------------------------------------------


def test_the_v41_ops_are_overridden_and_declare_their_paths():
    paths = AscendKernels.paths()
    assert paths["mhc_mix"] == "triton-ascend (950: torch_npu:npu_mhc_pre+npu_mhc_sinkhorn)"
    assert {paths[op] for op in V41_OPS - {"mhc_mix"}} == {"triton-ascend"}
    for op in V41_OPS:
        assert getattr(AscendKernels, op) is not getattr(Kernels, op), f"{op} still inherits the reference"


def test_without_torch_npu_or_the_interpreter_the_kernels_are_not_supported_when_strict():
    g = torch.Generator().manual_seed(0)
    scores, visible = torch.randn(2, 16, generator=g), torch.tensor([16, 9])
    x, pre, weight = torch.randn(2, 4, 16, generator=g), torch.rand(2, 4, generator=g), torch.randn(4, 16, generator=g)
    calls = {
        "candidate_blocks": lambda k: k.candidate_blocks(scores, visible, 2, 4),
        "mhc_collapse": lambda k: k.mhc_collapse(x, pre),
        "engram_inject": lambda k: k.engram_inject(x, x.flip(1), x[:, 0], weight, 1e-6),
    }
    for op, call in calls.items():
        assert torch.equal(call(AscendKernels()), call(REF)), op  # the default set quietly runs the reference
        with pytest.raises(NotSupportedError, match=f"needs torch_npu or the Triton interpreter: {op} is a Triton-Ascend kernel"):
            call(AscendKernels(strict=True))


# ---- the Triton-Ascend kernels under the interpreter ------------------------------------------

_KERNELS = textwrap.dedent(
    """
    import sys, torch
    from deepinfer_interfaces import Kernels
    from deepinfer_ascend.kernels import AscendKernels
    from tests.helpers.subprocesses import assert_close as close

    ref, asc = Kernels(), AscendKernels(strict=True)
    g = torch.Generator().manual_seed(41)
    NEG, INF = float("-inf"), float("inf")

    # mHC: 3 and 4 streams over 40 channels (several channel and RMS blocks), strided streams
    for n in (3, 4):
        d = 40
        x = torch.randn(3, n, 48, generator=g)[..., :d]
        fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.1
        base = torch.randn((2 + n) * n, generator=g) * 0.5
        scale = torch.rand(3, generator=g) + 0.5
        mixed = asc.mhc_mix(x, fn, base, scale, 1e-6, 1e-6, 7)
        close(mixed, ref.mhc_mix(x, fn, base, scale, 1e-6, 1e-6, 7))
        close(asc.mhc_collapse(x, mixed[0]), ref.mhc_collapse(x, mixed[0]))
        # mhc_pre (the same kernel, collapsing) is still mix then collapse
        close(asc.mhc_pre(x, fn, base, scale, 1e-6, 1e-6, 7), ref.mhc_pre(x, fn, base, scale, 1e-6, 1e-6, 7))
    # V4.1's first site collapses with a one-hot pre; bf16 streams at V4.1's width
    one_hot = torch.zeros(2, 4)
    one_hot[:, 0] = 1.0
    xb = torch.randn(2, 4, 5120, generator=g).bfloat16()
    got = asc.mhc_collapse(xb, one_hot)
    assert torch.equal(got, xb[:, 0]), "a one-hot pre picks stream 0 exactly"
    pre = torch.rand(2, 4, generator=g) + 1e-6
    close(asc.mhc_collapse(xb, pre), ref.mhc_collapse(xb, pre), 1e-2)

    # Engram injection: 3 streams of 70 channels (blocks of 16, a partial last one), strided streams, bf16
    t, n, d = 4, 3, 70
    streams = torch.randn(t, n, 80, generator=g)[..., :d] * 3
    key, value = torch.randn(t, n, d, generator=g), torch.randn(t, d, generator=g)
    weight = torch.randn(n, d, generator=g)
    close(asc.engram_inject(streams, key, value, weight, 1e-6), ref.engram_inject(streams, key, value, weight, 1e-6))
    sb, kb, vb = streams.bfloat16(), key.bfloat16(), value.bfloat16()
    close(asc.engram_inject(sb, kb, vb, weight, 1e-6), ref.engram_inject(sb, kb, vb, weight, 1e-6), 1e-2)
    # a gate that is exactly 1/2 (zero weight) and one whose dot is clamped (tiny weight), at one token
    half = asc.engram_inject(streams[:1], key[:1], value[:1], torch.zeros(n, d), 1e-6)
    assert torch.allclose(half, streams[:1] + 0.5 * value[:1, None, :], atol=1e-6)
    tiny = weight * 1e-12
    close(asc.engram_inject(streams, key, value, tiny, 1e-6), ref.engram_inject(streams, key, value, tiny, 1e-6))

    # candidate blocks, compared exactly
    def same(scores, visible, k, bs):
        visible = torch.tensor(visible)
        got, want = asc.candidate_blocks(scores, visible, k, bs), ref.candidate_blocks(scores, visible, k, bs)
        assert got.dtype == torch.bool and torch.equal(got, want), (k, bs, got.int(), want.int())
        return got

    # -0.0 ties +0.0: the lower block wins the one slot next to the pinned block
    row = torch.tensor([[-0.0, -1, -2, -3, 0.0, -1, -2, -3, 5, 5, 5, 5]])
    assert same(row, [12], 2, 4)[0].tolist() == [True] * 4 + [False] * 4 + [True] * 4
    # +inf ranks below the pinned block; top-1 is the pinned block alone, even when it is all -inf
    row = torch.tensor([[1.0, INF, 2, 3, NEG, NEG], [1.0, INF, 2, 3, 0, 0]])
    assert same(row, [6, 6], 1, 2).tolist() == [[False] * 4 + [True] * 2] * 2
    same(row, [6, 6], 2, 2)
    # visible past the row: no block is pinned
    same(torch.randint(-3, 3, (2, 10), generator=g).float(), [40, 11], 2, 4)
    # every block tied: the pinned one, then the lowest indices
    assert same(torch.zeros(1, 24), [17], 3, 4)[0].tolist() == [True] * 8 + [False] * 8 + [True] * 4 + [False] * 4
    # blocks of 20 (wider than the interpreter's 16-column chunk), 70 entries, -inf holes, fp16 and bf16 scores
    s = torch.randint(-4, 4, (3, 70), generator=g).float()
    s[:, 20:40] = NEG
    s[1, 45:] = NEG
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        same(s.to(dt), [70, 45, 0], 2, 20)
    # random rows: -inf past each row's visible count and at random, several key chunks per counting pass
    t, n = 5, 1000
    s = torch.randn(t, n, generator=g)
    vis = [1000, 999, 513, 1, 0]
    s[torch.arange(n)[None, :] >= torch.tensor(vis)[:, None]] = NEG
    s[torch.rand(t, n, generator=g) < 0.2] = NEG
    for k in (1, 17, 200):
        same(s, vis, k, 8)
    print("ok")
    """
)


def test_v41_kernels_match_the_reference_beyond_the_op_specs():
    assert _run(_KERNELS) == "ok"


def test_the_engram_kernel_builds_no_3d_tiles_and_reduces_only_the_last_axis():
    _check_kernel_source(ROOT / "backends/ascend/deepinfer_ascend/triton_ascend_engram.py")


# ---- mhc_mix on Ascend 950: npu_mhc_pre (out_flag=1) + npu_mhc_sinkhorn ------------------------


def _mix_case(n: int, d: int, iters: int, seed: int, dtype: torch.dtype = torch.bfloat16, t: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(t, n, d, generator=g).to(dtype), fn=torch.randn((2 + n) * n, n * d, generator=g) * (n * d) ** -0.5,
                base=torch.randn((2 + n) * n, generator=g) * 0.5, scale=torch.rand(3, generator=g) + 0.5,
                norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=iters)


@pytest.mark.parametrize("dtype", HALF)
def test_mhc_mix_on_950_runs_the_fused_ops_and_matches_the_reference(dtype):
    for n, d, iters in ((4, 16, 20), (6, 32, 3), (8, 16, 1), (4, 5120, 20)):
        kw = _mix_case(n, d, iters, seed=n + d, dtype=dtype)
        tn = DocumentedV4Ops(ASCEND_950)
        got = AscendKernels(torch_npu=tn).mhc_mix(**kw)
        close(got, REF.mhc_mix(**kw), dtype)
        assert tn.calls == ["npu_mhc_pre", "npu_mhc_sinkhorn"], (n, d)
        # pre is the op's h_pre: its own gate, not a collapse weight derived elsewhere
        assert got[0].dtype == torch.float32 and bool((got[0] > 0).all())


@pytest.mark.parametrize("soc_version", [A3, A2])
def test_mhc_mix_keeps_the_triton_path_on_a2_and_a3(soc_version):
    kw = _mix_case(4, 16, 20, 1)
    tn = DocumentedV4Ops(soc_version)
    kernels = AscendKernels(torch_npu=tn)
    close(kernels.mhc_mix(**kw), REF.mhc_mix(**kw), torch.bfloat16)  # no Triton in this process: the reference
    with pytest.raises(NotSupportedError, match="Triton"):
        kernels.for_conformance().mhc_mix(**kw)
    assert tn.calls == []


def test_mhc_mix_outside_the_ops_limits_takes_the_triton_path():
    tn = DocumentedV4Ops(ASCEND_950)
    kernels = AscendKernels(torch_npu=tn)
    fits = _mix_case(4, 16, 20, 3)
    for kw in (_mix_case(4, 16, 20, 3, torch.float32), _mix_case(4, 24, 20, 4), _mix_case(3, 16, 20, 5),
               {**fits, "sinkhorn_iters": 0}, {**fits, "sinkhorn_iters": 101}):
        assert all(torch.equal(a, b) for a, b in zip(kernels.mhc_mix(**kw), REF.mhc_mix(**kw), strict=True))
    assert tn.calls == []
    assert REF.mhc_mix(**{**fits, "x": fits["x"][:0]})[0].shape == kernels.mhc_mix(**{**fits, "x": fits["x"][:0]})[0].shape == (0, 4)
    assert tn.calls == []


def test_a_raising_mhc_mix_falls_back_once_with_one_warning(caplog):
    tn = DocumentedV4Ops(ASCEND_950, raises={"npu_mhc_sinkhorn": RuntimeError("EZ9999: Inner Error!\nEZ9999: sinkhorn tiling")})
    kernels = AscendKernels(torch_npu=tn)
    kw = _mix_case(4, 16, 20, 6)
    with caplog.at_level(logging.WARNING, logger="deepinfer.ascend"):
        for _ in range(2):
            close(kernels.mhc_mix(**kw), REF.mhc_mix(**kw), torch.bfloat16)
    lines = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ascend" and r.levelno == logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "mhc_mix (triton-ascend (950: torch_npu:npu_mhc_pre+npu_mhc_sinkhorn)) raised RuntimeError: EZ9999" in lines[0]
    assert "the Triton-Ascend kernel" in lines[0]
    assert tn.calls == ["npu_mhc_pre", "npu_mhc_sinkhorn"] and set(kernels.failed) == {"mhc_mix"}
    # the verdict is per op: mhc_pre, on the same two ops, still tries them (and fails on its own)
    close(kernels.mhc_pre(**kw), REF.mhc_pre(**kw), torch.bfloat16)
    assert tn.calls[2:] == ["npu_mhc_pre", "npu_mhc_sinkhorn"] and set(kernels.failed) == {"mhc_mix", "mhc_pre"}
    strict = AscendKernels(torch_npu=DocumentedV4Ops(ASCEND_950, raises={"npu_mhc_pre": RuntimeError("EZ1001: bad phi")}))
    with pytest.raises(RuntimeError, match="EZ1001"):
        strict.for_conformance().mhc_mix(**kw)


def test_the_reference_a_failed_mhc_pre_falls_back_to_runs_no_part_of_it_fused(caplog):
    """The reference mhc_pre is mhc_mix then mhc_collapse: its fallback must not reach this set's mhc_mix."""
    tn = DocumentedV4Ops(ASCEND_950, raises={"npu_mhc_sinkhorn": RuntimeError("EZ9999: sinkhorn")})
    kernels = AscendKernels(torch_npu=tn)
    kw = _mix_case(4, 16, 20, 7)
    with caplog.at_level(logging.WARNING, logger="deepinfer.ascend"):
        for _ in range(2):
            close(kernels.mhc_pre(**kw), REF.mhc_pre(**kw), torch.bfloat16)
    assert tn.calls == ["npu_mhc_pre", "npu_mhc_sinkhorn"] and set(kernels.failed) == {"mhc_pre"}
    close(kernels.mhc_mix(**kw), REF.mhc_mix(**kw), torch.bfloat16)  # mhc_mix has its own verdict
    assert tn.calls[2:] == ["npu_mhc_pre", "npu_mhc_sinkhorn"] and set(kernels.failed) == {"mhc_pre", "mhc_mix"}


# ---- the unified-buffer budget at V4.1-Flash shapes -------------------------------------------

_PLANS = textwrap.dedent(
    """
    import json, torch
    from deepinfer_ascend.flash_plans import footprint_table, v41_flash_plans
    from deepinfer_ascend.launch import UNIFIED_BUFFERS
    from deepinfer_ascend.triton_ascend_engram import plan_engram_inject
    from deepinfer_ascend.triton_ascend_mhc import channel_block
    out = {"table": footprint_table(plans=v41_flash_plans, model="V4.1-Flash"), "plans": [],
           "blocks": {d: channel_block(d, 4096) for d in (16, 24, 4096, 5120, 7168)},
           "wide": plan_engram_inject(4, 1 << 20, torch.float32, torch.float32, UNIFIED_BUFFERS["a2"]).fits}
    for gen in UNIFIED_BUFFERS:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for p in v41_flash_plans(gen, dtype):
                out["plans"].append(dict(kernel=p.kernel, shape=p.shape, blocks=p.blocks, fits=p.fits, bytes=p.bytes))
    print(json.dumps(out))
    """
)


def test_the_v41_launches_fit_every_generation_and_the_docs_print_their_footprints():
    got = json.loads(_run(_PLANS))
    plans = got["plans"]
    assert {p["kernel"] for p in plans} == {"mhc_mix", "mhc_collapse", "mhc_post", "candidate_blocks", "engram_inject"}
    assert len(plans) == 3 * 3 * 6
    for p in plans:
        assert p["fits"] and p["bytes"] > 0, p
        for axis in ("BLOCK_G", "BLOCK_F", "BLOCK_C", "BLOCK_R"):  # reduced axes: at least 16 lanes
            assert p["blocks"].get(axis, 16) >= 16, p
    # V4.1's 5120 channels in five blocks of 1024, not two of 4096; the Engram rows fit at any width
    assert got["blocks"] == {"16": 16, "24": 32, "4096": 4096, "5120": 1024, "7168": 1024}
    assert all(p["blocks"].get("BLOCK_D") == 1024 for p in plans if p["kernel"] in ("engram_inject", "mhc_collapse"))
    assert got["wide"] is True
    doc = (ROOT / "docs/ascend-bring-up.md").read_text()
    assert got["table"] in doc, (
        "regenerate: python -c 'from deepinfer_ascend.flash_plans import footprint_table, v41_flash_plans; "
        "print(footprint_table(plans=v41_flash_plans, model=\"V4.1-Flash\"))'"
    )

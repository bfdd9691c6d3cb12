"""DeepSeek V4.1's ops: the hyper-connection mixes and collapse it calls apart, and the candidate blocks of
its two-level top-k. The references against independent element-by-element computations, the op specs
against kernel sets that each break one rule, and the CUDA Triton kernels under Triton's interpreter."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer_conformance.ops import run_spec
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.specs import SPECS

K = Kernels()
NEG = float("-inf")
ROOT = Path(__file__).resolve().parents[3]
# find_spec, not importorskip: importing Triton here would stop later tests from choosing the interpreter
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[cuda]')")


# ---- hyper-connections --------------------------------------------------------------------------------


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _mix_by_hand(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                 hc_eps: float, iters: int) -> tuple[list, list, list]:
    """``pre``, ``post`` and ``comb`` of each token, computed one scalar at a time in Python floats."""
    t, n, d = x.shape
    pres, posts, combs = [], [], []
    for i in range(t):
        flat = x[i].flatten().tolist()
        inv = 1.0 / math.sqrt(sum(v * v for v in flat) / len(flat) + norm_eps)
        u = [sum(f * v * inv for f, v in zip(fn[r].tolist(), flat)) for r in range(fn.shape[0])]
        b, s = base.tolist(), scale.tolist()
        pres.append([_sigmoid(u[j] * s[0] + b[j]) + hc_eps for j in range(n)])
        posts.append([2 * _sigmoid(u[n + j] * s[1] + b[n + j]) for j in range(n)])
        logits = [[u[2 * n + j * n + k] * s[2] + b[2 * n + j * n + k] for k in range(n)] for j in range(n)]
        c = []
        for row in logits:
            e = [math.exp(v - max(row)) for v in row]
            c.append([v / sum(e) + hc_eps for v in e])
        c = _divide_columns(c, hc_eps)
        for _ in range(iters - 1):
            c = [[v / (sum(row) + hc_eps) for v in row] for row in c]
            c = _divide_columns(c, hc_eps)
        combs.append(c)
    return pres, posts, combs


def _divide_columns(c: list[list[float]], eps: float) -> list[list[float]]:
    sums = [sum(row[k] for row in c) + eps for k in range(len(c))]
    return [[v / sums[k] for k, v in enumerate(row)] for row in c]


def _mix_inputs(t: int, n: int, d: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(t, n, d, generator=g, dtype=torch.float64),
                fn=torch.randn((2 + n) * n, n * d, generator=g, dtype=torch.float64) * 0.2,
                base=torch.randn((2 + n) * n, generator=g, dtype=torch.float64) * 0.5,
                scale=torch.rand(3, generator=g, dtype=torch.float64) + 0.5, norm_eps=1e-6, hc_eps=1e-3)


@pytest.mark.parametrize(("n", "iters"), [(4, 20), (2, 1), (3, 4)])
def test_mhc_mix_is_the_formula(n: int, iters: int) -> None:
    args = _mix_inputs(3, n, 5)
    pre, post, comb = K.mhc_mix(**args, sinkhorn_iters=iters)
    want = _mix_by_hand(**args, iters=iters)
    for got, expect in zip((pre, post, comb), want):
        assert got.dtype == torch.float64
        assert torch.allclose(got, torch.tensor(expect, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # after the last column division every column of comb sums to 1 (up to hc_eps)
    assert torch.allclose(comb.sum(dim=1), torch.ones(3, n, dtype=torch.float64), atol=n * 1e-3)


def test_mhc_mix_is_fp32_for_16_bit_streams_and_handles_empty() -> None:
    args = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in _mix_inputs(2, 4, 8).items()}
    args["x"] = args["x"].bfloat16()
    assert [o.dtype for o in K.mhc_mix(**args, sinkhorn_iters=3)] == [torch.float32] * 3
    args["x"] = torch.empty(0, 4, 8, dtype=torch.bfloat16)
    assert [tuple(o.shape) for o in K.mhc_mix(**args, sinkhorn_iters=3)] == [(0, 4), (0, 4), (0, 4, 4)]


def test_mhc_collapse_is_the_weighted_sum_in_fp32() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 6, generator=g)
    pre = torch.rand(3, 4, generator=g)
    out = K.mhc_collapse(x, pre)
    for t in range(3):
        for c in range(6):
            assert math.isclose(out[t, c].item(), sum(pre[t, j].item() * x[t, j, c].item() for j in range(4)), abs_tol=1e-6)
    # 16-bit streams accumulate in fp32 and come back in their own dtype, rounded once
    xb = x.bfloat16()
    got = K.mhc_collapse(xb, pre)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (pre[..., None] * xb.float()).sum(1).bfloat16())
    # V4.1's first attention site: a one-hot pre on stream 0 passes stream 0 through
    one_hot = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).expand(3, 4)
    assert torch.equal(K.mhc_collapse(xb, one_hot), xb[:, 0])
    assert K.mhc_collapse(x.double(), pre).dtype == torch.float64


def test_mhc_pre_collapses_with_its_own_mix() -> None:
    args = _mix_inputs(4, 4, 6, seed=2)
    collapsed, post, comb = K.mhc_pre(**args, sinkhorn_iters=5)
    pres, posts, combs = _mix_by_hand(**args, iters=5)
    x = args["x"]
    want = torch.stack([sum(pres[t][j] * x[t, j] for j in range(4)) for t in range(4)])
    assert torch.allclose(collapsed, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(post, torch.tensor(posts, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert torch.allclose(comb, torch.tensor(combs, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_mhc_specs_have_the_v41_width() -> None:
    for op in ("mhc_mix", "mhc_collapse"):
        cases = {c.name: c.kwargs for c in SPECS[op].cases()}
        x = cases["t3_n4_d5120_v41_width"]["x"]
        assert tuple(x.shape) == (3, 4, 5120)
        assert {tuple(c["x"].shape[:1]) for c in cases.values()} >= {(0,), (1,)}
    iters = {c.kwargs["sinkhorn_iters"] for c in SPECS["mhc_mix"].cases()}
    streams = {c.kwargs["x"].shape[1] for c in SPECS["mhc_mix"].cases()}
    assert {1, 20} <= iters and {2, 4} <= streams


# ---- candidate blocks ---------------------------------------------------------------------------------


def _blocks_by_hand(scores: torch.Tensor, visible: torch.Tensor, k: int, bs: int, *, pin: bool = True,
                    low_index_wins: bool = True, drop_inf: bool = True, partial: bool = True,
                    pin_takes_a_slot: bool = True, whole_blocks: bool = True, pin_on_empty: bool = False) -> torch.Tensor:
    """The rules one row and one block at a time in Python; each keyword breaks one rule when flipped."""
    t, n = scores.shape
    nb = -(-n // bs) if partial else n // bs
    out = torch.zeros(t, n, dtype=torch.bool)
    for i in range(t):
        row = scores[i].tolist()
        best = [max(row[b * bs:(b + 1) * bs]) for b in range(nb)]
        v = int(visible[i])
        pinned = (v - 1) // bs if (pin and v > 0) else None
        if pin_on_empty and v == 0:
            pinned = nb - 1  # the bug: block -1 wraps around to the last one
        order = sorted(range(nb), key=lambda b: (b != pinned, -best[b], b if low_index_wins else -b))
        keep = [b for b in order if b == pinned or not drop_inf or best[b] > NEG]
        if pin_takes_a_slot:
            keep = keep[:k]
        else:
            keep = [b for b in keep if b != pinned][:k] + ([pinned] if pinned is not None else [])
        for b in keep:
            for j in range(b * bs, min((b + 1) * bs, n)):
                out[i, j] = whole_blocks or row[j] > NEG
    return out


def _random_rows(g: torch.Generator, t: int, n: int, values: int) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.randint(-values, values, (t, n), generator=g).float()
    scores[torch.rand(t, n, generator=g) < 0.2] = NEG
    visible = torch.randint(0, n + 1, (t,), generator=g)
    visible[0] = n
    return scores.masked_fill(torch.arange(n)[None, :] >= visible[:, None], NEG), visible


@pytest.mark.parametrize(("n", "bs", "k", "values"), [(40, 4, 3, 3), (37, 8, 2, 50), (64, 1, 5, 4), (23, 5, 9, 2), (300, 8, 12, 6)])
def test_candidate_blocks_is_the_rules(n: int, bs: int, k: int, values: int) -> None:
    g = torch.Generator().manual_seed(n * 100 + bs)
    for _ in range(4):
        scores, visible = _random_rows(g, 6, n, values)
        got = K.candidate_blocks(scores, visible, k, bs)
        assert got.dtype == torch.bool and got.shape == scores.shape
        assert torch.equal(got, _blocks_by_hand(scores, visible, k, bs)), (scores, visible)


def test_candidate_blocks_pins_the_newest_block_first() -> None:
    scores = torch.tensor([[9.0, 8.0, 7.0, 6.0, 1.0, NEG], [9.0, 8.0, 7.0, 6.0, NEG, NEG]])
    visible = torch.tensor([5, 5])
    got = K.candidate_blocks(scores, visible, 2, 2)
    # the newest block (entries 4, 5) is kept over blocks that score higher, even when all of it is -inf
    assert got.tolist() == [[True, True, False, False, True, True]] * 2
    assert not K.candidate_blocks(torch.full((2, 6), NEG), torch.tensor([0, 0]), 3, 2).any()


def test_keeping_every_block_is_dense_selection() -> None:
    g = torch.Generator().manual_seed(3)
    scores, visible = _random_rows(g, 5, 45, 10)
    mask = K.candidate_blocks(scores, visible, 6, 8)
    assert torch.equal(scores.masked_fill(~mask, NEG), scores)
    finite = torch.nn.functional.pad(scores, (0, 3), value=NEG).view(5, 6, 8).amax(-1) > NEG
    assert torch.equal(mask[:, ::8], finite | (torch.arange(6)[None, :] == ((visible - 1) // 8)[:, None]) & (visible > 0)[:, None])


def test_candidate_blocks_refuses_empty_selections() -> None:
    with pytest.raises(ValueError, match="topk_blocks and block_size must be >= 1"):
        K.candidate_blocks(torch.zeros(1, 8), torch.tensor([8]), 0, 4)
    with pytest.raises(ValueError, match="topk_blocks and block_size must be >= 1"):
        K.candidate_blocks(torch.zeros(1, 8), torch.tensor([8]), 2, 0)


#: each kernel set breaks one rule of ``candidate_blocks``; the op spec must fail every one
BROKEN_RULES = {
    "no pin": dict(pin=False),
    "ties to the higher block": dict(low_index_wins=False),
    "-inf blocks kept": dict(drop_inf=False),
    "partial last block dropped": dict(partial=False),
    "pin kept beside the top k": dict(pin_takes_a_slot=False),
    "only the finite columns": dict(whole_blocks=False),
    "visible 0 pins the last block": dict(pin_on_empty=True),
}


@pytest.mark.parametrize("rule", sorted(BROKEN_RULES))
def test_the_spec_fails_a_kernel_that_breaks_a_rule(rule: str) -> None:
    broken = BROKEN_RULES[rule]

    class Broken(Kernels):
        def candidate_blocks(self, scores, visible, topk_blocks, block_size):
            return _blocks_by_hand(scores.double(), visible, topk_blocks, block_size, **broken)

    class Faithful(Kernels):
        def candidate_blocks(self, scores, visible, topk_blocks, block_size):
            return _blocks_by_hand(scores.double(), visible, topk_blocks, block_size)

    spec = SPECS["candidate_blocks"]
    assert all(r.status == "pass" for r in run_spec(spec, Faithful(), CPUDevice()))
    failed = {r.case for r in run_spec(spec, Broken(), CPUDevice()) if r.status == "fail"}
    assert failed, f"no case of the candidate_blocks spec catches: {rule}"


def test_candidate_spec_has_a_real_shape() -> None:
    cases = {c.name: c.kwargs for c in SPECS["candidate_blocks"].cases()}
    real = cases["t3_n3000_block8_top64"]
    assert real["scores"].shape[1] >= 2000 and real["block_size"] == 8
    assert K.candidate_blocks(**real).sum(-1).tolist() == [64 * 8] * 3
    assert tuple(cases["empty_batch"]["scores"].shape)[0] == 0 and tuple(cases["one_token"]["scores"].shape)[0] == 1


# ---- the CUDA kernels under Triton's interpreter ------------------------------------------------------


def _interpret(script: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEEPINFER_BACKEND")}
    env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


# Past the specs: row tiles and chunks crossed with ties straddling them, blocks wider than one column chunk,
# strided and -0.0 scores, visible beyond the row; strided streams, 3 streams, fp64 (the reference).
_BEYOND_SPECS = textwrap.dedent(
    """
    import torch
    from deepinfer_interfaces import Kernels
    from deepinfer_cuda.kernels import CUDAKernels

    ref, cu = Kernels(), CUDAKernels()
    g = torch.Generator().manual_seed(0)
    NEG = float("-inf")
    for t, n, bs, k, values in ((2, 600, 3, 70, 4), (3, 700, 100, 2, 30), (6, 333, 1, 200, 2)):
        scores = torch.randint(-values, values, (t, n), generator=g).float()
        scores[torch.rand(t, n, generator=g) < 0.1] = NEG
        visible = torch.tensor([n, n // 2 + 1, n + 5, 1, 0, n - 1][:t])
        scores = scores.masked_fill(torch.arange(n)[None, :] >= visible[:, None], NEG)
        for dt in (torch.float32, torch.float16):
            s = scores.to(dt)
            got, want = cu.candidate_blocks(s, visible, k, bs), ref.candidate_blocks(s.double(), visible, k, bs)
            assert got.dtype == torch.bool and torch.equal(got, want), (t, n, bs, k, dt)
    zeros = torch.tensor([[0.0, -0.0, 0.0, -0.0, -0.0, 0.0, 0.0, -0.0]])
    assert torch.equal(cu.candidate_blocks(zeros, torch.tensor([8]), 2, 1), ref.candidate_blocks(zeros, torch.tensor([8]), 2, 1))
    wide = torch.randn(4, 90, generator=g)[:, 5:85]
    vis = torch.tensor([80, 0, 3, 41])
    assert torch.equal(cu.candidate_blocks(wide, vis, 3, 6), ref.candidate_blocks(wide, vis, 3, 6))
    assert torch.equal(cu.candidate_blocks(wide.double(), vis, 3, 6), ref.candidate_blocks(wide.double(), vis, 3, 6))

    def rel(a, b):
        return ((a.double() - b.double()).abs() / (1 + b.double().abs())).max().item()

    for t, s, d in ((7, 3, 40), (17, 4, 72)):
        x = torch.randn(t, s, d, generator=g)
        fn, base = torch.randn((2 + s) * s, s * d, generator=g) * 0.1, torch.randn((2 + s) * s, generator=g) * 0.5
        scale = torch.rand(3, generator=g) + 0.5
        for dt, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-2)):
            got = cu.mhc_mix(x.to(dt), fn, base, scale, 1e-6, 1e-6, 7)
            want = ref.mhc_mix(x.to(dt).double(), fn.double(), base.double(), scale.double(), 1e-6, 1e-6, 7)
            assert all(a.dtype == torch.float32 and rel(a, b) < 2e-5 for a, b in zip(got, want)), dt
            assert rel(cu.mhc_collapse(x.to(dt), got[0]), ref.mhc_collapse(x.to(dt).double(), got[0])) < tol
            assert cu.mhc_collapse(x.to(dt), got[0]).dtype == dt
    streams = torch.randn(5, 8, 24, generator=g)[:, 2:6]
    pre = torch.rand(5, 7, generator=g)[:, 1:5]
    assert rel(cu.mhc_collapse(streams, pre), ref.mhc_collapse(streams.double(), pre)) < 2e-5
    x64 = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    assert torch.equal(cu.mhc_collapse(x64, pre[:2].double()), ref.mhc_collapse(x64, pre[:2].double()))
    print("ok")
    """
)


@needs_triton
def test_cuda_kernels_match_the_reference_beyond_the_specs() -> None:
    done = _interpret(_BEYOND_SPECS)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]


_SIZES = textwrap.dedent(
    """
    from deepinfer_cuda.compile_check import V4_FLASH
    from tests.helpers.published import V41_FLASH

    v, text = V4_FLASH.v41, V41_FLASH["text_config"]
    source = text["candidate_source_layer_id"]
    got = (v.hidden, v.hc_mult, v.sinkhorn_iters, v.candidate_topk_blocks, v.candidate_block_size, v.candidate_ratio)
    want = (text["hidden_size"], text["hc_mult"], text["hc_sinkhorn_iters"], text["candidate_topk_blocks"],
            text["candidate_block_size"], text["compress_ratios"][source])
    assert got == want, (got, want)
    print("ok")
    """
)


@needs_triton
def test_the_compile_check_sizes_are_deepseek_v41_flash() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEEPINFER_BACKEND")}
    done = subprocess.run([sys.executable, "-c", _SIZES], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]

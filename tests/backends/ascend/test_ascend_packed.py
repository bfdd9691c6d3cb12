"""The Ascend kernel set over packed cache pools (``PackedPool``: FP8/FP4 records with block scales).

Without an NPU: the routing (a packed pool never reaches a torch_npu op; what a strict set reports), the
Triton-Ascend launch plans at V4/V4.1 shapes against each SoC's unified buffer, and, in one subprocess under
Triton's interpreter (``TRITON_INTERPRET`` must be set before Triton's first import), the kernels themselves:
``kv_pack``'s records byte for byte the reference's (DeepSeek's scale rules at the edges that decide a byte:
``amax`` exactly ``Q·2^k`` and one ulp either side, e2m1 ties, NaN/inf blocks, saturating e4m3 scales), the
packed ``cache_write`` into one- and two-region pools, ``kv_unpack``, and the reads of packed pools by
``indexer_scores``, ``indexer_topk``, ``entry_attention`` and ``sparse_attention`` (the latter through the
documented stand-in of ``npu_sparse_flash_attention``, which takes plain rows only).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer.models.registry import parse_config
from deepinfer_ascend import flash_plans
from deepinfer_ascend.kernels import AscendKernels
from deepinfer_ascend.launch import UNIFIED_BUFFERS
from deepinfer_interfaces import Kernels, NotSupportedError, PackedPool
from deepinfer_interfaces.kv_format import KVFormat
from deepinfer_interfaces.specs import SPECS
from tests.backends.ascend.test_ascend_fused_v4 import ASCEND_950, DocumentedV4Ops
from tests.helpers.published import V4_FLASH, V41_FLASH
from tests.helpers.subprocesses import run_python

ROOT = Path(__file__).resolve().parents[3]
REF = Kernels()
#: ops the Ascend set overrides that no op spec covers yet: this file checks them
PACKED_ONLY_OPS = {"kv_pack", "kv_unpack"}

INDEX = KVFormat("index", 32, "e2m1", 16, "ue8m0")
KV = KVFormat("kv", 32, "e4m3", 8, "ue8m0", rope=8)
ENTRY = KVFormat("entry", 32, "e2m1", 16, "e4m3")


def _pool(parts: list[tuple[int, KVFormat]], dim: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> PackedPool:
    pool = PackedPool.allocate(parts, dim, dtype, "cpu")
    rows = pool.shape[0]
    REF.cache_write(pool, torch.arange(rows), torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)))
    return pool


def _calls(seed: int = 1) -> dict[str, tuple]:
    """One call of each op that takes a packed pool (or makes records), on small CPU tensors."""
    g = torch.Generator().manual_seed(seed)
    keys, kv = _pool([(24, INDEX)], 32), _pool([(30, KV)], 32)
    two = _pool([(10, ENTRY), (20, KVFormat("window", 32, "e4m3", 32, "ue8m0"))], 32)
    q, w = torch.randn(3, 2, 32, generator=g), torch.randn(3, 2, generator=g)
    table, seq, vis = torch.randperm(24, generator=g)[:16].view(2, 8), torch.tensor([0, 1, 1]), torch.tensor([8, 3, 0])
    rows, sinks = torch.randint(-1, 30, (3, 5), generator=g), torch.randn(2, generator=g)
    values = torch.randn(4, 32, generator=g)
    return {
        "kv_pack": (values, KV),
        "kv_unpack": (REF.kv_pack(values, ENTRY), ENTRY, torch.bfloat16),
        "cache_write": (_pool([(12, KV)], 32), torch.tensor([3, -1, 11, 0]), values),
        "sparse_attention": (q, two, rows, sinks, 0.3),
        "entry_attention": (q, kv, rows, table, seq, vis, sinks, 0.3),
        "indexer_scores": (q, w, keys, torch.randint(-1, 24, (3, 6), generator=g), 0.5),
        "indexer_topk": (q, w, keys, table, seq, vis, 0.5, 3),
    }


def _result(op: str, kernels: Kernels, args: tuple):
    if op == "cache_write":
        pool = PackedPool.allocate([(12, KV)], 32, torch.float32, "cpu")
        kernels.cache_write(pool, *args[1:])
        return pool.regions[0].data
    return getattr(kernels, op)(*args)


# ---- routing, without Triton ------------------------------------------------------------------------


def test_packed_pools_never_reach_torch_npu_and_the_default_set_runs_the_reference():
    tn = DocumentedV4Ops(ASCEND_950)  # a 950 whose fused ops would take plain rows of these ops
    kernels = AscendKernels(torch_npu=tn)
    for op, args in _calls().items():
        got, want = _result(op, kernels, args), _result(op, REF, args)
        assert torch.equal(got, want), op
    assert tn.calls == [] and kernels.failed == {}


def test_strict_packed_ops_say_what_they_need_instead_of_running_the_reference():
    strict = AscendKernels(strict=True)
    calls = _calls()
    for op in ("kv_pack", "kv_unpack", "cache_write", "sparse_attention", "indexer_scores", "indexer_topk", "entry_attention"):
        with pytest.raises(NotSupportedError, match=f"needs torch_npu or the Triton interpreter: {op} is a Triton-Ascend kernel"):
            _result(op, strict, calls[op])
    # a pool of two record formats: entry_attention's kernel reads one format per pool
    q, kv, rows, table, seq, vis, sinks, scale = calls["entry_attention"]
    two = calls["sparse_attention"][1]
    reason = r"entry_attention over this packed pool runs the reference on Ascend: the pool holds 2 record regions \(entry, window\)"
    with pytest.raises(NotSupportedError, match=reason):
        strict.entry_attention(q, two, rows, table, seq, vis, sinks, scale)
    assert torch.equal(AscendKernels().entry_attention(q, two, rows, table, seq, vis, sinks, scale),
                       REF.entry_attention(q, two, rows, table, seq, vis, sinks, scale))
    # compress_kv's state is plain; a packed one is the reference's
    state = _pool([(8, KVFormat("state", 16, "e4m3", 16, "fp32"))], 16)
    idx = torch.tensor([[0, 1, 2, 3]])
    with pytest.raises(NotSupportedError, match="compress_kv over this packed pool runs the reference on Ascend: no Triton-Ascend kernel"):
        strict.compress_kv(state, state, torch.zeros(4, 16), idx)
    # a plain pool's cache_write is plain torch on any device, strict or not
    pool, slots, values = torch.zeros(6, 4), torch.tensor([5, -1, 0]), torch.randn(3, 4)
    strict.cache_write(pool, slots, values)
    assert torch.equal(pool[[5, 0]], values[[0, 2]]) and not pool[1:5].any()


def test_the_packed_ops_are_overridden_and_every_other_override_has_an_op_spec():
    paths = AscendKernels.paths()
    assert paths["cache_write"] == "triton-ascend (packed pools)"
    assert paths["kv_pack"] == paths["kv_unpack"] == "triton-ascend"
    for op in ("cache_write", "kv_pack", "kv_unpack"):
        assert getattr(AscendKernels, op) is not getattr(Kernels, op), op
    assert set(paths) - set(SPECS) <= PACKED_ONLY_OPS


# ---- launch plans ----------------------------------------------------------------------------------


def test_the_planned_formats_are_the_engines_at_the_release_widths():
    v4, v41 = parse_config(V4_FLASH), parse_config(V41_FLASH)
    ue8m0, fp32 = v4.packed_cache_formats("ue8m0"), v4.packed_cache_formats("fp32")
    assert (ue8m0.window, ue8m0.entry, ue8m0.index) == (flash_plans.V4_KV, flash_plans.V4_KV, flash_plans.V4_INDEX)
    assert fp32.window == flash_plans.V4_KV_FP32
    formats = v41.packed_cache_formats("ue8m0")
    assert (formats.window, formats.entry, formats.index) == (flash_plans.V41_WINDOW, flash_plans.V41_ENTRY, flash_plans.V41_INDEX)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_every_packed_launch_fits_every_generation(dtype):
    for gen in UNIFIED_BUFFERS:
        plans = flash_plans.packed_cache_plans(gen, dtype)
        assert {p.kernel for p in plans} == {"kv_pack", "kv_unpack", "indexer_scores", "indexer_topk", "entry_attention"}
        for p in plans:
            assert p.fits, p.describe()
            assert p.blocks.get("BLOCK_W", 16) >= 16, p.describe()  # the amax axis is at least REDUCE_MIN wide


def test_the_docs_report_the_packed_footprints():
    table = flash_plans.footprint_table(plans=flash_plans.packed_cache_plans, model="packed cache")
    doc = (ROOT / "docs/ascend-bring-up.md").read_text()
    assert table in doc, "regenerate: footprint_table(plans=packed_cache_plans, model='packed cache')"


# ---- the kernels under the interpreter --------------------------------------------------------------

_INTERPRETED = textwrap.dedent(
    """
    import sys, torch
    import deepinfer_ascend.kernels as ascend
    from deepinfer_interfaces import Kernels, NotSupportedError, PackedPool
    from deepinfer_interfaces.kv_format import KVFormat
    from deepinfer_ascend.flash_plans import PACKED_FORMATS
    from tests.backends.ascend.test_ascend_fused_v4 import ASCEND_950, DocumentedV4Ops
    from tests.helpers.subprocesses import assert_close

    ref, asc = Kernels(), ascend.AscendKernels(strict=True)
    g = torch.Generator().manual_seed(0)

    def same_records(got, want, what):
        bad = (got != want).nonzero()
        assert not len(bad), (what, bad[:4].tolist(), got[bad[:4, 0], bad[:4, 1]].tolist(), want[bad[:4, 0], bad[:4, 1]].tolist())

    def same_rows(got, want, what):
        assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan()), what
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), what

    # the release formats at full width: bf16 rows, a row of zeros and a row of 1e-6 (the amax floor)
    for fmt in PACKED_FORMATS[:5]:
        x = torch.randn(3, fmt.dim, generator=g) * torch.tensor([[3.0], [0.0], [1e-6]])
        x = x.bfloat16()
        same_records(asc.kv_pack(x, fmt), ref.kv_pack(x, fmt), fmt.name)
        rec = ref.kv_pack(x, fmt)
        same_rows(asc.kv_unpack(rec, fmt, torch.bfloat16), ref.kv_unpack(rec, fmt, torch.bfloat16), fmt.name)

    # the edges of each scale rule, narrow rows (two blocks, rope channels for FP8)
    def edge_rows(fmt):
        q = 448.0 if fmt.code == "e4m3" else 6.0
        rows = []
        for k in (-20, 0, 7, 30):
            r = torch.randn(fmt.dim, generator=g) * 2.0**k
            for amax in (q * 2.0**k, torch.nextafter(torch.tensor(q * 2.0**k), torch.tensor(1e38)).item(),
                         torch.nextafter(torch.tensor(q * 2.0**k), torch.tensor(0.0)).item()):
                r = r.clone(); r[0] = -amax; rows.append(r)
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
        rows.append(torch.cat([ties, -ties]).repeat(fmt.dim // 16 + 1)[: fmt.dim])
        rows += [torch.zeros(fmt.dim), -torch.zeros(fmt.dim), torch.full((fmt.dim,), 1e-30), torch.full((fmt.dim,), -3e-5)]
        for at, v in ((1, float("nan")), (2, -float("nan")), (3, float("inf")), (fmt.dim - 1, -float("inf"))):
            r = torch.randn(fmt.dim, generator=g); r[at] = v; rows.append(r)
        rows += [torch.randn(fmt.dim, generator=g) * s for s in (1e4, 3e38, 6 * 2.0**-9)]
        return torch.stack(rows)

    edge_formats = [KVFormat("fp8", 24, "e4m3", 8, "ue8m0", 8), KVFormat("fp8.fp32", 24, "e4m3", 8, "fp32", 8),
                    KVFormat("fp4", 32, "e2m1", 16, "ue8m0"), KVFormat("fp4.e4m3", 32, "e2m1", 16, "e4m3"),
                    KVFormat("fp4.fp32", 20, "e2m1", 10, "fp32")]
    for fmt in edge_formats:
        x = edge_rows(fmt)
        for dtype in ((torch.float32, torch.bfloat16, torch.float16) if fmt.name in ("fp8", "fp4.e4m3") else (torch.float32,)):
            xd = x.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype)
            same_records(asc.kv_pack(xd, fmt), ref.kv_pack(xd, fmt), (fmt.name, dtype))
        rec = ref.kv_pack(x, fmt)
        for dtype in (torch.float32, torch.bfloat16):
            same_rows(asc.kv_unpack(rec, fmt, dtype), ref.kv_unpack(rec, fmt, dtype), (fmt.name, dtype))
    rec3 = rec.view(2, -1, rec.shape[1])
    same_rows(asc.kv_unpack(rec3, fmt, torch.float16), ref.kv_unpack(rec3, fmt, torch.float16), "3-D")
    # rows of another width: one line naming the format and the width it takes
    wrong = {
        "kv_pack: fp4.fp32 takes 20 channels a row, got 21": lambda: asc.kv_pack(torch.randn(2, 21), fmt),
        "kv_unpack: fp4.fp32 takes 20 bytes a row, got 16": lambda: asc.kv_unpack(rec[:, :16], fmt, torch.float32),
        "cache_write: values [n, 20] and slots [n] must agree": lambda: asc.cache_write(
            PackedPool.allocate([(4, fmt)], 20, torch.float32, "cpu"), torch.tensor([0]), torch.randn(2, 20)),
    }
    for message, call in wrong.items():
        try:
            call()
            raise AssertionError(message)
        except ValueError as exc:
            assert str(exc).startswith(message), exc

    # cache_write: one region, and V4.1's two (FP4 entries then FP8 window, one numbering); -1 and repeats skipped
    entry, window = KVFormat("entry", 32, "e2m1", 16, "e4m3"), KVFormat("window", 32, "e4m3", 32, "ue8m0")
    for parts in ([(12, entry)], [(6, entry), (9, window)]):
        mine, theirs = (PackedPool.allocate(parts, 32, torch.bfloat16, "cpu") for _ in range(2))
        for pool in (mine, theirs):
            ref.cache_write(pool, torch.arange(pool.shape[0]), torch.ones(pool.shape[0], 32))
        slots = torch.tensor([4, -1, 11, 0, 5, 7, -1])[: 5 if len(parts) == 1 else 7]
        values = torch.randn(len(slots), 32, generator=g).bfloat16()
        asc.cache_write(mine, slots, values)
        ref.cache_write(theirs, slots, values)
        for a, b in zip(mine.regions, theirs.regions):
            same_records(a.data, b.data, ("cache_write", len(parts)))

    # the indexer over packed FP4 keys: integer inputs score exactly, so the picks are the reference's
    fmt = KVFormat("index", 32, "e2m1", 16, "ue8m0")
    for dtype in (torch.float32, torch.bfloat16):
        keys = PackedPool.allocate([(40, fmt)], 32, dtype, "cpu")
        ref.cache_write(keys, torch.arange(40), torch.randint(-3, 4, (40, 32), generator=g).float())
        q, w = torch.randint(-1, 2, (4, 2, 32), generator=g).to(dtype), torch.randint(1, 3, (4, 2), generator=g).to(dtype)
        table = torch.randperm(40, generator=g)[:36].view(2, 18).clone()
        table[0, 4] = -1
        kw = dict(q=q, weights=w, keys=keys, table=table, token_seq=torch.tensor([0, 1, 0, 1]),
                  visible=torch.tensor([18, 7, 0, 12]), scale=0.5, k=6)
        assert torch.equal(asc.indexer_topk(**kw), ref.indexer_topk(**kw)), dtype
        cand = torch.randint(-1, 40, (4, 9), generator=g)
        assert torch.equal(asc.indexer_scores(q, w, keys, cand, 0.5), ref.indexer_scores(q, w, keys, cand, 0.5)), dtype

    # entry_attention over a packed pool with rope channels (FP8 + bf16 rope, V4's layout, narrow)
    kvf = KVFormat("kv", 32, "e4m3", 8, "ue8m0", 8)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        kv = PackedPool.allocate([(30, kvf)], 32, dtype, "cpu")
        ref.cache_write(kv, torch.arange(30), torch.randn(30, 32, generator=g))
        kw = dict(q=torch.randn(4, 2, 32, generator=g).to(dtype), kv=kv, indices=torch.randint(-1, 30, (4, 5), generator=g),
                  table=torch.randperm(30, generator=g)[:20].view(2, 10), token_seq=torch.tensor([0, 1, 1, 0]),
                  visible=torch.tensor([10, 4, 0, 7]), sinks=torch.randn(2, generator=g), scale=0.2)
        assert_close(asc.entry_attention(**kw).float(), ref.entry_attention(**kw).float(), tol)

    # sparse_attention over packed pools on a 950: the listed rows decoded, then the fused op on plain rows
    v4 = KVFormat("v4.kv.fp8", 512, "e4m3", 64, "ue8m0", 64)
    v41 = [(6, KVFormat("v41.entry.fp4", 512, "e2m1", 16, "e4m3")), (8, KVFormat("v41.window.fp8", 512, "e4m3", 32, "ue8m0"))]
    for parts in ([(14, v4)], v41):
        kv = PackedPool.allocate(parts, 512, torch.bfloat16, "cpu")
        ref.cache_write(kv, torch.arange(14), torch.randn(14, 512, generator=g))
        q, sinks = torch.randn(2, 4, 512, generator=g).bfloat16(), torch.randn(4, generator=g)
        rows = torch.randint(-1, 14, (2, 5), generator=g)
        rows[1] = -1
        tn = DocumentedV4Ops(ASCEND_950)
        fused = ascend.AscendKernels(torch_npu=tn)
        want = ref.sparse_attention(q, kv, rows, sinks, 0.05)
        assert_close(fused.sparse_attention(q, kv, rows, sinks, 0.05).float(), want.float(), 2e-2)
        if len(parts) == 2:
            ascend.GATHER_BYTES = 5 * 512 * 2  # one token's rows a chunk
            assert_close(fused.sparse_attention(q, kv, rows, sinks, 0.05).float(), want.float(), 2e-2)
            ascend.GATHER_BYTES = 256 << 20
        assert tn.calls == ["npu_sparse_flash_attention"] * (1 + 2 * (len(parts) == 2)) and fused.failed == {}, tn.calls
        try:
            asc.sparse_attention(q, kv, rows, sinks, 0.05)
            raise AssertionError("strict sparse_attention over a packed pool ran without the fused op")
        except NotSupportedError as exc:
            assert str(exc).startswith("needs torch_npu: torch_npu:npu_sparse_flash_attention"), exc
    assert "deepinfer_ascend.triton_ascend_kv_quant" in sys.modules
    print("ok")
    """
)


def test_packed_kernels_match_the_reference_under_the_interpreter():
    proc = run_python(["-c", _INTERPRETED], interpret=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]

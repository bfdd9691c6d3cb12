"""The CUDA backend on packed cache records (``deepinfer_cuda.triton_records``): ``kv_pack`` and the packed
``cache_write`` byte for byte equal to the reference at every rounding edge, ``kv_unpack`` of every byte value, the
attention and indexer ops reading ``PackedPool``s of one and two regions in their kernels, ``hadamard``, and where the
reference runs instead.

Every interpreter check runs in one subprocess: ``TRITON_INTERPRET`` must be set before Triton is first imported.
Under the interpreter attention walks 4 rows at a time and fewer than 4 programs split a launch, so one token runs
split launches and six tokens unsplit ones.
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

ROOT = Path(__file__).resolve().parents[3]
# find_spec, not importorskip: importing Triton here would stop later tests from choosing the interpreter
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[cuda]')")

_SCRIPT = textwrap.dedent(
    """
    import json, torch
    from deepinfer_interfaces import Kernels, KVFormat, PackedPool, PackedRegion
    from deepinfer_interfaces.kv_format import block_scales
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_cuda import triton_attention, triton_hadamard, triton_indexer, triton_long_context, triton_records

    ref, cu = Kernels(), CUDAKernels()
    g = torch.Generator().manual_seed(3)
    result = {}

    V4_KV = KVFormat("v4.kv", 40, "e4m3", 16, "ue8m0", 8)
    V4_KV_FP32 = KVFormat("v4.kv.fp32", 40, "e4m3", 16, "fp32", 8)
    INDEX = KVFormat("index", 32, "e2m1", 16, "ue8m0")
    V41_WINDOW = KVFormat("v41.window", 32, "e4m3", 8, "ue8m0")
    V41_ENTRY = KVFormat("v41.entry", 32, "e2m1", 16, "e4m3")
    ODD = KVFormat("odd blocks", 20, "e2m1", 6, "fp32", 2)  # a tiny model's: blocks of 6, odd code bytes
    ODD_E4M3 = KVFormat("odd e4m3", 15, "e4m3", 12, "e4m3", 3)
    ODD_INDEX = KVFormat("odd index", 18, "e2m1", 6, "ue8m0")
    FORMATS = (V4_KV, V4_KV_FP32, INDEX, V41_WINDOW, V41_ENTRY, ODD, ODD_E4M3, ODD_INDEX)

    def rows_for(fmt, n):
        # rows at every rounding edge: each block's values on a fixed grid of its scale, midpoints (ties) included
        x = torch.randn(n, fmt.dim, generator=g) * torch.exp(torch.randn(n, 1, generator=g) * 4)
        q = fmt.quantized
        grid = (torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 6.0, 0.5, 3.0]) if fmt.code == "e2m1"
                else torch.tensor([17.0, 19.0, 9.0, 240.0, 232.0, 248.0, 2**-10, 3 * 2**-10, -0.001953125 * 1.5, 448.0, -17.0, 1.0]))
        for r in range(4):
            vals = grid[torch.randint(0, len(grid), (q,), generator=g)] * 2.0 ** (r - 2)
            vals[:: fmt.block] = (6.0 if fmt.code == "e2m1" else 448.0) * 2.0 ** (r - 2)  # every block's scale: 2^(r-2)
            x[r, :q] = vals
        x[4, :q] = 0.0                      # an all-zero row: the floor's scale
        x[4, :q:3] = -0.0
        x[5, :q] *= 1e-30                   # below the floor
        x[6, :q] = 3e38                     # near fp32's limit (e4m3 scales saturate at 448)
        x[6, 1] = -3e38
        x[7, 1] = float("nan")              # a bad block: NaN scale, NaN codes
        if fmt.num_scales > 2:
            x[7, 2 * fmt.block + 1] = -float("inf")
        x[8, 0] = float("-nan")             # the e4m3 code of a negative NaN keeps its sign
        x[9, fmt.quantized :] = 3e38        # rope channels near bf16's largest value
        if fmt.code == "e4m3" and fmt.scale == "e4m3":
            x[4, :q] = 1.0                  # e4m3 scales of e4m3 codes underflow to 0 below 0.44: keep blocks above it
            x[5, :q] = 1.0
        return x

    def midpoint_hits(x, fmt):
        # channels that, over their block's scale, lie exactly halfway between two e2m1 values (ties to even)
        q = x[:, : fmt.quantized].float()
        y = (q.view(q.shape[0], fmt.num_scales, fmt.block) / block_scales(q, fmt)[..., None]).abs()
        return int((y[..., None] == torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).any(-1).sum())

    # ---- kv_pack: bytes ------------------------------------------------------------------------------------
    # every format from fp32 rows, the two with rope channels or e4m3 scales from 16-bit rows too
    pack = []
    for fmt, dt in [(f, torch.float32) for f in FORMATS] + [(f, d) for f in (V4_KV, V41_ENTRY) for d in (torch.bfloat16, torch.float16)]:
        x = rows_for(fmt, 12).to(dt)
        got, want = cu.kv_pack(x, fmt), ref.kv_pack(x, fmt)
        direct = triton_records.kv_pack(x, fmt) if fmt is V4_KV else got
        ties = midpoint_hits(x[:4], fmt) if fmt.code == "e2m1" else -1
        pack.append({"fmt": fmt.name, "dtype": str(dt), "equal": bool(torch.equal(got, want)), "kernel": bool(torch.equal(got, direct)),
                     "bad": int((got != want).sum()), "shape": list(got.shape), "record": fmt.record_bytes, "ties": ties,
                     "nan_rows": int(torch.isnan(ref.kv_unpack(got, fmt)).any(-1).sum())})
    result["pack"] = pack

    # ---- kv_unpack: every byte value ----------------------------------------------------------------------------
    unpack, every = [], {}
    for fmt in FORMATS:
        records = every[fmt.name] = torch.randint(0, 256, (64, fmt.record_bytes), generator=g, dtype=torch.int32).to(torch.uint8)
        records[:, 0] = torch.arange(64, dtype=torch.uint8) * 4  # every e4m3 code byte (0x7F, 0xFF: NaN) and e2m1 nibble
        records[:, 1] = torch.arange(64, dtype=torch.uint8) * 4 + 3
        records[:, fmt.scale_offset] = torch.arange(64, dtype=torch.uint8) * 4 + 3  # 0xFF: a NaN ue8m0 scale; 0x7F a NaN e4m3
        for dt in (torch.float32, torch.bfloat16, torch.float16) if fmt in (V4_KV_FP32, ODD) else (torch.float32,):
            got, want = cu.kv_unpack(records, fmt, dt), ref.kv_unpack(records, fmt, dt)
            same = (got == want) | (got.isnan() & want.isnan())
            unpack.append({"fmt": fmt.name, "dtype": str(dt), "equal": bool(same.all()), "out": str(got.dtype),
                           "nan": int(want.isnan().sum()), "shape": list(got.shape)})
    three = every[V4_KV.name].view(8, 8, -1)
    got, want = cu.kv_unpack(three, V4_KV), ref.kv_unpack(three, V4_KV)
    unpack.append({"fmt": V4_KV.name, "dtype": "3-d", "equal": bool(((got == want) | (got.isnan() & want.isnan())).all()),
                   "out": "torch.float32", "nan": int(want.isnan().sum()), "shape": list(got.shape)})
    result["unpack"] = unpack

    # ---- packed cache_write: one and two regions, -1 and out-of-range slots ----------------------------------------
    def pool(parts, dim, dtype, fill=True):
        p = PackedPool.allocate(parts, dim, dtype, "cpu")
        if fill and p.shape[0]:
            ref.cache_write(p, torch.arange(p.shape[0]), torch.randn(p.shape[0], dim, generator=g).to(dtype))
        return p

    def clone(p):
        return PackedPool(tuple(PackedRegion(r.start, r.data.clone(), r.format) for r in p.regions), p.dim, p.dtype)

    writes = []
    for parts, dim in (([(10, V4_KV)], 40), ([(7, V41_ENTRY), (9, V41_WINDOW)], 32), ([(0, V41_ENTRY), (6, V41_WINDOW)], 32),
                       ([(5, ODD)], 20)):
        for dt in (torch.float32, torch.bfloat16):
            base = pool(parts, dim, dt)
            rows = base.shape[0]
            slots = torch.tensor([3, -1, rows - 1, 1, rows + 4, parts[0][0], -1])  # distinct, -1 and past the pool
            values = rows_for(parts[-1][1], 12)[5:12].to(dt)
            a, b = clone(base), clone(base)
            cu.cache_write(a, slots, values)
            ref.cache_write(b, slots, values)
            untouched = [torch.equal(x.data, y.data) for x, y in zip(a.regions, base.regions)]
            writes.append({"parts": [n for n, _ in parts], "dtype": str(dt),
                           "equal": all(torch.equal(x.data, y.data) for x, y in zip(a.regions, b.regions)),
                           "changed": not all(untouched)})
    result["writes"] = writes

    # ---- attention and the indexer over packed pools ------------------------------------------------------------
    def err(a, b):
        return ((a.double() - b.double()).abs() / (1 + b.double().abs())).max().item()

    # (pool, regions, dim, dtype, tokens): one token runs split launches, six unsplit ones
    F32, BF16 = torch.float32, torch.bfloat16
    attn = []
    for name, parts, dim, dt, t in (("v4", [(30, V4_KV)], 40, F32, 1), ("v4", [(30, V4_KV)], 40, F32, 6),
                                    ("v4", [(30, V4_KV)], 40, BF16, 1), ("v4 fp32 scales", [(30, V4_KV_FP32)], 40, BF16, 6),
                                    ("v4.1", [(18, V41_ENTRY), (14, V41_WINDOW)], 32, F32, 1),
                                    ("v4.1", [(18, V41_ENTRY), (14, V41_WINDOW)], 32, BF16, 6), ("odd blocks", [(25, ODD)], 20, F32, 6)):
        tol = 1e-5 if dt == F32 else 2e-2
        p = pool(parts, dim, dt)
        n = p.shape[0]
        h = 3
        q, sinks = torch.randn(t, h, dim, generator=g).to(dt), torch.randn(h, generator=g)
        idx = torch.randint(-1, n, (t, 11), generator=g)
        got = cu.sparse_attention(q, p, idx, sinks, dim ** -0.5)
        want = ref.sparse_attention(q, p, idx, sinks, dim ** -0.5)
        direct = triton_attention.sparse_attention(q, p, idx, sinks, dim ** -0.5) if not attn else got
        table = torch.randint(-1, n, (2, 13), generator=g)
        seq, vis = torch.randint(0, 2, (t,), generator=g), torch.randint(0, 14, (t,), generator=g)
        vis[-1] = 13
        e_got = cu.entry_attention(q, p, idx[:, :5], table, seq, vis, sinks, dim ** -0.5)
        e_want = ref.entry_attention(q, p, idx[:, :5], table, seq, vis, sinks, dim ** -0.5)
        e_direct = triton_long_context.entry_attention(q, p, idx[:, :5], table, seq, vis, sinks, dim ** -0.5) if not attn else e_got
        attn.append({"pool": name, "dtype": str(dt), "tokens": t, "tol": tol, "sparse": err(got, want), "entry": err(e_got, e_want),
                     "kernel": bool(torch.equal(got, direct) and torch.equal(e_got, e_direct)), "out": str(got.dtype),
                     "splits": triton_attention.attention_slices(t, h, 11, 4)[0]})
    result["attn"] = attn

    index = []
    for name, parts, dim, dt, t in (("v4 index", [(40, INDEX)], 32, F32, 1), ("v4 index", [(40, INDEX)], 32, BF16, 6),
                                    ("v4.1 two regions", [(20, V41_ENTRY), (20, V41_WINDOW)], 32, F32, 6),
                                    ("v4.1 two regions", [(20, V41_ENTRY), (20, V41_WINDOW)], 32, BF16, 1),
                                    ("odd blocks", [(40, ODD_INDEX)], 18, F32, 6)):
        p = pool(parts, dim, dt)
        n = p.shape[0]
        h = 4
        # integer queries and weights on decoded dyadic keys: exact scores, full of ties
        q = torch.randint(-2, 3, (t, h, dim), generator=g).float().to(dt)
        w = torch.randint(0, 3, (t, h), generator=g).float().to(dt)
        idx = torch.randint(-1, n, (t, 17), generator=g)
        s_got, s_want = cu.indexer_scores(q, w, p, idx, 0.5), ref.indexer_scores(q, w, p, idx, 0.5)
        s_direct = triton_indexer.indexer_scores(q, w, p, idx, 0.5) if not index else s_got
        table = torch.randint(-1, n, (2, 37), generator=g)
        seq, vis = torch.randint(0, 2, (t,), generator=g), torch.randint(0, 38, (t,), generator=g)
        vis[-1] = 37
        k_got = cu.indexer_topk(q, w, p, table, seq, vis, 0.5, 9)
        k_want = ref.indexer_topk(q, w, p, table, seq, vis, 0.5, 9)
        k_direct = triton_long_context.indexer_topk(q, w, p, table, seq, vis, 0.5, 9) if not index else k_got
        finite = s_want > float("-inf")
        index.append({"pool": name, "dtype": str(dt), "tokens": t, "scores_equal": bool(torch.equal(s_got, s_want)),
                      "topk_equal": bool(torch.equal(k_got, k_want)),
                      "kernel": bool(torch.equal(s_got, s_direct) and torch.equal(k_got, k_direct)),
                      "ties": int(sum(len(r[f]) - len(set(r[f].tolist())) for r, f in zip(s_want, finite))),
                      "splits": triton_long_context.topk_slices(t, 9, 37, 4)[0]})
    result["index"] = index

    # ---- where the reference runs instead ------------------------------------------------------------------------
    three = pool([(4, V41_ENTRY), (4, V41_WINDOW), (4, V41_ENTRY)], 32, torch.float32)
    q, sinks, idx = torch.randn(2, 2, 32, generator=g), torch.randn(2, generator=g), torch.tensor([[0, 5, 11], [-1, 9, 2]])
    p64 = pool([(12, V41_WINDOW)], 32, torch.float64)
    p16 = pool([(12, V41_WINDOW)], 32, torch.bfloat16)
    refusals = []
    for call in (lambda: triton_attention.sparse_attention(q, three, idx, sinks, 0.2),
                 lambda: triton_attention.sparse_attention(q, p16, idx, sinks, 0.2),
                 lambda: triton_records.kv_pack(torch.ones(3, 31), V41_WINDOW),
                 lambda: triton_records.kv_unpack(torch.ones(3, V41_WINDOW.record_bytes), V41_WINDOW, torch.float32)):
        try:
            call()
            refusals.append(None)
        except ValueError as exc:
            refusals.append(str(exc))
    result["refusals"] = refusals
    x64 = torch.randn(3, 32, generator=g).double()
    untouched = pool([(3, V41_WINDOW)], 32, torch.float32)
    before = untouched.regions[0].data.clone()
    cu.cache_write(untouched, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 32))
    result["fallback"] = {
        "three_regions": err(cu.sparse_attention(q, three, idx, sinks, 0.2), ref.sparse_attention(q, three, idx, sinks, 0.2)),
        "fp64": err(cu.sparse_attention(q.double(), p64, idx, sinks, 0.2), ref.sparse_attention(q.double(), p64, idx, sinks, 0.2)),
        "dtype_mismatch": err(cu.sparse_attention(q, p16, idx, sinks, 0.2), ref.sparse_attention(q, p16, idx, sinks, 0.2)),
        "fp64_pack": bool(torch.equal(cu.kv_pack(x64, V41_WINDOW), ref.kv_pack(x64, V41_WINDOW))),
        "empty_write": bool(torch.equal(untouched.regions[0].data, before)),
    }

    # ---- hadamard -------------------------------------------------------------------------------------------------
    had = []
    for shape in ((5, 128), (3, 2, 64), (7, 16), (4, 2), (2, 1), (6, 256)):
        x = torch.randn(*shape, generator=g)
        for dt, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)):
            got, want = cu.hadamard(x.to(dt)), ref.hadamard(x.to(dt))
            had.append({"shape": list(shape), "dtype": str(dt), "err": err(got, want), "tol": tol, "out": str(got.dtype),
                        "same_shape": list(got.shape) == list(shape), "inverse": err(cu.hadamard(cu.hadamard(x)), x)})
    try:
        cu.hadamard(torch.ones(2, 12))
        result["hadamard_refusal"] = None
    except ValueError as exc:
        result["hadamard_refusal"] = str(exc)
    result["hadamard"] = had
    x = torch.randn(9, 128, generator=g).to(torch.bfloat16)
    result["hadamard_kernel"] = bool(torch.equal(cu.hadamard(x), triton_hadamard.hadamard(x)))
    print(json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DEEPINFER_BACKEND")}
    env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kv_pack_records_equal_the_reference_byte_for_byte(interpreted: dict) -> None:
    rows = interpreted["pack"]
    bad = [r for r in rows if not (r["equal"] and r["kernel"])]
    assert not bad, bad
    assert all(r["shape"] == [12, r["record"]] for r in rows)
    # the rows cover what they claim: e2m1 values exactly at midpoints (ties to even), NaN / inf blocks
    assert all(r["ties"] > 10 for r in rows if r["ties"] >= 0)
    assert all(r["nan_rows"] >= 2 for r in rows)
    assert {r["dtype"] for r in rows} == {"torch.float32", "torch.bfloat16", "torch.float16"}


def test_kv_unpack_decodes_every_byte_as_the_reference(interpreted: dict) -> None:
    rows = interpreted["unpack"]
    bad = [r for r in rows if not r["equal"]]
    assert not bad, bad
    assert all(r["nan"] > 0 for r in rows)  # NaN codes and NaN scales were among the bytes
    assert all(r["out"] == r["dtype"] for r in rows if r["dtype"] != "3-d")
    assert [r["shape"] for r in rows if r["dtype"] == "3-d"] == [[8, 8, 40]]


def test_packed_cache_write_equals_the_reference(interpreted: dict) -> None:
    rows = interpreted["writes"]
    assert all(r["equal"] and r["changed"] for r in rows), rows
    assert [0, 6] in [r["parts"] for r in rows] and [7, 9] in [r["parts"] for r in rows]


def test_attention_over_packed_pools_matches_the_reference_in_its_kernels(interpreted: dict) -> None:
    rows = interpreted["attn"]
    bad = [r for r in rows if not (r["sparse"] <= r["tol"] and r["entry"] <= r["tol"] and r["kernel"] and r["out"] == r["dtype"])]
    assert not bad, bad
    assert {r["splits"] > 1 for r in rows} == {True, False}
    assert {r["pool"] for r in rows} == {"v4", "v4 fp32 scales", "v4.1", "odd blocks"}


def test_indexer_over_packed_keys_scores_and_picks_exactly_the_references(interpreted: dict) -> None:
    rows = interpreted["index"]
    bad = [r for r in rows if not (r["scores_equal"] and r["topk_equal"] and r["kernel"])]
    assert not bad, bad
    assert sum(r["ties"] for r in rows) > 50
    assert {r["splits"] > 1 for r in rows} == {True, False}


def test_pools_the_kernels_do_not_read_run_the_reference_and_bad_inputs_are_refused(interpreted: dict) -> None:
    refusals = interpreted["refusals"]
    assert refusals[0].startswith("sparse_attention:") and "got 3 non-empty regions" in refusals[0], refusals
    assert "decoding to q's dtype torch.float32" in refusals[1] and "torch.bfloat16" in refusals[1], refusals
    assert refusals[2].startswith("kv_pack: values must be [n, 32]") and "got (3, 31)" in refusals[2], refusals
    assert refusals[3].startswith("kv_unpack: records must be uint8"), refusals
    fallback = interpreted["fallback"]
    assert fallback["three_regions"] < 1e-6 and fallback["fp64"] < 1e-12 and fallback["dtype_mismatch"] == 0, fallback
    assert fallback["fp64_pack"] and fallback["empty_write"]


def test_hadamard_matches_the_reference(interpreted: dict) -> None:
    rows = interpreted["hadamard"]
    bad = [r for r in rows if not (r["err"] <= r["tol"] and r["out"] == r["dtype"] and r["same_shape"] and r["inverse"] < 1e-5)]
    assert not bad, bad
    assert interpreted["hadamard_refusal"] is not None and "power-of-two" in interpreted["hadamard_refusal"]
    assert interpreted["hadamard_kernel"]

"""The Ascend paths of the ops over per-sequence tables, ``indexer_topk`` and ``entry_attention``.

The Triton-Ascend kernels (``triton_ascend_long_context``) run under Triton's interpreter in a subprocess
(TRITON_INTERPRET must be set before Triton's first import) through the strict kernel set, so a kernel that
cannot run fails instead of quietly running the reference. The fused paths (``npu_lightning_indexer``,
``npu_sparse_flash_attention``) run through the stand-in torch_npu of ``tests/backends/ascend/test_ascend_fused_v4.py``, whose
ops compute what CANN's documents and goldens say and take exactly the wheel's schema; their calls are checked
against the torch-npu 2.13.0 wheel by ``tests/backends/ascend/test_ascend_calls.py``.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer_ascend import npu_v4_ops
from deepinfer_ascend.kernels import AscendKernels
from deepinfer_interfaces import Kernels, NotSupportedError
from tests.helpers.subprocesses import run_python
from tests.backends.ascend.test_ascend_fused_v4 import A2, A3, ASCEND_950, HALF, DocumentedV4Ops, close

REF = Kernels()

_INTERPRETED = textwrap.dedent(
    """
    import sys, torch
    from deepinfer_interfaces import Kernels
    from deepinfer_ascend.kernels import AscendKernels
    from deepinfer_ascend import triton_ascend_long_context as lc
    from tests.helpers.subprocesses import assert_close

    ref, asc = Kernels(), AscendKernels(strict=True)
    g = torch.Generator().manual_seed(0)
    ints = lambda *shape, low=-1, high=2: torch.randint(low, high, shape, generator=g).float()

    def topk_case(t, h, d, b, n, k, pool=None, integer=False, holes=(), visible=None):
        pool = pool or b * n + 5
        table = torch.randperm(pool, generator=g)[: b * n].view(b, n).clone()
        for s, j in holes:
            table[s, j] = -1
        vis = torch.randint(0, n + 1, (t,), generator=g) if visible is None else torch.tensor(visible)
        if integer:
            q, w, keys = ints(t, h, d), ints(t, h, low=1, high=3), ints(pool, d)
        else:
            q, w, keys = torch.randn(t, h, d, generator=g), torch.randn(t, h, generator=g), torch.randn(pool, d, generator=g)
        return dict(q=q, weights=w, keys=keys, table=table, token_seq=torch.arange(t) % b, visible=vis, scale=0.5, k=k)

    cases = {
        # equal scores everywhere: the picks must follow the entry order exactly, over several entry tiles
        "integer_ties_entry_tiles": topk_case(7, 2, 4, 2, 40, 9, integer=True, holes=[(0, 3), (0, 17), (1, 0)]),
        "holes_and_nothing_visible": topk_case(5, 3, 8, 2, 12, 4, holes=[(0, 2), (0, 5), (1, 11)], visible=[0, 12, 3, 0, 7]),
        "k_beyond_candidates": topk_case(4, 2, 8, 1, 5, 8, visible=[5, 3, 0, 5]),
        "b6_more_sequences_than_shared": topk_case(12, 2, 8, 6, 20, 5, integer=True),
        "k_1_wide_head_19": topk_case(3, 3, 19, 2, 30, 1),
        "bf16": {**topk_case(4, 2, 16, 2, 24, 6, integer=True), },
    }
    cases["bf16"].update(q=cases["bf16"]["q"].bfloat16(), weights=cases["bf16"]["weights"].bfloat16(), keys=cases["bf16"]["keys"].bfloat16())
    cases["strided_q"] = {**cases["integer_ties_entry_tiles"], "q": torch.cat([cases["integer_ties_entry_tiles"]["q"]] * 2, -1)[..., ::2]}
    for name, kw in cases.items():
        got, want = asc.indexer_topk(**kw), ref.indexer_topk(**kw)
        assert torch.equal(got, want), (name, got, want)
    # several chunks of tokens (a scratch of 64 keys holds 3 tokens of 20 entries)
    lc.SCRATCH_ELEMENTS = 64
    kw = cases["b6_more_sequences_than_shared"]
    assert lc.chunk_tokens(12, 20) == 3
    assert torch.equal(asc.indexer_topk(**kw), ref.indexer_topk(**kw))

    def attention_case(t, h, d, b, n, window, visible=None, holes=()):
        pool = b * n + window + 4
        table = torch.randperm(b * n, generator=g).view(b, n).clone()
        for s, j in holes:
            table[s, j] = -1
        win = torch.randint(b * n, pool, (t, window), generator=g)
        if window:
            win[:, 1::3] = -1
        vis = torch.randint(0, n + 1, (t,), generator=g) if visible is None else torch.tensor(visible)
        return dict(q=torch.randn(t, h, d, generator=g), kv=torch.randn(pool, d, generator=g), indices=win, table=table,
                    token_seq=torch.arange(t) % b, visible=vis, sinks=torch.randn(h, generator=g), scale=d ** -0.5)

    sink_only = attention_case(3, 2, 16, 1, 6, 4, visible=[0, 0, 0])
    sink_only["indices"] = torch.full((3, 4), -1)
    attn = {
        "window_and_entries_holes": attention_case(6, 3, 32, 2, 14, 6, visible=[0, 14, 3, 13, 14, 9], holes=[(0, 4), (1, 13)]),
        "entries_only": attention_case(4, 2, 16, 1, 9, 0, visible=[9, 4, 0, 1]),
        "window_only_nothing_visible": attention_case(3, 2, 16, 1, 5, 5, visible=[0, 0, 0]),
        "sink_only": sink_only,
        "b6_each_token_its_rows": attention_case(12, 2, 24, 6, 10, 3),
        "visible_beyond_the_table": attention_case(2, 2, 16, 1, 7, 2, visible=[9, 7]),
    }
    for name, kw in attn.items():
        got, want = asc.entry_attention(**kw), ref.entry_attention(**kw)
        assert_close(got, want, 1e-5)
    assert not bool(asc.entry_attention(**sink_only).any()), "a sink alone weighs no value"
    half = {**attn["window_and_entries_holes"]}
    half.update(q=half["q"].bfloat16(), kv=half["kv"].bfloat16())
    got = asc.entry_attention(**half)
    assert got.dtype == torch.bfloat16
    assert_close(got.float(), ref.entry_attention(**half).float(), 2e-2)
    assert "deepinfer_ascend.triton_ascend_long_context" in sys.modules
    print("ok")
    """
)


def test_triton_ascend_kernels_match_the_reference_under_the_interpreter():
    proc = run_python(["-c", _INTERPRETED], interpret=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-3000:]


def test_scratch_and_block_plans_stay_bounded_at_v4_flash_shapes():
    from deepinfer_ascend.launch import UNIFIED_BUFFERS
    from deepinfer_ascend.triton_ascend_long_context import (
        SCRATCH_ELEMENTS, chunk_tokens, plan_entry_attention, plan_entry_keys, plan_rank_entries, plan_select_entries,
    )

    # a million tokens at CSA ratio 4: 262,144 entries; the scratch holds 16 tokens, never more than 16 MiB
    assert chunk_tokens(8192, 262144) == 16 and chunk_tokens(3, 262144) == 3 and chunk_tokens(5, 1 << 23) == 1
    assert chunk_tokens(8192, 262144) * 262144 <= SCRATCH_ELEMENTS
    for ub in UNIFIED_BUFFERS.values():
        for plan in (plan_entry_keys(64, 128, 262144, torch.bfloat16, ub), plan_select_entries(262144, ub),
                     plan_rank_entries(512, ub), plan_rank_entries(8192, ub), plan_entry_attention(512, torch.bfloat16, ub)):
            assert plan.fits, plan.describe()
    assert plan_entry_attention(512, torch.bfloat16, UNIFIED_BUFFERS["a2"]).blocks["BLOCK_N"] >= 4


# ---- the fused paths, through the documented stand-in ----------------------------------------------------


def _kernels(soc_version: int, **kw) -> tuple[AscendKernels, DocumentedV4Ops]:
    tn = DocumentedV4Ops(soc_version, **kw)
    return AscendKernels(torch_npu=tn), tn


def _topk_at_op_shape(seed: int, dtype=torch.bfloat16, t=6, heads=8, b=2, n=40, k=8, integer=False, holes=(), visible=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    pool = b * n + 9
    table = torch.randperm(pool, generator=g)[: b * n].view(b, n).clone()
    for s, j in holes:
        table[s, j] = -1
    vis = torch.randint(0, n + 1, (t,), generator=g) if visible is None else torch.tensor(visible)
    if integer:
        q, w = torch.randint(-1, 2, (t, heads, 128), generator=g), torch.randint(1, 3, (t, heads), generator=g)
        keys = torch.randint(-1, 2, (pool, 128), generator=g)
    else:
        q, w, keys = torch.randn(t, heads, 128, generator=g), torch.randn(t, heads, generator=g), torch.randn(pool, 128, generator=g)
    return dict(q=q.to(dtype), weights=w.to(dtype), keys=keys.to(dtype), table=table, token_seq=torch.arange(t) % b,
                visible=vis, scale=128**-0.5, k=k)


TOPK_CASES = {
    "holes_within_visible_and_nothing_visible": dict(holes=[(0, 3), (0, 20), (1, 39)], visible=[0, 40, 21, 0, 40, 5]),
    "k_beyond_candidates": dict(n=6, k=9, visible=[6, 2, 0, 6, 5, 1]),
    "b6_sequences": dict(t=12, b=6, n=16, k=5),
    # equal scores in the picked set: the glue re-sorts them into entry order (the set itself is the op's choice)
    "integer_ties_k_covers_every_candidate": dict(integer=True, n=10, k=10, holes=[(1, 4)]),
}


@pytest.mark.parametrize("soc_version", [ASCEND_950, A3, A2])
@pytest.mark.parametrize("case", sorted(TOPK_CASES))
def test_indexer_topk_runs_the_lightning_indexer_and_matches_the_reference(case, soc_version):
    kw = _topk_at_op_shape(len(case), **TOPK_CASES[case])
    kernels, tn = _kernels(soc_version)
    assert torch.equal(kernels.indexer_topk(**kw), REF.indexer_topk(**kw)), case
    assert tn.calls == ["npu_lightning_indexer"] and kernels.failed == {}


def test_indexer_topk_glue_pages_nothing_and_gives_each_token_its_own_length():
    """The op sees valid rows first and the count of rows among the visible entries: holes are never candidates."""
    table = torch.tensor([[5, -1, 7, -1, 2], [-1, -1, 3, 4, 0]])
    entries, counts = npu_v4_ops.valid_first_entries(table)
    assert entries.tolist() == [[0, 2, 4, 5, 5], [2, 3, 4, 5, 5]]
    assert counts.tolist() == [[0, 1, 1, 2, 2, 3], [0, 0, 0, 1, 2, 3]]
    seen = []

    class Recording(DocumentedV4Ops):
        def npu_lightning_indexer(self, query, key, weights, **kw):
            seen.append((tuple(query.shape), tuple(key.shape), kw["actual_seq_lengths_key"].tolist(), kw["sparse_count"]))
            return super().npu_lightning_indexer(query, key, weights, **kw)

    kw = _topk_at_op_shape(3, t=3, b=2, n=5, k=2, visible=[3, 5, 0])
    kw["table"] = table
    tn = Recording(ASCEND_950)
    assert torch.equal(AscendKernels(torch_npu=tn).indexer_topk(**kw), REF.indexer_topk(**kw))
    assert seen == [((3, 1, 8, 128), (3, 5, 1, 128), [2, 3, 0], 4)]
    assert [npu_v4_ops.topk_sparse_count(k) for k in (1, 512, 1500, 2048, 4096, 8192, 8193)] == [2, 1024, 3072, 4096, 8192, 8192, None]


def test_indexer_topk_outside_the_ops_limits_takes_the_triton_path():
    kernels, tn = _kernels(ASCEND_950)
    base = _topk_at_op_shape(4)
    outside = {
        "4_heads_on_950": _topk_at_op_shape(4, heads=4),
        "fp32": _topk_at_op_shape(4, dtype=torch.float32),
        "head_dim_64": {**base, "q": base["q"][..., :64].contiguous(), "keys": base["keys"][:, :64].contiguous()},
        "k_9000": {**base, "k": 9000},
    }
    for name, kw in outside.items():
        # no Triton here: the Triton-Ascend path falls back to the reference; strict, it says it needs Triton
        assert torch.equal(kernels.indexer_topk(**kw), REF.indexer_topk(**kw)), name
        with pytest.raises(NotSupportedError, match="Triton"):
            kernels.for_conformance().indexer_topk(**kw)
    assert tn.calls == []
    a2, tn_a2 = _kernels(A2)
    four = outside["4_heads_on_950"]
    assert torch.equal(a2.indexer_topk(**four), REF.indexer_topk(**four)) and tn_a2.calls == ["npu_lightning_indexer"]
    other, tn_other = _kernels(202)  # a 310P: no lightning indexer
    assert torch.equal(other.indexer_topk(**base), REF.indexer_topk(**base)) and tn_other.calls == []
    # a long prefill over a long context: 64 tokens × 65,536 entries × 128 bf16 would gather 1 GiB (checked, not run)
    q = torch.empty(64, 8, 128, dtype=torch.bfloat16)
    assert "MiB" in npu_v4_ops.indexer_topk_fits(tn, q, q[:, :, 0], q[0], torch.zeros(1, 65536, dtype=torch.int64), 512)
    assert npu_v4_ops.indexer_topk_fits(tn, q[:8], q[:8, :, 0], q[0], torch.zeros(1, 65536, dtype=torch.int64), 512) is None


def test_indexer_topk_whose_fused_op_raises_keeps_the_triton_path_with_one_warning(caplog):
    kernels, tn = _kernels(ASCEND_950, raises={"npu_lightning_indexer": RuntimeError("EZ9999: LightningIndexer tiling failed")})
    kw = _topk_at_op_shape(5)
    with caplog.at_level("WARNING", logger="deepinfer.ascend"):
        for _ in range(2):
            assert torch.equal(kernels.indexer_topk(**kw), REF.indexer_topk(**kw))
    lines = [r.getMessage() for r in caplog.records if r.name == "deepinfer.ascend"]
    assert len(lines) == 1 and "indexer_topk (triton-ascend (950/A3/A2: torch_npu:npu_lightning_indexer)) raised" in lines[0]
    assert tn.calls == ["npu_lightning_indexer"] and "indexer_topk" in kernels.failed


def _attention_at_op_shape(seed: int, dtype=torch.bfloat16, t=5, heads=4, b=2, n=12, window=6, visible=None, holes=()) -> dict:
    g = torch.Generator().manual_seed(seed)
    pool = b * n + window + 3
    table = torch.randperm(b * n, generator=g).view(b, n).clone()
    for s, j in holes:
        table[s, j] = -1
    win = torch.randint(b * n, pool, (t, window), generator=g)
    if window:
        win[:, ::2] = -1
    vis = torch.randint(0, n + 1, (t,), generator=g) if visible is None else torch.tensor(visible)
    return dict(q=torch.randn(t, heads, 512, generator=g).to(dtype), kv=torch.randn(pool, 512, generator=g).to(dtype), indices=win,
                table=table, token_seq=torch.arange(t) % b, visible=vis, sinks=torch.randn(heads, generator=g) * 2, scale=512**-0.5)


ATTENTION_CASES = {
    "window_and_entries_with_holes": dict(visible=[0, 12, 4, 11, 7], holes=[(0, 2), (1, 10)]),
    "entries_only": dict(window=0, visible=[12, 1, 5, 12, 3]),
    "sink_only_rows": dict(window=0, visible=[0, 0, 0, 0, 0]),
    "b6_sequences": dict(t=12, b=6, n=5),
}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_entry_attention_on_950_runs_sparse_flash_attention_and_matches_the_reference(case, dtype):
    kw = _attention_at_op_shape(len(case), dtype, **ATTENTION_CASES[case])
    kernels, tn = _kernels(ASCEND_950)
    got = kernels.entry_attention(**kw)
    close(got, REF.entry_attention(**kw), dtype)
    assert tn.calls == ["npu_sparse_flash_attention"] and kernels.failed == {}
    if case == "sink_only_rows":
        assert not bool(got.any())


def test_entry_attention_off_950_and_outside_the_ops_limits_takes_the_triton_path():
    base = _attention_at_op_shape(7)
    for soc_version in (A3, A2):  # sinks are 950-only
        kernels, tn = _kernels(soc_version)
        assert torch.equal(kernels.entry_attention(**base), REF.entry_attention(**base))
        with pytest.raises(NotSupportedError, match="Triton"):
            kernels.for_conformance().entry_attention(**base)
        assert tn.calls == []
    kernels, tn = _kernels(ASCEND_950)
    g = torch.Generator().manual_seed(8)
    outside = {
        "fp32": {**base, "q": base["q"].float(), "kv": base["kv"].float()},
        "head_256": {**base, "q": base["q"][..., :256].contiguous(), "kv": base["kv"][:, :256].contiguous()},
        "129_heads": {**base, "q": torch.randn(5, 129, 512, generator=g).bfloat16(), "sinks": torch.randn(129, generator=g)},
    }
    for name, kw in outside.items():
        assert torch.equal(kernels.entry_attention(**kw), REF.entry_attention(**kw)), name
    assert tn.calls == []
    # 4096 tokens of a prefill over 8192 HCA entries would list 33.6M indices: the kernel's (checked, not run)
    q = torch.empty(4096, 4, 512, dtype=torch.bfloat16)
    big = npu_v4_ops.entry_attention_fits(tn, q, q[0], torch.zeros(4096, 128, dtype=torch.int64),
                                          torch.zeros(1, 8192, dtype=torch.int64), torch.zeros(4))
    assert big is not None and "indices" in big

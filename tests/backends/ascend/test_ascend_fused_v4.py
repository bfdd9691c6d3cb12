"""Ascend's own fused ops for DeepSeek-V4, checked without an NPU.

The kernel set is built with a stand-in torch_npu (``AscendKernels(torch_npu=...)``):
the real routing and glue run on CPU tensors, and the stand-in's ops compute what
their documents say (op-plugin's op reference and test goldens, CANN
ops-transformer's aclnn docs and goldens) in plain torch, on the SoC it reports.
So a wrong layout conversion in the glue gives a different answer than the
reference op, a gated op called on the wrong SoC raises as CANN would, and every
stand-in method takes exactly the arguments the torch-npu wheel's schema declares.
"""

from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path

import pytest
import torch

from deepinfer_ascend import npu_v4_ops
from deepinfer_ascend.device import generation_from_soc_version
from deepinfer_ascend.kernels import AscendKernels
from deepinfer_interfaces import Kernels, NotSupportedError
from deepinfer_interfaces.specs import SPECS
from deepinfer_interfaces.specs.spec import TOLERANCES

ROOT = Path(__file__).resolve().parents[3]
A2, A3, ASCEND_950 = 222, 250, 260
HALF = (torch.bfloat16, torch.float16)
REF = Kernels()


# ---- the stand-in torch_npu -----------------------------------------------------------------


class StandInNpu:
    """``torch_npu.npu`` as far as SoC detection reads it."""

    def __init__(self, soc_version: int) -> None:
        self.soc_version = soc_version

    def get_soc_version(self) -> int:
        return self.soc_version

    def get_device_name(self, index: int = 0) -> str:
        return "stand-in"


def _contiguous(*tensors: torch.Tensor) -> None:
    assert all(t.is_contiguous() for t in tensors), "the op takes no non-contiguous tensors"


class DocumentedV4Ops:
    """torch_npu's V4 fused ops as their documents define them, on one SoC; ``calls`` lists what ran.

    Where CANN says an op (or an argument) does not exist on the SoC, the stand-in raises as the
    op would. ``raises`` maps an op name to an error to raise instead of computing.
    """

    def __init__(self, soc_version: int, raises: dict[str, Exception] | None = None) -> None:
        self.npu = StandInNpu(soc_version)
        self.generation = generation_from_soc_version(soc_version)
        self.raises = raises or {}
        self.calls: list[str] = []

    def _enter(self, op: str, generations: tuple[str, ...] = ("950", "a3", "a2")) -> None:
        self.calls.append(op)
        if op in self.raises:
            raise self.raises[op]
        if self.generation not in generations:
            raise RuntimeError(f"{op}: EZ9999: no kernel for this SoC ({self.generation})")

    # torch_npu-npu_sparse_flash_attention.md; ops-transformer sparse_flash_attention_golden.py
    def npu_sparse_flash_attention(self, query, key, value, sparse_indices, scale_value, *, block_table=None,
                                   actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                   key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                   sparse_mode=3, pre_tokens=2**63 - 1, next_tokens=2**63 - 1, attention_mode=0,
                                   return_softmax_lse=False, sinks=None):
        self._enter("npu_sparse_flash_attention", ("950",) if sinks is not None else ("950", "a3", "a2"))
        assert (layout_query, layout_kv, block_table, actual_seq_lengths_query, actual_seq_lengths_kv) == ("BSND", "BSND", None, None, None)
        assert attention_mode == 2 and query_rope is not None and key_rope is not None, "only MLA-absorb mode exists"
        assert query.dtype in HALF and key.dtype == value.dtype == query_rope.dtype == key_rope.dtype == query.dtype
        b, s1, n1, d = query.shape
        s2, n2 = key.shape[1], key.shape[2]
        assert d == 512 and n2 == 1 and value.shape == key.shape
        assert query_rope.shape == (b, s1, n1, 64) and key_rope.shape == (b, s2, 1, 64)
        assert sparse_indices.dtype == torch.int32 and sparse_indices.shape[:3] == (b, s1, 1) and sparse_indices.shape[3] > 0
        assert sparse_block_size == 1 and 1 <= n1 <= 128 and sparse_mode in (0, 3)
        _contiguous(query, key, value, sparse_indices, query_rope, key_rope)
        if sinks is not None:
            assert sinks.dtype == torch.float32 and sinks.shape == (n1,)
        q = torch.cat([query, query_rope], dim=-1).float()
        k = torch.cat([key, key_rope], dim=-1).float()
        v = value.float()[..., :512]
        out = torch.zeros(b, s1, n1, d)
        for bi in range(b):
            for si in range(s1):
                threshold = s2 if sparse_mode == 0 else s2 - s1 + si + 1
                rows = []
                for idx in sparse_indices[bi, si, 0].tolist():
                    if idx == -1:  # the golden's ``break``: valid indices must come first
                        break
                    if idx < threshold:
                        rows.append(idx)
                if not rows:
                    continue  # no valid index: zeros
                scores = q[bi, si] @ k[bi, rows, 0].T * scale_value
                top = scores.amax(-1, keepdim=True) if sinks is None else torch.maximum(scores.amax(-1, keepdim=True), sinks[:, None])
                e = torch.exp(scores - top)
                denom = e.sum(-1, keepdim=True) + (0 if sinks is None else torch.exp(sinks[:, None] - top))
                out[bi, si] = (e / denom) @ v[bi, rows, 0]
        empty = torch.empty(0)
        return out.to(query.dtype), empty, empty

    # torch_npu-npu_lightning_indexer.md; op-plugin test_npu_lightning_indexer.py (its golden)
    def npu_lightning_indexer(self, query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                              block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                              pre_tokens=2**63 - 1, next_tokens=2**63 - 1, return_value=False):
        self._enter("npu_lightning_indexer")
        assert (layout_query, layout_key, block_table) == ("BSND", "BSND", None)
        b, s1, n1, d = query.shape
        s2, n2 = key.shape[1], key.shape[2]
        assert d == 128 and n2 == 1 and query.dtype in HALF and key.dtype == query.dtype and n1 <= 64
        assert weights.shape == (b, s1, n1) and (weights.dtype == torch.float32 or weights.dtype == query.dtype)
        if self.generation == "950":
            assert n1 in (8, 16, 24, 32, 64) and weights.dtype != torch.float32
        assert 1 <= sparse_count <= 2048 or sparse_count in (3072, 4096, 5120, 6144, 7168, 8192)
        _contiguous(query, key, weights)
        picked = torch.full((b, s1, 1, sparse_count), -1, dtype=torch.int32)
        values = torch.zeros(b, s1, 1, sparse_count, dtype=query.dtype)
        for bi in range(b):
            lq = s1 if actual_seq_lengths_query is None else int(actual_seq_lengths_query[bi])
            lk = s2 if actual_seq_lengths_key is None else int(actual_seq_lengths_key[bi])
            dots = torch.relu(torch.einsum("shd,kd->shk", query[bi, :lq].float(), key[bi, :lk, 0].float()))
            score = torch.einsum("shk,sh->sk", dots, weights[bi, :lq].float())
            if sparse_mode == 3:
                for i in range(lq):
                    score[lq - 1 - i, lk - i:] = float("-inf")
            vals, order = torch.sort(score, dim=1, descending=True)
            keep = min(sparse_count, lk)
            picked[bi, :lq, 0, :keep] = order[:, :keep].int()
            values[bi, :lq, 0, :keep] = vals[:, :keep].to(query.dtype)
        return picked, values if return_value else torch.empty(0, dtype=query.dtype)

    # torch_npu-npu_mhc_pre.md; op-plugin test_npu_mhc_pre.py
    def npu_mhc_pre(self, x, phi, alpha, bias, *, gamma=None, norm_eps=1e-6, hc_eps=1e-6, out_flag=0, inner_precise=0):
        self._enter("npu_mhc_pre", ("950",))
        t, n, d = x.shape
        assert x.dtype in HALF and phi.dtype == alpha.dtype == bias.dtype == torch.float32
        assert n in (4, 6, 8) and d % 16 == 0 and phi.shape == (n * n + 2 * n, n * d) and alpha.shape == (3,)
        xf = x.reshape(t, n * d).float()
        inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
        h_mix = (xf if gamma is None else xf * gamma.reshape(-1).float()) @ phi.t()
        h_pre, h_post, h_res = (h_mix * inv_rms).split([n, n, n * n], dim=-1)
        h_pre = torch.sigmoid(h_pre * alpha[0] + bias[:n]) + hc_eps
        h_post = 2 * torch.sigmoid(h_post * alpha[1] + bias[n:2 * n])
        h_res = h_res.unflatten(-1, (n, n)) * alpha[2] + bias[2 * n:].view(n, n)
        h_in = (h_pre[..., None] * xf.view(t, n, d)).sum(1).to(x.dtype)
        extra = (inv_rms[:, 0], h_mix, h_pre) if out_flag else (torch.empty(0),) * 3
        return (h_in, h_post, h_res, *extra)

    # torch_npu-npu_mhc_sinkhorn.md; op-plugin test_npu_mhc_sinkhorn.py
    def npu_mhc_sinkhorn(self, x, *, eps=1e-6, num_iters=20, out_flag=0):
        self._enter("npu_mhc_sinkhorn", ("950",))
        assert x.dtype == torch.float32 and x.shape[-1] == x.shape[-2] in (4, 6, 8) and 1 <= num_iters <= 100
        y = torch.softmax(x, dim=-1) + eps
        y = y / (y.sum(dim=-2, keepdim=True) + eps)
        for _ in range(num_iters - 1):
            y = y / (y.sum(dim=-1, keepdim=True) + eps)
            y = y / (y.sum(dim=-2, keepdim=True) + eps)
        return y, torch.empty(0), torch.empty(0)

    # torch_npu-npu_mhc_post.md; op-plugin test_npu_mhc_post.py
    def npu_mhc_post(self, x, h_res, h_out, h_post):
        self._enter("npu_mhc_post", ("950",))
        assert x.dtype in HALF and h_out.dtype == x.dtype and h_res.dtype == h_post.dtype == torch.float32
        post = h_post.unsqueeze(-1) * h_out.float().unsqueeze(-2)
        comb = torch.sum(h_res.unsqueeze(-1) * x.float().unsqueeze(-2), dim=-3)
        return (post + comb).to(x.dtype)

    # aclnnMoeGatingTopKV2.md (hash mode, norm_type 2); torch_npu-npu_moe_gating_top_k.md (top-k mode)
    def npu_moe_gating_top_k(self, x, k, *, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                             group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
        self._enter("npu_moe_gating_top_k")
        assert (input_ids is None) == (tid2eid is None) and x.dim() == 2 and x.shape[1] <= 2048 and group_count == 1
        z = x.float()
        norm = {0: lambda: torch.softmax(z, -1), 1: lambda: torch.sigmoid(z),
                2: lambda: torch.nn.functional.softplus(z).sqrt()}[norm_type]()
        if input_ids is not None:
            assert k <= 64 and tid2eid.shape[1] == k and k_group == group_count and input_ids.shape == (x.shape[0],)
            ids = tid2eid[input_ids.long()].int()
        else:
            assert norm_type in (0, 1), "the top-k mode has softmax and sigmoid only"
            choice = norm if bias is None else norm + bias.float()
            ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k].int()
        y = norm.gather(1, ids.long())
        if norm_type in (1, 2) or renorm == 1:
            y = y / (y.sum(-1, keepdim=True) + eps)
        return (y * routed_scaling_factor).to(x.dtype), ids, norm if out_flag else torch.empty(0)

    # torch_npu-npu_moe_init_routing_v2.md (branch 26.1.0)
    def npu_moe_init_routing_v2(self, x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                                expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                                quant_mode=-1, active_expert_range=[], row_idx_type=0, x_dtype=None):  # noqa: B006 (the schema's default)
        self._enter("npu_moe_init_routing_v2", ("a3", "a2"))
        assert (drop_pad_mode, quant_mode, scale, offset) == (0, -1, None, None) and expert_idx.dtype == torch.int32
        rows, k = expert_idx.shape
        start, end = active_expert_range or (0, expert_num)
        flat = expert_idx.reshape(-1).long()
        assert bool(((flat >= 0) & (flat <= expert_num)).all()), "expert ids must be in [0, expert_num]"
        n = rows * k
        # keyValueSort; no order within an expert is promised: this one puts later rows first
        sorted_row = torch.sort(flat * n + (n - 1 - torch.arange(n))).indices
        in_range = (flat[sorted_row] >= start) & (flat[sorted_row] < end)
        available = int(in_range.sum())
        scatter = torch.full((n,), n - 1, dtype=torch.int64)  # "invalid data is uninitialized": a real row, wrongly
        scatter[:available] = sorted_row[in_range]
        if row_idx_type == 1:
            row_idx = scatter
        else:
            row_idx = torch.full((n,), -1, dtype=torch.int64)
            row_idx[scatter[:available]] = torch.arange(available)
        expanded = torch.full((n, x.shape[1]), float("nan"), dtype=x.dtype)
        expanded[:available] = x[scatter[:available] // k]
        counts = torch.bincount(flat[(flat >= start) & (flat < end)] - start, minlength=end - start)
        counts = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
        return expanded, row_idx.int(), counts.to(torch.int64), torch.empty(0)

    # the ops moe_experts runs around the permutation (as tests/backends/ascend/test_ascend.py's DocumentedNpuOps)
    def npu_grouped_matmul(self, x, weight, *, group_list=None, group_type=None, group_list_type=0, split_item=0):
        self._enter("npu_grouped_matmul")
        assert (group_type, group_list_type, split_item) == (0, 1, 2) and len(x) == len(weight) == 1
        rows = x[0][: int(group_list.sum())].split(group_list.tolist())
        return [torch.cat([r @ weight[0][e] for e, r in enumerate(rows)])]

    def npu_swiglu(self, x, dim=-1):
        self._enter("npu_swiglu")
        a, b = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(a) * b

    def npu_clipped_swiglu(self, x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
        self._enter("npu_clipped_swiglu", ("a3", "a2"))
        a, b = (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
        a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
        return a * torch.sigmoid(alpha * a) * (b + bias)


#: the stand-in's ops written from the V4 ops' documents (the rest mirror tests/backends/ascend/test_ascend.py's subset)
STAND_IN_OPS = ["npu_sparse_flash_attention", "npu_lightning_indexer", "npu_mhc_pre", "npu_mhc_sinkhorn", "npu_mhc_post",
                "npu_moe_gating_top_k", "npu_moe_init_routing_v2"]


def _kernels(soc_version: int, **kw) -> tuple[AscendKernels, DocumentedV4Ops]:
    tn = DocumentedV4Ops(soc_version, **kw)
    return AscendKernels(torch_npu=tn), tn


def close(got, want, dtype: torch.dtype, factor: float = 1.0) -> None:
    """Within the op specs' tolerance for ``dtype`` (``-inf`` where the reference has it)."""
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    tol = TOLERANCES[dtype]
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        a, b = a.double(), b.double()
        inf = torch.isinf(b)
        assert torch.equal(torch.isinf(a), inf) and torch.equal(a[inf], b[inf])
        err = (a - b).abs()[~inf]
        bound = (tol.atol + tol.rtol * b.abs())[~inf] * factor
        assert bool((err <= bound).all()), float((err - bound).max())


def _cases(op: str) -> dict:
    return {c.name: c.kwargs for c in SPECS[op].cases()}


# ---- sparse attention: npu_sparse_flash_attention with sinks -------------------------------


def _attention_at_op_shape(kw: dict, dtype: torch.dtype, seed: int) -> dict:
    """A spec case at the op's head (512 wide): its indices (-1 anywhere, masked rows), sinks, tokens, heads and pool."""
    g = torch.Generator().manual_seed(seed)
    t, h, _ = kw["q"].shape
    n = kw["kv"].shape[0]
    return dict(q=torch.randn(t, h, 512, generator=g).to(dtype), kv=torch.randn(n, 512, generator=g).to(dtype),
                indices=kw["indices"], sinks=kw["sinks"], scale=512**-0.5)


ATTENTION_CASES = ["t5_h4_d32_random_rows_padded", "window_longer_than_sequence", "fully_masked_row_sink_only", "large_sinks"]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_sparse_attention_on_950_matches_the_reference(case, dtype):
    kw = _attention_at_op_shape(_cases("sparse_attention")[case], dtype, seed=len(case))
    kernels, tn = _kernels(ASCEND_950)
    close(kernels.sparse_attention(**kw), REF.sparse_attention(**kw), dtype)
    assert tn.calls == ["npu_sparse_flash_attention"] and kernels.failed == {}


def test_the_zero_key_rope_is_one_cached_contiguous_block():
    like = torch.zeros(1, dtype=torch.bfloat16)
    a = npu_v4_ops.zero_key_rope(10, like)
    b = npu_v4_ops.zero_key_rope(4, like)
    assert a.shape == (1, 10, 1, 64) and b.shape == (1, 4, 1, 64) and b.is_contiguous() and b.data_ptr() == a.data_ptr()
    assert not bool(a.any()) and npu_v4_ops.zero_key_rope(4, like.half()).dtype == torch.float16


def test_sparse_attention_packs_valid_rows_first_and_zeroes_rows_without_one():
    idx = torch.tensor([[-1, 3, -1, 0, 2], [-1, -1, -1, -1, -1], [4, -1, 1, -1, -1]])
    packed = npu_v4_ops.pack_valid_first(idx)
    assert packed.tolist() == [[3, 0, 2, -1, -1], [-1] * 5, [4, 1, -1, -1, -1]]
    g = torch.Generator().manual_seed(1)
    kw = dict(q=torch.randn(3, 2, 512, generator=g).bfloat16(), kv=torch.randn(5, 512, generator=g).bfloat16(),
              indices=idx, sinks=torch.tensor([0.5, -3.0]), scale=0.05)
    kernels, _ = _kernels(ASCEND_950)
    got = kernels.sparse_attention(**kw)
    assert torch.equal(got[1], torch.zeros(2, 512, dtype=torch.bfloat16))
    close(got, REF.sparse_attention(**kw), torch.bfloat16)


@pytest.mark.parametrize("soc_version", [A3, A2])
def test_sparse_attention_with_sinks_stays_on_the_reference_on_a2_and_a3(soc_version):
    kw = _attention_at_op_shape(_cases("sparse_attention")["t5_h4_d32_random_rows_padded"], torch.bfloat16, 0)
    kernels, tn = _kernels(soc_version)
    assert torch.equal(kernels.sparse_attention(**kw), REF.sparse_attention(**kw))
    with pytest.raises(NotSupportedError, match="Ascend 950 only"):
        kernels.for_conformance().sparse_attention(**kw)
    assert tn.calls == []


def test_sparse_attention_outside_the_ops_limits_runs_the_reference():
    kernels, tn = _kernels(ASCEND_950)
    base = _attention_at_op_shape(_cases("sparse_attention")["large_sinks"], torch.bfloat16, 3)
    g = torch.Generator().manual_seed(4)
    outside = {
        **_cases("sparse_attention"),  # the spec's own cases: 16/32-wide heads, fp32
        "fp32_at_512": {**base, "q": base["q"].float(), "kv": base["kv"].float()},
        "129_heads": {**base, "q": torch.randn(3, 129, 512, generator=g).bfloat16(), "sinks": torch.randn(129, generator=g)},
        "mixed_dtypes": {**base, "kv": base["kv"].half()},
    }
    for name, kw in outside.items():
        assert torch.equal(kernels.sparse_attention(**kw), REF.sparse_attention(**kw)), name
    assert tn.calls == []
    with pytest.raises(NotSupportedError, match="512-wide head"):
        kernels.for_conformance().sparse_attention(**_half(_cases("sparse_attention")["large_sinks"], ("q", "kv"), torch.bfloat16))


# ---- the lightning indexer: npu_lightning_indexer ------------------------------------------


def _indexer_at_op_shape(kw: dict, dtype: torch.dtype, seed: int, heads: int = 8) -> dict:
    """A spec case at the op's shape (8 heads of 128): its candidates (-1 padded, fully invalid rows) and pool size."""
    g = torch.Generator().manual_seed(seed)
    t, n = kw["q"].shape[0], kw["keys"].shape[0]
    return dict(q=torch.randn(t, heads, 128, generator=g).to(dtype), weights=torch.randn(t, heads, generator=g).to(dtype),
                keys=torch.randn(n, 128, generator=g).to(dtype), indices=kw["indices"], scale=kw["scale"])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", ["t6_h4_d16_padded", "single_head"])
def test_indexer_scores_on_950_match_the_reference(case, dtype):
    kw = _indexer_at_op_shape(_cases("indexer_scores")[case], dtype, seed=len(case))
    kernels, tn = _kernels(ASCEND_950)
    got = kernels.indexer_scores(**kw)
    close(got, REF.indexer_scores(**kw), dtype)
    assert tn.calls == ["npu_lightning_indexer"]
    if case == "t6_h4_d16_padded":
        assert bool(torch.isinf(got[2]).all()), "a row without candidates scores -inf everywhere"


def test_indexer_scores_beyond_2048_candidates_round_the_sparse_count_up():
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(-1, 40, (2, 2500), generator=g)
    kw = dict(q=torch.randn(2, 16, 128, generator=g).half(), weights=torch.randn(2, 16, generator=g).half(),
              keys=torch.randn(40, 128, generator=g).half(), indices=idx, scale=0.1)
    assert [npu_v4_ops.lightning_sparse_count(k) for k in (1, 2048, 2049, 2500, 8192, 8193)] == [1, 2048, 3072, 3072, 8192, None]
    kernels, tn = _kernels(ASCEND_950)
    close(kernels.indexer_scores(**kw), REF.indexer_scores(**kw), torch.float16)
    assert tn.calls == ["npu_lightning_indexer"]


@pytest.mark.parametrize("soc_version", [A3, A2])
def test_indexer_scores_keep_the_triton_kernel_on_a2_and_a3(soc_version):
    kw = _indexer_at_op_shape(_cases("indexer_scores")["t6_h4_d16_padded"], torch.bfloat16, 0)
    kernels, tn = _kernels(soc_version)
    assert torch.equal(kernels.indexer_scores(**kw), REF.indexer_scores(**kw))  # no Triton here: its fallback, the reference
    with pytest.raises(NotSupportedError, match="Triton"):
        kernels.for_conformance().indexer_scores(**kw)
    assert tn.calls == []


def test_indexer_scores_outside_the_ops_limits_take_the_triton_path():
    kernels, tn = _kernels(ASCEND_950)
    base = _indexer_at_op_shape(_cases("indexer_scores")["t6_h4_d16_padded"], torch.bfloat16, 1)
    g = torch.Generator().manual_seed(6)
    outside = {
        **_cases("indexer_scores"),  # the spec's own cases: 1 and 4 heads of 8/16, fp32
        "4_heads": _indexer_at_op_shape(_cases("indexer_scores")["t6_h4_d16_padded"], torch.bfloat16, 1, heads=4),
        "fp32": {**base, "q": base["q"].float(), "keys": base["keys"].float()},
        "9000_candidates": {**base, "indices": torch.randint(-1, 12, (6, 9000), generator=g)},
    }
    for name, kw in outside.items():
        assert torch.equal(kernels.indexer_scores(**kw), REF.indexer_scores(**kw)), name
    assert tn.calls == []
    # a long prefill: 1100 tokens × 2048 candidates × 128 bf16 would gather 550 MiB (checked without running it)
    long = _indexer_at_op_shape({"q": torch.empty(1100, 1, 1), "keys": base["keys"], "scale": 0.1,
                                 "indices": torch.zeros(1100, 2048, dtype=torch.int64)}, torch.bfloat16, 2)
    assert "MiB" in npu_v4_ops.indexer_scores_fits(tn, long["q"], long["weights"], long["keys"], long["indices"])
    assert npu_v4_ops.indexer_scores_fits(tn, long["q"][:1000], long["weights"][:1000], long["keys"], long["indices"][:1000]) is None


# ---- mHC: npu_mhc_pre + npu_mhc_sinkhorn, npu_mhc_post --------------------------------------


def _half(kw: dict, names: tuple[str, ...], dtype: torch.dtype) -> dict:
    return {k: (v.to(dtype) if k in names else v) for k, v in kw.items()}


def _mhc_pre_case(n: int, d: int, iters: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(4, n, d, generator=g), fn=torch.randn((2 + n) * n, n * d, generator=g) * 0.1,
                base=torch.randn((2 + n) * n, generator=g) * 0.5, scale=torch.rand(3, generator=g) + 0.5,
                norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=iters)


@pytest.mark.parametrize("dtype", HALF)
def test_mhc_pre_on_950_matches_the_reference(dtype):
    cases = {**_cases("mhc_pre"), "t4_n6_d32_3_iters": _mhc_pre_case(6, 32, 3, 1), "t4_n8_d16_100_iters": _mhc_pre_case(8, 16, 100, 2)}
    for name, master in cases.items():
        if master["x"].shape[0] == 0:
            continue
        kw = _half(master, ("x",), dtype)
        kernels, tn = _kernels(ASCEND_950)
        got = kernels.mhc_pre(**kw)
        close(got, REF.mhc_pre(**kw), dtype)
        fused = master["x"].shape[1] in (4, 6, 8)
        assert tn.calls == (["npu_mhc_pre", "npu_mhc_sinkhorn"] if fused else []), name  # t3_n2_d8: 2 streams, the reference


@pytest.mark.parametrize("dtype", HALF)
def test_mhc_post_on_950_matches_the_reference(dtype):
    for name, master in _cases("mhc_post").items():
        if master["x"].shape[0] == 0:
            continue
        kw = _half(master, ("y", "x"), dtype)
        kernels, tn = _kernels(ASCEND_950)
        close(kernels.mhc_post(**kw), REF.mhc_post(**kw), dtype)
        assert tn.calls == (["npu_mhc_post"] if master["x"].shape[1] == 4 else []), name


@pytest.mark.parametrize("soc_version", [A3, A2])
def test_mhc_keeps_the_triton_kernels_on_a2_and_a3(soc_version):
    pre = _half(_cases("mhc_pre")["t5_n4_d16_20_iters"], ("x",), torch.bfloat16)
    post = _half(_cases("mhc_post")["t5_n4_d16"], ("y", "x"), torch.bfloat16)
    kernels, tn = _kernels(soc_version)
    close(kernels.mhc_pre(**pre), REF.mhc_pre(**pre), torch.bfloat16)
    close(kernels.mhc_post(**post), REF.mhc_post(**post), torch.bfloat16)
    assert tn.calls == []


def test_mhc_outside_the_ops_limits_takes_the_triton_path():
    kernels, tn = _kernels(ASCEND_950)
    fits = _half(_mhc_pre_case(4, 16, 20, 3), ("x",), torch.bfloat16)
    for kw in (_mhc_pre_case(4, 16, 20, 3),  # fp32 streams
               _half(_mhc_pre_case(4, 24, 20, 4), ("x",), torch.bfloat16),  # 24 channels: not a multiple of 16
               _half(_mhc_pre_case(3, 16, 20, 5), ("x",), torch.bfloat16),  # 3 streams
               {**fits, "sinkhorn_iters": 0}, {**fits, "sinkhorn_iters": 101}):
        close(kernels.mhc_pre(**kw), REF.mhc_pre(**kw), kw["x"].dtype if kw["x"].dtype in HALF else torch.float32)
    post = _half(_cases("mhc_post")["t5_n4_d16"], ("x",), torch.bfloat16)  # y stays fp32: not x's dtype
    assert torch.equal(kernels.mhc_post(**post), REF.mhc_post(**post))
    assert tn.calls == []


# ---- hash routing: npu_moe_gating_top_k's hash mode ----------------------------------------


@pytest.mark.parametrize("soc_version", [ASCEND_950, A3, A2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hash_route_runs_the_hash_mode_on_every_soc(soc_version, dtype):
    table = _cases("hash_route")["t6_v32_e8_k2"]["tid2eid"]
    g = torch.Generator().manual_seed(7)
    cases = {
        "t6_v32_e8_k2": _cases("hash_route")["t6_v32_e8_k2"],  # V4: sqrtsoftplus, renormalised
        "sigmoid_renormalised": {**_cases("hash_route")["sigmoid_no_renormalize"], "renormalize": True},
        "int32_table_k6_of_256": dict(logits=torch.randn(5, 256, generator=g), token_ids=torch.randint(0, 64, (5,), generator=g),
                                      tid2eid=torch.stack([torch.randperm(256, generator=g)[:6] for _ in range(64)]).int(),
                                      routed_scaling=2.5, scoring="sqrtsoftplus", renormalize=True),
    }
    assert table.shape == (32, 2)
    for name, master in cases.items():
        kw = _half(master, ("logits",), dtype)
        kernels, tn = _kernels(soc_version)
        got_w, got_ids = kernels.hash_route(**kw)
        want_w, want_ids = REF.hash_route(**kw)
        assert torch.equal(got_ids, want_ids) and got_w.dtype == want_w.dtype, name
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)
        assert tn.calls == ["npu_moe_gating_top_k"], name


def test_hash_route_outside_the_hash_mode_runs_the_reference():
    kernels, tn = _kernels(ASCEND_950)
    base = _cases("hash_route")["t6_v32_e8_k2"]
    g = torch.Generator().manual_seed(8)
    wide = torch.stack([torch.randperm(80, generator=g)[:65] for _ in range(32)])
    for kw in (_cases("hash_route")["sigmoid_no_renormalize"], {**base, "scoring": "softmax"},
               {**base, "logits": torch.randn(6, 80, generator=g), "tid2eid": wide}, _cases("hash_route")["empty_batch"]):
        got, want = kernels.hash_route(**kw), REF.hash_route(**kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert tn.calls == []
    other, tn_other = _kernels(202)  # a 310P: aclnnMoeGatingTopKV2 is not documented there
    got, want = other.hash_route(**base), REF.hash_route(**base)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and tn_other.calls == []
    with pytest.raises(NotSupportedError, match="renormalises"):
        kernels.for_conformance().hash_route(**_cases("hash_route")["sigmoid_no_renormalize"])


# ---- the expert permutation: npu_moe_init_routing_v2 on A2/A3 -------------------------------


@pytest.mark.parametrize(("soc_version", "permutes"), [(A2, True), (A3, True), (ASCEND_950, False)])
def test_moe_experts_group_rows_with_init_routing_on_a2_and_a3(soc_version, permutes):
    g = torch.Generator().manual_seed(9)
    ids = torch.tensor([[5, 5], [0, -1], [9, 2], [-1, -1], [1, 0], [2, 2], [5, 3], [4, 1], [0, 0]])
    extra = dict(x=torch.randn(9, 16, generator=g), topk_ids=ids,
                 topk_weights=torch.rand(9, 2, generator=g), w13=torch.randn(6, 16, 16, generator=g) * 0.3,
                 w2=torch.randn(6, 16, 8, generator=g) * 0.3, limit=0.7)
    cases = {**_cases("moe_experts"), "repeated_experts_and_foreign_ids": extra,
             "all_skipped": {**extra, "topk_ids": torch.tensor([[-1, 7]] * 9)}}
    for name, kw in cases.items():
        kernels, tn = _kernels(soc_version)
        torch.testing.assert_close(kernels.moe_experts(**kw), REF.moe_experts(**kw), rtol=1e-5, atol=1e-5)
        rows = bool(((kw["topk_ids"] >= 0) & (kw["topk_ids"] < kw["w13"].shape[0])).any())
        rows &= 2 <= kw["w13"].shape[0] <= 1024  # npu_grouped_matmul's group count (one local expert runs the reference)
        assert ("npu_moe_init_routing_v2" in tn.calls) == (permutes and rows), name
        assert ("npu_grouped_matmul" in tn.calls) == rows, name


# ---- errors, the strict view and the declared paths -----------------------------------------


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deepinfer.ascend" and r.levelno == logging.WARNING]


def test_a_v4_fused_op_that_raises_falls_back_once_with_one_warning(caplog):
    error = RuntimeError("EZ9999: Inner Error!\nEZ9999: SparseFlashAttentionV2 tiling failed")
    kernels, tn = _kernels(ASCEND_950, raises={"npu_sparse_flash_attention": error, "npu_mhc_pre": RuntimeError("EZ1001: bad phi")})
    attn = _attention_at_op_shape(_cases("sparse_attention")["large_sinks"], torch.bfloat16, 2)
    pre = _half(_cases("mhc_pre")["t5_n4_d16_20_iters"], ("x",), torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="deepinfer.ascend"):
        for _ in range(2):
            assert torch.equal(kernels.sparse_attention(**attn), REF.sparse_attention(**attn))
            close(kernels.mhc_pre(**pre), REF.mhc_pre(**pre), torch.bfloat16)  # its Triton path; here the reference
    lines = _warnings(caplog)
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert "sparse_attention (torch_npu:npu_sparse_flash_attention) raised RuntimeError: EZ9999: Inner Error!" in lines[0]
    assert "mhc_pre (triton-ascend (950: torch_npu:npu_mhc_pre+npu_mhc_sinkhorn)) raised RuntimeError: EZ1001" in lines[1]
    assert tn.calls == ["npu_sparse_flash_attention", "npu_mhc_pre"] and set(kernels.failed) == {"sparse_attention", "mhc_pre"}
    strict, _ = _kernels(ASCEND_950, raises={"npu_sparse_flash_attention": error})
    with pytest.raises(RuntimeError, match="EZ9999"):
        strict.for_conformance().sparse_attention(**attn)


def test_without_torch_npu_the_new_paths_say_so_under_the_strict_view():
    strict = AscendKernels(strict=True)
    attn = _cases("sparse_attention")["large_sinks"]
    with pytest.raises(NotSupportedError, match="needs torch_npu: torch_npu:npu_sparse_flash_attention"):
        strict.sparse_attention(**attn)
    with pytest.raises(NotSupportedError, match="needs torch_npu: torch_npu:npu_moe_gating_top_k"):
        strict.hash_route(**_cases("hash_route")["t6_v32_e8_k2"])
    for op, how in AscendKernels.paths().items():  # no accidental reference under the Ascend name
        assert how.startswith("torch_npu:") or how.startswith("triton-ascend"), (op, how)


def test_every_fused_op_a_path_names_is_called_by_the_backend():
    from tests.helpers.npu_calls import extract_calls, package_sources

    named = {op for how in AscendKernels.paths().values() for ops in re.findall(r"torch_npu:([\w+]+)", how) for op in ops.split("+")}
    assert {"npu_sparse_flash_attention", "npu_lightning_indexer", "npu_mhc_pre", "npu_mhc_sinkhorn", "npu_mhc_post"} <= named
    calls = extract_calls(package_sources(ROOT / "backends" / "ascend" / "deepinfer_ascend", "deepinfer_ascend", ROOT))
    called = {c.target for c in calls if c.kind == "call"}
    assert named | {"npu_moe_init_routing_v2"} <= called, sorted(named - called)


def test_the_stand_in_takes_exactly_the_arguments_the_wheel_declares():
    """A stand-in with a made-up keyword would let wrong glue pass; its parameters are the schema's."""
    from tests.helpers.npu_schemas import codegen_schemas, parse_schema
    from tests.helpers.torch_npu_wheel import WheelUnavailable, torch_npu_wheel

    try:
        wheel = torch_npu_wheel()
    except WheelUnavailable as exc:
        pytest.skip(str(exc))
    schemas = codegen_schemas(wheel.path)
    for op in STAND_IN_OPS:
        schema = parse_schema(schemas[op])
        params = list(inspect.signature(getattr(DocumentedV4Ops, op)).parameters.values())[1:]
        assert [(p.name, p.kind == p.KEYWORD_ONLY) for p in params] == [(p.name, p.keyword_only) for p in schema.params], op

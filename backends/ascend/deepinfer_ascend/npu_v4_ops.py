"""DeepSeek-V4's attention, indexer, mHC and hash routing on torch_npu's own fused ops.

Each op has a ``*_fits`` check (``None`` when the op takes the inputs on this
SoC, else the reason it does not) and the glue that calls it; the glue raises
``NotSupportedError`` with that reason, so the kernel set runs the next path
(the Triton-Ascend kernel or the reference). Every glue function states the
torch_npu 2.13.0 signature it relies on (the wheel's registered schema), the
semantic gap it bridges, and where the semantics come from:

- op-plugin, the torch_npu op reference and its test goldens:
  https://github.com/Ascend/op-plugin (``docs/zh/custom_APIs/torch_npu/``,
  ``docs/en/custom_APIs/torch_npu/`` on branch 26.1.0, ``test/test_custom_ops/``);
- CANN ops-transformer, the aclnn kernels behind them and their goldens:
  https://github.com/hicann/ops-transformer.

SoC gating follows those documents: the generation comes from
``device.detect_soc`` (``torch_npu.npu.get_soc_version()``); a ``tn`` without
``npu`` (a stand-in that does not say) counts as unknown, which no gated op
accepts.
"""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer_interfaces import NotSupportedError
from deepinfer_interfaces.kernels.attention import take_rows

from .device import cached_soc

_HALF = (torch.float16, torch.bfloat16)

#: ``npu_sparse_flash_attention``'s ``sinks``: "参数sinks仅支持Ascend 950PR/Ascend 950DT" (aclnnSparseFlashAttentionV2)
SPARSE_ATTENTION_GENERATIONS = frozenset({"950"})
#: its head dims: "query中的D和key、value的D值相等为512, query_rope中的Dr和key_rope的Dr值相等为64"
SFA_HEAD_DIM, SFA_ROPE_DIM = 512, 64
#: query heads on Ascend 950: "N1支持1~128"
SFA_MAX_HEADS = 128

#: ``npu_lightning_indexer`` with ``return_value=True`` under graph capture: "return_value仅在Ascend 950PR/Ascend 950DT
#: 上支持图模式", and V4 decodes in captured NPU graphs
LIGHTNING_INDEXER_GENERATIONS = frozenset({"950"})
#: "query中的D和参数key中的D值相等为128"; on Ascend 950 "query中的N仅支持8、16、24、32、64"
INDEXER_HEAD_DIM = 128
INDEXER_HEADS_950 = frozenset({8, 16, 24, 32, 64})
#: ``sparse_count``: "支持[1, 2048]以及3072、4096、5120、6144、7168、8192"
INDEXER_MAX_COUNT = 8192
#: the most bytes of gathered candidate keys (T × K × 128 in the query dtype) the glue materialises; a larger step
#: (a long prefill) keeps the Triton-Ascend kernel, which gathers inside the kernel
INDEXER_MAX_GATHER_BYTES = 512 << 20

#: ``npu_mhc_pre`` / ``npu_mhc_sinkhorn`` / ``npu_mhc_post``: "Supported Products: Ascend 950PR/Ascend 950DT" only
MHC_GENERATIONS = frozenset({"950"})
#: "n: Valid values: 4, 6, and 8" (npu_mhc_pre, npu_mhc_sinkhorn); "D ... 1 to 16384 and must be a multiple of 16"
MHC_STREAMS = frozenset({4, 6, 8})
MHC_MAX_DIM = 16384
#: npu_mhc_sinkhorn's ``num_iters``: "The value range is [1, 100]"
MHC_MAX_ITERS = 100

#: hash-mode ``norm_type`` of aclnnMoeGatingTopKV2 (0 softmax, 1 sigmoid, 2 sqrtSoftplus); softmax is left out:
#: the top-k mode's note says Ascend 950 rejects it, and one error would send every hash routing to the reference
HASH_NORM_TYPES = {"sigmoid": 1, "sqrtsoftplus": 2}
#: aclnnMoeGatingTopKV2 (torch_npu's hash mode): "Ascend 950PR/Ascend 950DT：支持", A3 and A2 likewise; 310B/310P/910 not
HASH_ROUTE_GENERATIONS = frozenset({"950", "a3", "a2"})
#: "x最后一维（即专家数）要求不大于2048", "Hash模式下k要求不大于64"
HASH_MAX_EXPERTS, HASH_MAX_K = 2048, 64


def _need(reason: str | None) -> None:
    if reason is not None:
        raise NotSupportedError(reason)


def generation(tn: ModuleType, device: torch.device) -> str | None:
    """The SoC generation of ``device`` as ``tn.npu`` reports it (see ``device.detect_soc``); None without ``tn.npu``."""
    npu = getattr(tn, "npu", None)
    return None if npu is None else cached_soc(npu, device.index or 0).generation


def _soc_reason(tn: ModuleType, device: torch.device, allowed: frozenset[str], what: str) -> str | None:
    gen = generation(tn, device)
    if gen in allowed:
        return None
    return f"{what} is documented for Ascend {'/'.join(sorted(allowed))} only; this NPU is {gen or 'of an unknown generation'}"


# ---- sparse attention -----------------------------------------------------------------------


def sparse_attention_fits(
    tn: ModuleType, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor
) -> str | None:
    """Why ``npu_sparse_flash_attention`` cannot take these inputs here, or None."""
    soc = _soc_reason(tn, q.device, SPARSE_ATTENTION_GENERATIONS, "npu_sparse_flash_attention with sinks")
    if soc is not None:
        return soc
    t, h, d = q.shape
    if q.dtype not in _HALF or kv.dtype != q.dtype:
        return f"npu_sparse_flash_attention takes fp16/bf16 q and kv of one dtype, not {q.dtype}/{kv.dtype}"
    if d != SFA_HEAD_DIM or kv.shape[-1] != SFA_HEAD_DIM:
        return f"npu_sparse_flash_attention needs a {SFA_HEAD_DIM}-wide head, got {d}"
    if not 1 <= h <= SFA_MAX_HEADS or sinks.shape != (h,):
        return f"npu_sparse_flash_attention takes 1 to {SFA_MAX_HEADS} query heads with one sink each, got {h} and {tuple(sinks.shape)}"
    if t == 0 or indices.shape[1] == 0 or kv.shape[0] == 0:
        return "npu_sparse_flash_attention takes no empty tensors"
    return None


#: one block of zeros per (device, dtype) for the op's ``key_rope``, grown to the largest pool seen (the pools are
#: fixed-size, so it is allocated on the first, eager, call and never again)
_ZERO_ROPE: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def zero_key_rope(n: int, like: torch.Tensor) -> torch.Tensor:
    """``[1, n, 1, 64]`` contiguous zeros in ``like``'s dtype and device, a view of the cached block."""
    key = (like.device, like.dtype)
    block = _ZERO_ROPE.get(key)
    if block is None or block.shape[1] < n:
        block = like.new_zeros(1, n, 1, SFA_ROPE_DIM)
        _ZERO_ROPE[key] = block
    return block[:, :n]


def pack_valid_first(indices: torch.Tensor) -> torch.Tensor:
    """``indices`` with each row's valid (``>= 0``) entries moved to the front, in order, and ``-1`` after them."""
    order = torch.sort((indices < 0).to(torch.int32), dim=1, stable=True).indices
    return indices.gather(1, order)


def sparse_attention(
    tn: ModuleType, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """``Kernels.sparse_attention`` through ``torch_npu.npu_sparse_flash_attention(query, key, value,
    sparse_indices, scale_value, *, block_table=None, actual_seq_lengths_query=None,
    actual_seq_lengths_kv=None, query_rope=None, key_rope=None, sparse_block_size=1,
    layout_query='BSND', layout_kv='BSND', sparse_mode=3, pre_tokens=2**63-1, next_tokens=2**63-1,
    attention_mode=0, return_softmax_lse=False, sinks=None) -> (Tensor, Tensor, Tensor)``.

    The gap it bridges:

    - layout: the whole step is one batch in BSND, ``query`` ``[1, T, H, 512]``
      and the pool as ``key`` = ``value`` ``[1, N, 1, 512]`` (one shared K=V
      head, the op's ``N2 = 1``); ``sparse_mode=0`` (no causal mask: V4's rows
      already say what each token sees) and ``sparse_block_size=1`` (the only
      size Ascend 950 takes), so an index is one pool row;
    - indices: the op reads each row up to its first ``-1`` ("每行有效值均在前半部分,
      无效值均在后半部分"), V4 pads with ``-1`` anywhere in the row; a stable
      sort moves the valid ones to the front (attention does not depend on
      their order), as int32;
    - head: the op runs only in MLA-absorb mode (``attention_mode=2``: scores
      over ``[q, q_rope] · [k, k_rope]``, value = ``key``), V4's rope lives
      inside the 512-wide head, so ``q_rope``/``k_rope`` are 64-wide zeros
      (``k_rope`` one cached ``N × 64`` block, :func:`zero_key_rope`);
    - sinks: V4's ``[H]`` fp32 sink logits are the op's ``sinks``, which its
      golden folds in exactly as V4 does (into the max and the denominator,
      contributing no value);
    - a row without one valid index: the golden returns zeros, as V4 does; the
      glue also zeroes such rows, so no kernel convention for them matters.

    Sources: op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_sparse_flash_attention.md``
    (950: N1 1-128, sparse_block_size 1; A2/A3: no sinks); ops-transformer
    ``attention/sparse_flash_attention/docs/aclnnSparseFlashAttentionV2.md`` and
    ``tests/pytest/sparse_flash_attention_golden.py`` (``softmax(x, sinks)``, the
    ``-1`` break, zeros for empty rows, value = key[..., :512]).
    """
    _need(sparse_attention_fits(tn, q, kv, indices, sinks))
    t, h, d = q.shape
    n, k = kv.shape[0], indices.shape[1]
    rows = pack_valid_first(indices)
    query = q.contiguous().view(1, t, h, d)
    key = kv.contiguous().view(1, n, 1, d)
    out = tn.npu_sparse_flash_attention(
        query, key, key, rows.to(torch.int32).view(1, t, 1, k).contiguous(), float(scale),
        query_rope=q.new_zeros(1, t, h, SFA_ROPE_DIM), key_rope=zero_key_rope(n, kv),
        sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=0, attention_mode=2,
        return_softmax_lse=False, sinks=sinks.float().contiguous(),
    )[0]
    seen = (indices >= 0).any(dim=1)
    return torch.where(seen[:, None, None], out.view(t, h, d), torch.zeros((), dtype=q.dtype, device=q.device))


# ---- the lightning indexer ------------------------------------------------------------------


def lightning_sparse_count(k: int) -> int | None:
    """The smallest ``sparse_count`` ``npu_lightning_indexer`` takes that keeps all ``k`` candidates; None past 8192."""
    if 1 <= k <= 2048:
        return k
    if 2048 < k <= INDEXER_MAX_COUNT:
        return -(-k // 1024) * 1024
    return None


def indexer_scores_fits(
    tn: ModuleType, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor
) -> str | None:
    """Why ``npu_lightning_indexer`` cannot score these candidates here, or None."""
    soc = _soc_reason(tn, q.device, LIGHTNING_INDEXER_GENERATIONS, "npu_lightning_indexer's return_value under graph capture")
    if soc is not None:
        return soc
    t, h, d = q.shape
    if q.dtype not in _HALF or keys.dtype != q.dtype:
        return f"npu_lightning_indexer takes fp16/bf16 query and key of one dtype, not {q.dtype}/{keys.dtype}"
    if d != INDEXER_HEAD_DIM or keys.shape[-1] != INDEXER_HEAD_DIM:
        return f"npu_lightning_indexer needs a {INDEXER_HEAD_DIM}-wide index head, got {d}"
    if h not in INDEXER_HEADS_950:
        return f"npu_lightning_indexer on Ascend 950 takes {sorted(INDEXER_HEADS_950)} query heads, got {h}"
    if t == 0 or keys.shape[0] == 0 or lightning_sparse_count(indices.shape[1]) is None:
        return f"npu_lightning_indexer returns at most {INDEXER_MAX_COUNT} candidates per token, got {indices.shape[1]}"
    gathered = t * indices.shape[1] * d * q.element_size()
    if gathered > INDEXER_MAX_GATHER_BYTES:
        return f"the gathered candidate keys would take {gathered >> 20} MiB (more than {INDEXER_MAX_GATHER_BYTES >> 20} MiB)"
    return None


def indexer_scores(
    tn: ModuleType, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """``Kernels.indexer_scores`` through ``torch_npu.npu_lightning_indexer(query, key, weights, *,
    actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
    layout_query='BSND', layout_key='BSND', sparse_count=2048, sparse_mode=3,
    pre_tokens=2**63-1, next_tokens=2**63-1, return_value=False) -> (Tensor sparse_indices, Tensor sparse_values)``.

    The op scores ``Σ_h w_h · relu(q_h · k)`` over one key sequence per batch
    and returns the top ``sparse_count`` positions (int32, ``-1`` past the
    sequence) and, with ``return_value=True``, their scores in the query dtype.
    The gap it bridges:

    - V4 gives every token its own candidate rows, so each token is its own
      batch: ``query`` ``[T, 1, H, 128]``, ``key`` = the token's gathered rows
      ``[T, K, 1, 128]``, ``weights`` ``[T, 1, H]`` in the query dtype (Ascend
      950 takes no fp32 weights), ``sparse_mode=0`` (no causal mask);
    - the contract wants every candidate's score, the op returns a ranking:
      ``sparse_count`` covers all ``K`` candidates (``K <= 8192``), and each
      returned score is scattered back to the column its position names; V4's
      ``scale`` multiplies them in fp32 afterwards;
    - ``-1`` candidates are gathered as some row and scored, then set to
      ``-inf``, as the contract says; the gather is materialised (``T × K ×
      128``), so steps past ``INDEXER_MAX_GATHER_BYTES`` keep the Triton kernel.

    The contract's ``topk_select`` stays a separate op, so the op's own top-k is
    not what V4 uses here. Sources: op-plugin
    ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_lightning_indexer.md`` (D 128,
    N2 1, 950: N1 8/16/24/32/64 and no fp32 weights, sparse_count values,
    return_value in graph mode on 950 only) and
    ``test/test_custom_ops/test_npu_lightning_indexer.py`` (the golden: indices
    relative to each batch's keys, sorted by descending score, ``-1`` after them).
    """
    _need(indexer_scores_fits(tn, q, weights, keys, indices))
    t, h, d = q.shape
    k = indices.shape[1]
    count = lightning_sparse_count(k)
    rows = take_rows(keys, indices).contiguous().view(t, k, 1, d)
    picked, values = tn.npu_lightning_indexer(
        q.contiguous().view(t, 1, h, d), rows, weights.to(q.dtype).contiguous().view(t, 1, h),
        layout_query="BSND", layout_key="BSND", sparse_count=count, sparse_mode=0, return_value=True,
    )
    picked = picked.reshape(t, count).to(torch.int64)
    column = torch.where((picked >= 0) & (picked < k), picked, torch.full_like(picked, k))
    scores = torch.full((t, k + 1), float("-inf"), dtype=torch.float32, device=q.device)
    scores.scatter_(1, column, values.reshape(t, count).float() * scale)
    return scores[:, :k].masked_fill(indices < 0, float("-inf"))


# ---- mHC --------------------------------------------------------------------------------------


def _mhc_shape_reason(x: torch.Tensor, what: str) -> str | None:
    n, d = x.shape[1], x.shape[2]
    if x.dtype not in _HALF:
        return f"{what} takes fp16/bf16 streams, not {x.dtype}"
    if n not in MHC_STREAMS:
        return f"{what} takes {sorted(MHC_STREAMS)} streams, got {n}"
    if x.shape[0] == 0:
        return f"{what} takes no empty tensors"
    if not (1 <= d <= MHC_MAX_DIM and d % 16 == 0):
        return f"{what} needs a channel count that is a multiple of 16 up to {MHC_MAX_DIM}, got {d}"
    return None


def mhc_pre_fits(
    tn: ModuleType, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int
) -> str | None:
    """Why ``npu_mhc_pre`` + ``npu_mhc_sinkhorn`` cannot take these inputs here, or None."""
    reason = _soc_reason(tn, x.device, MHC_GENERATIONS, "npu_mhc_pre") or _mhc_shape_reason(x, "npu_mhc_pre")
    if reason is not None:
        return reason
    n, d = x.shape[1], x.shape[2]
    if fn.shape != ((2 + n) * n, n * d) or base.shape != ((2 + n) * n,) or scale.shape != (3,):
        got = f"{tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}"
        return f"npu_mhc_pre takes phi ((n+2)n, nD), bias ((n+2)n) and alpha (3), got {got}"
    if not 1 <= sinkhorn_iters <= MHC_MAX_ITERS:
        return f"npu_mhc_sinkhorn runs 1 to {MHC_MAX_ITERS} iterations, not {sinkhorn_iters}"
    return None


def mhc_pre(
    tn: ModuleType,
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Kernels.mhc_pre`` through ``torch_npu.npu_mhc_pre(x, phi, alpha, bias, *, gamma=None,
    norm_eps=1e-6, hc_eps=1e-6, out_flag=0, inner_precise=0) -> (h_in, h_post, h_res, inv_rms,
    h_mix, h_pre)`` and ``torch_npu.npu_mhc_sinkhorn(x, *, eps=1e-6, num_iters=20, out_flag=0)
    -> (y, norm_out, sum_out)``.

    ``npu_mhc_pre`` is V4's pre-gate up to the Sinkhorn step: RMS norm of the
    flattened ``nD`` streams (``gamma=None``: no weight, as V4), ``phi`` in
    V4's order (pre ``n``, post ``n``, res ``n²`` rows), ``alpha`` = V4's
    ``scale``, ``bias`` = V4's ``base``, ``hc_eps`` after the pre sigmoid; it
    returns ``h_res`` as the raw ``[T, n, n]`` logits, row-major like V4's
    ``[j, k]``. ``npu_mhc_sinkhorn`` with ``eps = hc_eps`` is V4's
    ``softmax_k + eps``, column pass, then ``num_iters − 1`` row/column passes.
    The gap: argument order and dtypes only (``phi``/``alpha``/``bias`` fp32,
    ``h_post`` reshaped to ``[T, n]``, the op reference's ``(T, D)`` being a
    typo its golden contradicts).

    Sources: op-plugin ``docs/en/custom_APIs/torch_npu/torch_npu-npu_mhc_pre.md`` and
    ``torch_npu-npu_mhc_sinkhorn.md`` (branch 26.1.0: Ascend 950 only, n 4/6/8,
    D a multiple of 16 up to 16384, 1-100 iterations) and the goldens
    ``test/test_custom_ops/test_npu_mhc_pre.py``, ``test_npu_mhc_sinkhorn.py``.
    """
    _need(mhc_pre_fits(tn, x, fn, base, scale, sinkhorn_iters))
    h_in, _, post, comb = _mhc_pre_sinkhorn(tn, x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, with_pre=False)
    return h_in, post, comb


def _mhc_pre_sinkhorn(
    tn: ModuleType, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    norm_eps: float, hc_eps: float, sinkhorn_iters: int, with_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(h_in, h_pre, post, comb)`` from ``npu_mhc_pre`` then ``npu_mhc_sinkhorn``; ``h_pre`` (``out_flag=1``)
    only ``with_pre``, else None."""
    t, n = x.shape[0], x.shape[1]
    out = tn.npu_mhc_pre(
        x.contiguous(), fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous(),
        norm_eps=float(norm_eps), hc_eps=float(hc_eps), out_flag=1 if with_pre else 0,
    )
    h_in, h_post, h_res = out[:3]
    comb = tn.npu_mhc_sinkhorn(h_res.float().contiguous(), eps=float(hc_eps), num_iters=int(sinkhorn_iters), out_flag=0)[0]
    pre = out[5].float().reshape(t, n) if with_pre else None
    return h_in, pre, h_post.float().reshape(t, n), comb.float().reshape(t, n, n)


def mhc_mix(
    tn: ModuleType,
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Kernels.mhc_mix`` through the same two ops as :func:`mhc_pre`, ``npu_mhc_pre`` with ``out_flag=1``.

    With ``out_flag=1`` the op also returns ``inv_rms``, ``h_mix`` and ``h_pre``
    (its sixth output): "做完sigmoid计算之后的h_pre矩阵", ``[T, n]`` fp32, which its
    formula and golden give as ``sigmoid(α_pre · u_pre + b_pre) + hc_eps``, V4.1's
    ``pre`` exactly. ``post`` and ``comb`` are :func:`mhc_pre`'s. The gap: the op
    always writes the collapse ``h_in`` too (``[T, D]``, unused here: V4.1
    collapses with the previous site's ``pre``), the price of one fused launch
    for the mix; the inputs it takes are :func:`mhc_pre_fits`'s.

    Sources: op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_mhc_pre.md``
    (``out_flag``: "为1表示全输出"; the outputs' order, ``h_pre`` last) and
    ``test/test_custom_ops/test_npu_mhc_pre.py`` (its golden returns
    ``h_pre = sigmoid(·) + hc_eps``).
    """
    _need(mhc_pre_fits(tn, x, fn, base, scale, sinkhorn_iters))
    _, pre, post, comb = _mhc_pre_sinkhorn(tn, x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, with_pre=True)
    assert pre is not None
    return pre, post, comb


def mhc_post_fits(tn: ModuleType, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> str | None:
    """Why ``npu_mhc_post`` cannot take these inputs here, or None."""
    reason = _soc_reason(tn, x.device, MHC_GENERATIONS, "npu_mhc_post") or _mhc_shape_reason(x, "npu_mhc_post")
    if reason is not None:
        return reason
    t, n, d = x.shape
    if y.dtype != x.dtype or y.shape != (t, d) or post.shape != (t, n) or comb.shape != (t, n, n):
        return f"npu_mhc_post takes h_out in x's dtype and shape (T, D), h_post (T, n), h_res (T, n, n); got {y.dtype} {tuple(y.shape)}"
    return None


def mhc_post(tn: ModuleType, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``Kernels.mhc_post`` through ``torch_npu.npu_mhc_post(x, h_res, h_out, h_post) -> Tensor``.

    ``y = h_res ᵀ-mixed x + h_out ⊗ h_post``: its golden sums ``h_res[j, k] · x[j]``
    over ``j`` (``dim=-3``), exactly V4's ``Σ_j comb[j, k] x[j]``, so ``comb`` goes
    in as it is; ``y``/``x`` in one half dtype, ``post``/``comb`` fp32, result in
    ``x``'s dtype. The op reference states no stream limit; the glue keeps to the
    family's documented 4/6/8 streams and 16-aligned channels.

    Sources: op-plugin ``docs/en/custom_APIs/torch_npu/torch_npu-npu_mhc_post.md``
    (branch 26.1.0, Ascend 950 only) and ``test/test_custom_ops/test_npu_mhc_post.py``.
    """
    _need(mhc_post_fits(tn, y, x, post, comb))
    return tn.npu_mhc_post(x.contiguous(), comb.float().contiguous(), y.contiguous(), post.float().contiguous())


# ---- hash routing ---------------------------------------------------------------------------


def hash_route_fits(
    tn: ModuleType, logits: torch.Tensor, token_ids: torch.Tensor, tid2eid: torch.Tensor, scoring: str, renormalize: bool
) -> str | None:
    """Why the hash mode of ``npu_moe_gating_top_k`` cannot route these tokens here, or None."""
    soc = _soc_reason(tn, logits.device, HASH_ROUTE_GENERATIONS, "npu_moe_gating_top_k's hash mode (aclnnMoeGatingTopKV2)")
    if soc is not None:
        return soc
    e, k = logits.shape[1], tid2eid.shape[1]
    if scoring not in HASH_NORM_TYPES:
        return f"npu_moe_gating_top_k's hash mode is used for {sorted(HASH_NORM_TYPES)} scoring, not {scoring}"
    if not renormalize:
        return "npu_moe_gating_top_k always renormalises sigmoid/sqrtsoftplus weights (renorm is ignored for norm_type 1/2)"
    if logits.dtype not in (torch.float32, *_HALF):
        return f"npu_moe_gating_top_k takes fp32/fp16/bf16 logits, not {logits.dtype}"
    if not (2 <= e <= HASH_MAX_EXPERTS and 1 <= k <= min(HASH_MAX_K, e)):
        return f"npu_moe_gating_top_k's hash mode needs 2 <= experts <= {HASH_MAX_EXPERTS} and k <= {HASH_MAX_K} (got {e}, k={k})"
    if token_ids.dtype not in (torch.int32, torch.int64) or tid2eid.dtype not in (torch.int32, torch.int64):
        return f"npu_moe_gating_top_k takes int32/int64 input_ids and tid2eid, not {token_ids.dtype}/{tid2eid.dtype}"
    return None


def hash_route(
    tn: ModuleType,
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    tid2eid: torch.Tensor,
    routed_scaling: float,
    scoring: str,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Kernels.hash_route`` through the hash mode of ``torch_npu.npu_moe_gating_top_k(x, k, *,
    bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1, group_select_mode=0,
    renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0, eps=1e-20) -> (y, expert_idx, norm_out)``.

    With ``input_ids`` and ``tid2eid`` torch_npu calls aclnnMoeGatingTopKV2,
    whose hash mode computes ``normOut`` (``norm_type`` 1 sigmoid, 2
    ``sqrt(softplus)``: V4's scoring, which the top-k mode lacks),
    ``expertIdx = tid2eid[inputIds]`` and ``y = normOut[expertIdx] /
    (Σ + eps) · routed_scaling_factor``: V4's hash routing with renormalisation,
    ``eps = 1e-20`` as the contract. The gap: fp32 logits in (so ``y`` is fp32),
    int32 ids out (widened to int64); one group (``group_count = k_group = 1``,
    the simplified path hash mode requires); no bias (no choice is made).

    SoCs: Ascend 950, A3 and A2, where aclnnMoeGatingTopKV2 is documented.
    Sources: op-plugin ``op_plugin/ops/opapi/MoeGatingTopKKernelNpuOpApi.cpp`` (hash
    mode → aclnnMoeGatingTopKV2), ops-transformer
    ``moe/moe_gating_top_k/docs/aclnnMoeGatingTopKV2.md`` (the formulas and limits:
    experts <= 2048, k <= 64, simplified path only); vllm-ascend's V4 router
    (``vllm_ascend/ops/fused_moe/router/fused_topk_router.py``) routes by hash
    with ``norm_type=2`` the same way.
    """
    _need(hash_route_fits(tn, logits, token_ids, tid2eid, scoring, renormalize))
    y, ids, _ = tn.npu_moe_gating_top_k(
        logits.float().contiguous(), tid2eid.shape[1], input_ids=token_ids.contiguous(), tid2eid=tid2eid,
        k_group=1, group_count=1, group_select_mode=1, renorm=0, norm_type=HASH_NORM_TYPES[scoring],
        out_flag=False, routed_scaling_factor=float(routed_scaling), eps=1e-20,
    )
    return y.float(), ids.to(torch.int64)


# ---- over per-sequence tables: indexer_topk, entry_attention -----------------------------------

#: ``npu_lightning_indexer`` without ``return_value`` (the indices only): "Ascend 950PR/Ascend 950DT √, Atlas A3 √,
#: Atlas A2 √" (ops-transformer attention/lightning_indexer/README.md)
LIGHTNING_TOPK_GENERATIONS = frozenset({"950", "a3", "a2"})
#: A2/A3: "query Q_N支持小于等于64"
INDEXER_MAX_HEADS_A2_A3 = 64
#: the most table entries (T × N, int32) ``entry_attention``'s glue lists per step for ``npu_sparse_flash_attention``
#: (64 MiB of indices); a larger step (a long prefill over a long context) keeps the Triton-Ascend kernel
ENTRY_MAX_INDICES = 1 << 24


def topk_sparse_count(k: int) -> int | None:
    """The ``sparse_count`` ``indexer_topk`` asks for: room for ``2k`` picks (a margin for ties and rounding at the
    ``k``-th), at most 8192, at least ``k``; None when ``k`` itself is past 8192."""
    if lightning_sparse_count(k) is None:
        return None
    return lightning_sparse_count(max(k, min(2 * k, INDEXER_MAX_COUNT)))


def indexer_topk_fits(
    tn: ModuleType, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, k: int
) -> str | None:
    """Why ``npu_lightning_indexer`` cannot pick these tokens' top ``k`` entries here, or None."""
    gen = generation(tn, q.device)
    soc = _soc_reason(tn, q.device, LIGHTNING_TOPK_GENERATIONS, "npu_lightning_indexer")
    if soc is not None:
        return soc
    t, h, d = q.shape
    n = table.shape[1]
    if q.dtype not in _HALF or keys.dtype != q.dtype:
        return f"npu_lightning_indexer takes fp16/bf16 query and key of one dtype, not {q.dtype}/{keys.dtype}"
    if d != INDEXER_HEAD_DIM or keys.shape[-1] != INDEXER_HEAD_DIM:
        return f"npu_lightning_indexer needs a {INDEXER_HEAD_DIM}-wide index head, got {d}"
    if gen == "950" and h not in INDEXER_HEADS_950:
        return f"npu_lightning_indexer on Ascend 950 takes {sorted(INDEXER_HEADS_950)} query heads, got {h}"
    if not 1 <= h <= INDEXER_MAX_HEADS_A2_A3:
        return f"npu_lightning_indexer takes at most {INDEXER_MAX_HEADS_A2_A3} query heads, got {h}"
    if t == 0 or n == 0 or keys.shape[0] == 0 or lightning_sparse_count(k) is None:
        return f"npu_lightning_indexer picks 1 to {INDEXER_MAX_COUNT} of a non-empty key sequence, got k={k} of {n}"
    gathered = t * n * d * q.element_size()
    if gathered > INDEXER_MAX_GATHER_BYTES:
        return f"each token's gathered entry keys would take {gathered >> 20} MiB (more than {INDEXER_MAX_GATHER_BYTES >> 20} MiB)"
    return None


def valid_first_entries(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(entries, counts)``: ``entries [B, N]`` each sequence's entry numbers whose table row is ``>= 0``, in order,
    then ``N``; ``counts [B, N + 1]`` how many of the entries ``j < c`` have a row (``counts[:, c]``). No host read."""
    b, n = table.shape
    valid = table >= 0
    seen = valid.to(torch.int64).cumsum(1)
    slot = torch.where(valid, seen - 1, torch.full_like(seen, n))  # invalid entries land in the spare column n
    entries = torch.full((b, n + 1), n, dtype=torch.int64, device=table.device)
    entries.scatter_(1, slot, torch.arange(n, device=table.device).expand(b, n).contiguous())
    entries[:, n] = n
    counts = torch.cat([seen.new_zeros(b, 1), seen], dim=1)
    return entries[:, :n], counts


def indexer_topk(
    tn: ModuleType, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
    token_seq: torch.Tensor, visible: torch.Tensor, scale: float, k: int,
) -> torch.Tensor:
    """``Kernels.indexer_topk`` through ``torch_npu.npu_lightning_indexer(query, key, weights, *,
    actual_seq_lengths_query=None, actual_seq_lengths_key=None, block_table=None,
    layout_query='BSND', layout_key='BSND', sparse_count=2048, sparse_mode=3,
    pre_tokens=2**63-1, next_tokens=2**63-1, return_value=False) -> (Tensor sparse_indices, Tensor sparse_values)``.

    The op ranks ``Σ_h w_h · relu(q_h · k)`` over one key sequence per batch and returns the top
    ``sparse_count`` positions (int32, ``-1`` past the sequence's ``actual_seq_lengths_key``). The gap:

    - paging: ``layout_key='PA_BSND'`` with ``block_table`` would read V4's pool in place, but its
      ``block_size`` must be a multiple of 16 (at most 1024) and V4's table names one pool row per
      entry (block size 1), so the paged form does not fit. Instead each token is its own batch
      (``query [T, 1, H, 128]``, ``weights [T, 1, H]``) over its sequence's rows gathered in BSND,
      ``key [T, N, 1, 128]``: that gather grows with ``N``, so the glue takes a step only while it stays
      within ``INDEXER_MAX_GATHER_BYTES`` (decode steps; longer ones keep the Triton-Ascend kernel);
    - holes: a ``-1`` row within ``visible`` is no candidate, and the op has no mask but the length.
      The rows are gathered valid-first (:func:`valid_first_entries`, no host read) and the length
      is the number of rows among the entries ``j < visible``, ``actual_seq_lengths_key`` (int32); a
      position the op returns is mapped back to its entry number;
    - ``sparse_mode=0`` (no causal mask: ``visible`` says what each token sees);
    - ties and rounding: the op's order among equal (and, on 950 with 16-bit weights, rounded) scores
      is not documented. ``sparse_count`` asks for up to ``2k`` (:func:`topk_sparse_count`), those picks
      are rescored in fp32 from their keys and sorted by the contract (higher score first, equal scores
      by the lower entry), and the first ``k`` kept: exact unless more than ``k`` entries tie with the
      ``k``-th across the op's cut;
    - weights: fp32 on A2/A3, the query dtype on 950 ("weights不支持float32类型").

    Sources: ops-transformer ``attention/lightning_indexer/README.md`` (950/A3/A2; PA_BSND block_size a
    multiple of 16 up to 1024; K_N 1, D 128; 950: Q_N 8/16/24/32/64, no fp32 weights; A2/A3: Q_N <= 64;
    ``actual_seq_lengths_key`` per batch, 0 allowed) and op-plugin ``docs/zh/custom_APIs/torch_npu/
    torch_npu-npu_lightning_indexer.md``; the golden op-plugin ``test/test_custom_ops/test_npu_lightning_indexer.py``
    (indices relative to each batch's keys, descending, ``-1`` past the length).
    """
    _need(indexer_topk_fits(tn, q, weights, keys, table, k))
    t, h, d = q.shape
    n = table.shape[1]
    count = topk_sparse_count(k)
    seq = token_seq.to(torch.int64)
    entries, counts = valid_first_entries(table)
    vis = visible.to(torch.int64).clamp(0, n)
    lengths = counts[seq, vis]  # [T]: rows among each token's visible entries
    order = entries.clamp(max=n - 1)
    rows = table.gather(1, order).clamp(min=0)  # [B, N]: pool rows, valid ones first (the rest: some row, past the length)
    key = keys[rows.index_select(0, seq)].contiguous().view(t, n, 1, d)
    w = weights.to(torch.float32 if generation(tn, q.device) != "950" else q.dtype).contiguous().view(t, 1, h)
    picked, _ = tn.npu_lightning_indexer(
        q.contiguous().view(t, 1, h, d), key, w, actual_seq_lengths_key=lengths.to(torch.int32).contiguous(),
        layout_query="BSND", layout_key="BSND", sparse_count=count, sparse_mode=0,
    )
    pos = picked.reshape(t, count).to(torch.int64)
    ok = (pos >= 0) & (pos < lengths[:, None])
    j = torch.where(ok, entries[seq[:, None], pos.clamp(0, n - 1)], torch.full_like(pos, -1))
    # rescore the picks in fp32 and order them by the contract: score descending, equal scores by the lower entry
    pick_rows = torch.where(ok, table[seq[:, None], j.clamp(min=0)], torch.zeros_like(j)).clamp(min=0)
    dots = torch.relu(torch.einsum("thd,tkd->thk", q.float(), keys[pick_rows].float()))
    score = (torch.einsum("thk,th->tk", dots, weights.float()) * scale).masked_fill(~ok, float("-inf"))
    by_entry = torch.sort(torch.where(ok, j, torch.full_like(j, n)), dim=1, stable=True).indices
    score, j = score.gather(1, by_entry), j.gather(1, by_entry)
    by_score = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k]
    return j.gather(1, by_score)


def entry_attention_fits(
    tn: ModuleType, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, table: torch.Tensor, sinks: torch.Tensor
) -> str | None:
    """Why ``npu_sparse_flash_attention`` cannot attend over these rows and table entries here, or None."""
    reason = sparse_attention_fits(tn, q, kv, indices[:, :1] if indices.shape[1] else indices.new_zeros(q.shape[0], 1), sinks)
    if reason is not None:
        return reason
    listed = q.shape[0] * (indices.shape[1] + table.shape[1])
    if indices.shape[1] + table.shape[1] == 0:
        return "npu_sparse_flash_attention takes no empty sparse_indices"
    if listed > ENTRY_MAX_INDICES:
        return f"listing every token's entries would take {listed} indices (more than {ENTRY_MAX_INDICES})"
    return None


def entry_attention(
    tn: ModuleType, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, table: torch.Tensor,
    token_seq: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float,
) -> torch.Tensor:
    """``Kernels.entry_attention`` through :func:`sparse_attention` (``npu_sparse_flash_attention`` with sinks).

    The op reads its ``sparse_indices`` as rows of the pool (``sparse_block_size=1``, the only size
    Ascend 950 takes), so V4's table needs no paging: each token's row list is its listed rows followed
    by ``table[token_seq[t], j]`` for ``j < visible[t]`` (``-1`` elsewhere), ``[T, K + N]`` int32, built on
    the device, packed valid-first and attended over as ``sparse_attention`` does. The list grows with
    ``N`` (4 bytes per entry per token, against the ``N × 512`` values the op reads), so the glue takes a step
    only while it stays within ``ENTRY_MAX_INDICES``. Sinks are 950-only ("参数sinks仅支持Ascend 950PR/Ascend
    950DT"), so A2/A3 keep the Triton-Ascend kernel.

    Sources: as :func:`sparse_attention` (ops-transformer ``aclnnSparseFlashAttentionV2.md``: no limit on
    ``sparse_size`` but "> 0", valid indices first; 950: N1 1-128, sparse_block_size 1).
    """
    _need(entry_attention_fits(tn, q, kv, indices, table, sinks))
    n = table.shape[1]
    seq = token_seq.to(torch.int64)
    mine = table.index_select(0, seq)
    seen = torch.arange(n, device=table.device)[None, :] < visible.to(torch.int64)[:, None]
    rows = torch.cat([indices.to(torch.int64), torch.where(seen, mine, torch.full_like(mine, -1))], dim=1)
    return sparse_attention(tn, q, kv, rows, sinks, scale)

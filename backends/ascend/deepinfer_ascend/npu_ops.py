"""DeepSeek-V4 ops mapped onto torch_npu fused ops.

Each function takes the imported ``torch_npu`` module and NPU tensors, and
states next to the call the torch_npu signature it relies on (from the
Ascend Extension for PyTorch op reference) and the semantic gap it bridges.
A function raises ``NotSupportedError`` for inputs its fused op does not
accept; the kernel set then runs the reference (or reports not_supported
under conformance).

The V4-specific fused ops (sparse attention with sinks, the lightning
indexer, mHC, hash routing) have their glue in ``npu_v4_ops``.

Ops deliberately left to the reference on the NPU, and why:

- ``sparse_attention`` on A2/A3: ``npu_sparse_flash_attention`` takes
  ``sinks`` on Ascend 950 only, and its softmax LSE output (to fold the sink in
  afterwards) is documented for training only; ``npu_fused_infer_attention_score``
  cannot express V4's per-token gathered rows.
- ``moe_route`` with ``sqrtsoftplus`` or ``softmax`` scoring:
  ``npu_moe_gating_top_k``'s top-k mode (aclnnMoeGatingTopK) documents
  ``norm_type`` 0/1 only (softmax is unsupported on Ascend 950 and older CANN),
  and adding the bias after a different nonlinearity changes which experts win.
  ``sqrt(softplus)`` (``norm_type=2``) exists only in aclnnMoeGatingTopKV2,
  which torch_npu calls in hash mode alone (see ``npu_v4_ops.hash_route``).
- ``npu_interleave_rope`` is not used for RoPE: it de-interleaves its output
  into rotate-half layout and requires a 64-wide bf16/fp16 head, while V4
  keeps the interleaved layout in place.
- ``npu_moe_init_routing_v2`` permutes the expert rows on A2/A3 only, the SoCs
  its torch_npu reference documents; elsewhere one stable sort in torch gives
  the same grouping (see :func:`expert_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer_interfaces import NotSupportedError
from deepinfer_interfaces.kernels.moe import router_scores

from .device import cached_soc

_FLOAT = (torch.float32, torch.float16, torch.bfloat16)

#: SoC generations torch_npu documents ``npu_clipped_swiglu`` for ("支持的型号: Atlas A2 推理系列产品
#: Atlas A3 推理系列产品" in torch_npu 2.13.0's op reference); Ascend 950 raises a RuntimeError
CLIPPED_SWIGLU_GENERATIONS = frozenset({"a2", "a3"})

#: SoC generations torch_npu 2.13.0's op reference documents ``npu_moe_init_routing_v2`` for ("Supported
#: Products: Atlas A3 ..., Atlas A2 ..., Atlas inference products"; Ascend 950 is not listed)
INIT_ROUTING_GENERATIONS = frozenset({"a2", "a3"})
#: "expert_num ... In other modes, the value range is [0, 10240]"
INIT_ROUTING_MAX_EXPERTS = 10240


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise NotSupportedError(what)


def rms_norm(tn: ModuleType, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``torch_npu.npu_rms_norm(input, gamma, epsilon=1e-06) -> (Tensor y, Tensor rstd)``.

    ``y = x / sqrt(mean(x²) + eps) · gamma`` in the dtype of ``x``; A2/A3 accept
    an fp32 ``gamma`` with fp16/bf16 ``x`` (V4 keeps norm weights in fp32), so
    the weight is not rounded first. No weight (the per-head q norm) is a gamma
    of ones.
    """
    _need(x.dtype in _FLOAT, f"npu_rms_norm takes fp32/fp16/bf16, not {x.dtype}")
    d = x.shape[-1]
    if weight is None:
        gamma = torch.ones(d, dtype=x.dtype, device=x.device)
    elif weight.dtype in (x.dtype, torch.float32):
        gamma = weight
    else:
        gamma = weight.float()
    return tn.npu_rms_norm(x, gamma, epsilon=float(eps))[0]


def rope(tn: ModuleType, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half', rotate=None) -> Tensor``
    with ``rotary_mode='interleave'``: ``out = x·r1 + rotate(x)·r2`` where
    ``rotate`` maps each pair ``(x0, x1)`` to ``(−x1, x0)``.

    That is our pair rotation once ``cos``/``sin`` (one angle per pair) are
    repeated to one value per channel. The op rotates the whole last dim, so
    only the trailing rope slice goes in (TND layout, ``r1``/``r2`` as T1D) and
    the pass-through channels are concatenated back. Inverse rotation negates
    ``sin``. Constraints: last dim < 896 and even, tokens·heads < 1000 per
    layout row, ``|cos|, |sin| <= 1``.
    """
    _need(x.dtype in _FLOAT, f"npu_rotary_mul takes fp32/fp16/bf16, not {x.dtype}")
    half = cos.shape[-1]
    width = 2 * half
    _need(width < 896, f"npu_rotary_mul needs a rope width below 896, got {width}")
    x3 = x if x.dim() == 3 else x[:, None, :]
    _need(x3.shape[1] < 1000, f"npu_rotary_mul takes fewer than 1000 heads, got {x3.shape[1]}")
    rot = x3[..., -width:].contiguous()
    c = cos.to(x.dtype).repeat_interleave(2, dim=-1)[:, None, :].contiguous()
    s = sin.to(x.dtype).repeat_interleave(2, dim=-1)[:, None, :]
    s = (-s if inverse else s).contiguous()
    try:
        out = tn.npu_rotary_mul(rot, c, s, rotary_mode="interleave")
    except TypeError as exc:  # torch_npu releases before rotary_mode existed
        raise NotSupportedError(f"this torch_npu's npu_rotary_mul has no rotary_mode='interleave' ({exc})") from exc
    full = torch.cat([x3[..., : x3.shape[-1] - width], out], dim=-1)
    return full.view(x.shape)


def moe_route_sigmoid(
    tn: ModuleType, logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling: float, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert choice by ``torch_npu.npu_moe_gating_top_k(x, k, *, bias=None, input_ids=None,
    tid2eid=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
    out_flag=False, routed_scaling_factor=1.0, eps=1e-20) -> (y, expert_idx int32, norm_out)``.

    With ``norm_type=1`` it picks the top-k of ``sigmoid(x) + bias``: our choice
    for sigmoid scoring. Its ``y`` is the *biased* score renormalised, whereas
    our weights are the unbiased scores, so only the ids are taken and the
    weights are recomputed from them (a [T, k] gather). One group
    (``group_count=1, k_group=1``) means no group limiting;
    ``group_select_mode=1`` is the only mode Ascend 950 accepts and is moot with
    one group. The op does not promise an order among the k ids or an order of
    ties, so they are re-sorted by biased score, ties by expert id.
    Constraints: 2 < experts <= 2048, k <= experts.
    """
    t, e = logits.shape
    _need(2 < e <= 2048 and 1 <= top_k <= e, f"npu_moe_gating_top_k needs 2 < experts <= 2048 and k <= experts (got {e}, k={top_k})")
    z = logits.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    _, ids32, _ = tn.npu_moe_gating_top_k(
        z, top_k, bias=b, k_group=1, group_count=1, group_select_mode=1, renorm=0, norm_type=1,
        out_flag=False, routed_scaling_factor=1.0, eps=1e-20,
    )
    scores = router_scores(z, "sigmoid")
    choice = scores if b is None else scores + b
    ids = ids32.to(torch.int64).sort(dim=-1).values
    order = torch.sort(choice.gather(1, ids), dim=-1, descending=True, stable=True).indices
    ids = ids.gather(1, order)
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling, ids


def swiglu_packed(tn: ModuleType, h: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Clamped SwiGLU of ``h = [gate | up]`` along the last dim.

    With a limit: ``torch_npu.npu_clipped_swiglu(x, *, group_index=None, dim=-1,
    alpha=1.702, limit=7.0, bias=1.0, interleaved=True) -> Tensor`` computes
    ``A.clamp(max=limit) · sigmoid(alpha·A') · (B.clamp(−limit, limit) + bias)``;
    ``alpha=1, bias=0, interleaved=False`` (front/back halves) is exactly V4's
    ``silu(min(gate, limit)) · clamp(up, −limit, limit)``. The op is documented
    for Atlas A2/A3 only, so it runs only where :func:`clipped_swiglu_fits`.
    Without a limit, on Ascend 950 (or an unknown SoC), or on a torch_npu without
    ``npu_clipped_swiglu``: the clamps in torch, then
    ``torch_npu.npu_swiglu(input, dim=-1) -> Tensor`` (``silu(A) · B``, no clamp).
    """
    h = h.contiguous()
    if limit is not None and clipped_swiglu_fits(tn, h.device):
        return tn.npu_clipped_swiglu(h, dim=-1, alpha=1.0, limit=float(limit), bias=0.0, interleaved=False)
    if limit is not None:
        i = h.shape[-1] // 2
        h = torch.cat([h[..., :i].clamp(max=limit), h[..., i:].clamp(min=-limit, max=limit)], dim=-1)
    return tn.npu_swiglu(h, dim=-1)


def clipped_swiglu_fits(tn: ModuleType, device: torch.device) -> bool:
    """Whether ``tn`` has ``npu_clipped_swiglu`` and torch_npu documents it for the SoC of ``device``
    (A2/A3, generation per ``device.detect_soc``; a ``tn`` without ``npu``: SoC unknown, so no)."""
    npu = getattr(tn, "npu", None)
    if npu is None or not hasattr(tn, "npu_clipped_swiglu"):
        return False
    return cached_soc(npu, device.index or 0).generation in CLIPPED_SWIGLU_GENERATIONS


def swiglu(tn: ModuleType, gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``Kernels.swiglu`` through :func:`swiglu_packed` on ``[gate | up]``."""
    _need(gate.dtype in _FLOAT, f"npu_swiglu takes fp32/fp16/bf16, not {gate.dtype}")
    return swiglu_packed(tn, torch.cat([gate, up.to(gate.dtype)], dim=-1), limit)


def _grouped_matmul(tn: ModuleType, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of group e] = x[rows of group e] @ w[e]ᵀ`` for ``w`` ``[E, N, K]``.

    ``torch_npu.npu_grouped_matmul(x, weight, *, bias=None, ..., group_list=None,
    split_item=0, group_type=None, group_list_type=0, act_type=0,
    output_dtype=None, tuning_config=None) -> List[Tensor]`` in its
    single-tensor form: ``x`` ``[M, K]``, ``weight`` one ``[E, K, N]`` tensor
    (a transposed view is accepted), ``group_type=0`` (groups along M),
    ``group_list`` int64 per-group row counts with ``group_list_type=1``,
    ``split_item=2`` (one output tensor ``[M, N]``). At most 1024 groups.
    """
    return tn.npu_grouped_matmul(
        [x], [w.transpose(1, 2)], group_list=counts, group_type=0, group_list_type=1, split_item=2
    )[0]


@dataclass(frozen=True)
class ExpertRows:
    """The (token, slot) pairs with a local expert, grouped by expert: what the grouped matmuls read."""

    #: ``[rows, D]`` the token features, in expert order
    x: torch.Tensor
    #: ``[rows]`` int64 ``token · k + slot`` of each row (weights and the scatter back read it)
    source: torch.Tensor
    #: ``[E]`` int64 rows per expert (``group_list`` in count mode)
    counts: torch.Tensor


def init_routing_fits(tn: ModuleType, x: torch.Tensor, num_experts: int) -> bool:
    """Whether ``npu_moe_init_routing_v2`` permutes ``x``'s rows here: ``tn`` has it, the SoC is one its
    reference documents (A2/A3), and the experts are within its limit."""
    npu = getattr(tn, "npu", None)
    if npu is None or not hasattr(tn, "npu_moe_init_routing_v2") or num_experts > INIT_ROUTING_MAX_EXPERTS:
        return False
    return cached_soc(npu, x.device.index or 0).generation in INIT_ROUTING_GENERATIONS


def _init_routing_rows(
    tn: ModuleType, x: torch.Tensor, topk_ids: torch.Tensor, valid: torch.Tensor, rows: int, num_experts: int
) -> ExpertRows:
    """The rows by ``torch_npu.npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None,
    active_num=-1, expert_capacity=-1, expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
    expert_tokens_num_flag=False, quant_mode=-1, active_expert_range=[], row_idx_type=0,
    x_dtype=None) -> (expanded_x, expanded_row_idx, expert_token_cumsum_or_count, expanded_scale)``.

    Dropless (``drop_pad_mode=0``), unquantised (``quant_mode=-1``), count mode
    (``expert_tokens_num_type=1``: ``[E]`` int64 rows per expert), scatter indices
    (``row_idx_type=1``: ``expanded_row_idx[i]`` is the flattened ``token · k +
    slot`` of row ``i`` and ``expanded_x[i] = x[expanded_row_idx[i] // k]``).
    The gap: V4 skips ``-1`` and ids of other ranks' experts, the op takes ids
    ``<= expert_num`` and counts only those in ``active_expert_range``; skipped
    ids become ``E`` with the range ``[0, E)``, so the first ``rows`` (the
    "available_idx_num") outputs are exactly the contract's pairs and the rest
    are never read. The op does not promise an order within an expert; nothing
    here needs one. Source: op-plugin
    ``docs/en/custom_APIs/torch_npu/torch_npu-npu_moe_init_routing_v2.md`` (branch 26.1.0).
    """
    t, k = topk_ids.shape
    ids = torch.where(valid.view(t, k), topk_ids, torch.full_like(topk_ids, num_experts)).to(torch.int32).contiguous()
    expanded_x, expanded_row_idx, counts, _ = tn.npu_moe_init_routing_v2(
        x.contiguous(), ids, expert_num=num_experts, drop_pad_mode=0, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, num_experts], row_idx_type=1,
    )
    return ExpertRows(expanded_x[:rows], expanded_row_idx[:rows].to(torch.int64), counts.to(torch.int64))


def expert_rows(tn: ModuleType, x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> ExpertRows | None:
    """The (token, slot) pairs with an expert in ``[0, E)``, grouped by expert; None when there are none.

    ``npu_moe_init_routing_v2`` where :func:`init_routing_fits`, else one stable
    sort in torch (skipped pairs sort after every expert)."""
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    rows = int(valid.sum())
    if rows == 0:
        return None
    if init_routing_fits(tn, x, num_experts):
        return _init_routing_rows(tn, x, topk_ids, valid, rows, num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))
    source = torch.sort(key, stable=True).indices[:rows]
    counts = torch.bincount(flat[valid], minlength=num_experts).to(torch.int64)
    return ExpertRows(x[source // topk_ids.shape[1]].contiguous(), source, counts)


def moe_experts(
    tn: ModuleType,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float | None,
) -> torch.Tensor:
    """Grouped clamped-SwiGLU experts: the (token, slot) rows grouped by expert
    (``-1`` and out-of-range ids dropped; :func:`expert_rows`), two grouped
    matmuls and the clamped SwiGLU run per group, and the weighted rows are
    summed back per token in fp32."""
    num_experts = w13.shape[0]
    _need(x.dtype in _FLOAT and w13.dtype == x.dtype and w2.dtype == x.dtype,
          f"npu_grouped_matmul needs x, w13 and w2 in one of fp32/fp16/bf16 (got {x.dtype}, {w13.dtype}, {w2.dtype})")
    _need(2 <= num_experts <= 1024, f"npu_grouped_matmul takes 2 to 1024 groups, got {num_experts} experts")
    t, d = x.shape
    k = topk_ids.shape[1]
    out = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    rows = expert_rows(tn, x, topk_ids, num_experts)
    if rows is None:
        return out.to(x.dtype)
    h = _grouped_matmul(tn, rows.x, w13, rows.counts)
    act = swiglu_packed(tn, h, limit)
    y = _grouped_matmul(tn, act.contiguous(), w2, rows.counts)
    w = topk_weights.reshape(-1)[rows.source].float()
    out.index_add_(0, rows.source // k, y.float() * w[:, None])
    return out.to(x.dtype)


#: ``npu_fusion_attention``'s limits (torch_npu op reference: "D ... a multiple of 16, with the max value of 512",
#: "N1 ... 1 to 256"; query/key/value FLOAT16, BFLOAT16, FLOAT32)
FUSION_ATTENTION_MAX_DIM = 512
FUSION_ATTENTION_MAX_HEADS = 256
#: "no band": the op's default pre/next token counts, every key of a sequence visible to each of its queries
_ALL_TOKENS = 2147483647


def vit_attention(
    tn: ModuleType, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The vision tower's attention as ``npu_fusion_attention`` in its ``TND`` layout.

    ``npu_fusion_attention(query, key, value, head_num, input_layout, ..., scale, ..., pre_tockens, next_tockens,
    ..., actual_seq_qlen, actual_seq_kvlen, sparse_mode, ...) -> (attention_out, softmax_max, softmax_sum,
    softmax_out, seed, offset, numels)``: with ``input_layout="TND"`` the batch is one ``[T, N, D]`` tensor and
    ``actual_seq_qlen`` / ``actual_seq_kvlen`` are the cumulative ends of its sequences (host ints), each query
    attending within its own sequence; ``sparse_mode=0`` without ``atten_mask`` and the full pre/next token
    counts mask nothing (bidirectional). Both lists are the images' ends, ``cu_seqlens[1:]`` read on the host
    (a synchronisation when the boundaries live on the NPU; the ViT pass runs eagerly), an empty image's
    repeated end left out.
    """
    t, h, d = q.shape
    _need(q.dtype in _FLOAT and k.dtype == q.dtype and v.dtype == q.dtype, f"npu_fusion_attention takes fp16/bf16/fp32 q, k, v of one dtype, not {q.dtype}")
    _need(d % 16 == 0 and d <= FUSION_ATTENTION_MAX_DIM, f"npu_fusion_attention takes a head dim that is a multiple of 16 up to {FUSION_ATTENTION_MAX_DIM}, not {d}")
    _need(h <= FUSION_ATTENTION_MAX_HEADS, f"npu_fusion_attention takes up to {FUSION_ATTENTION_MAX_HEADS} heads, not {h}")
    ends: list[int] = []
    for end in cu_seqlens[1:].tolist():
        if int(end) > (ends[-1] if ends else 0):
            ends.append(int(end))
    out = tn.npu_fusion_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), h, "TND", scale=scale, pre_tockens=_ALL_TOKENS,
        next_tockens=_ALL_TOKENS, actual_seq_qlen=ends, actual_seq_kvlen=ends, sparse_mode=0,
    )[0]
    return out.view(t, h, d)

"""MoE dispatch/combine through torch_npu's fused MC2 ops (``npu_moe_distribute_dispatch`` / ``_combine``).

The fused ops move one row per (token, chosen expert), grouped by local expert,
and apply the routing weights inside ``combine``. The Communicator contract's
``dispatch`` instead delivers one row per (token, rank) carrying that rank's
slots and weights. Their bookkeeping outputs (``expand_idx``,
``ep_recv_counts``) are documented as opaque and version dependent, so the
contract's layout cannot be rebuilt from them. The fused path therefore
delivers the *expanded* layout: each received row has its local expert id in
slot 0 (``-1`` elsewhere) and weight 1, and ``combine`` applies the real
weights. ``moe_experts`` followed by ``combine`` computes the same sums as with
the contract's layout, but the conformance comm suite's row-by-row check of
``dispatch`` does not hold, so the path is opt-in
(``DEEPINFER_ASCEND_FUSED_DISPATCH=1``, identical on every rank).

It engages only when every rank meets the ops' documented limits (checked
locally, agreed with one all-reduce): SoC A2 or A3 (the ops are not offered
on Ascend 950), EP world size in the supported set, bf16/fp16 hidden states
(A2: hidden <= 7168 and a multiple of 32; A3: exactly 7168), 0 < tokens <=
256 (A2) / 512 (A3), k <= 16 (A2) / 8 (A3), at most 512 experts placed in
contiguous equal blocks per rank (A2: at most 24 per rank), and every slot a
valid, distinct expert, and at most the tokens its buffer was planned for.
Otherwise the base all-to-all path runs.

The ops exchange data through their HCCL communicator's window, whose size
CANN documents per generation (``hccl_buffer_mb``); the 200 MB default holds
far less than a V4 decode batch. The dedicated group is created with that
size in its ``hccl_config`` (a per-communicator setting that takes precedence
over ``HCCL_BUFFSIZE``), planned for ``DEEPINFER_ASCEND_FUSED_MAX_TOKENS``
tokens per rank (default: the op's documented most). On A2 the dispatch takes
the routing weights and ``combine`` gets back the ``expand_scales`` it returns,
as CANN requires there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from deepinfer_interfaces import DispatchHandle

FUSED_ENV = "DEEPINFER_ASCEND_FUSED_DISPATCH"
#: tokens per rank the fused ops' communication window is planned for (default: the op's documented most)
MAX_TOKENS_ENV = "DEEPINFER_ASCEND_FUSED_MAX_TOKENS"
MB = 1 << 20

#: documented limits of npu_moe_distribute_dispatch/combine per SoC generation
LIMITS: dict[str, dict] = {
    "a2": {"worlds": {16, 32, 64}, "max_tokens": 256, "max_k": 16, "max_local": 24},
    "a3": {"worlds": {8, 16, 32, 64, 128, 144, 256, 288}, "max_tokens": 512, "max_k": 8, "max_local": None},
}
MAX_EXPERTS = 512


def fused_requested() -> bool:
    return os.environ.get(FUSED_ENV) == "1"


def planned_tokens(gen: str) -> int:
    """Tokens per rank the fused path serves on ``gen``: ``DEEPINFER_ASCEND_FUSED_MAX_TOKENS`` within the op's limit."""
    most = LIMITS[gen]["max_tokens"] if gen in LIMITS else 0
    raw = os.environ.get(MAX_TOKENS_ENV)
    if not raw:
        return most
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_TOKENS_ENV}={raw!r} is not an integer; give the most tokens per rank a fused dispatch carries") from None
    if not 0 < value <= most:
        raise ValueError(f"{MAX_TOKENS_ENV}={value} is outside (0, {most}], the fused dispatch's documented range on {gen}")
    return value


def _align(x: int, n: int) -> int:
    return -(-x // n) * n


def hccl_buffer_mb(gen: str, max_tokens: int, world: int, experts: int, k: int, hidden: int, shared_experts: int = 0) -> int:
    """The communication window (MB) ``npu_moe_distribute_dispatch``/``_combine`` need, as CANN documents it for
    bf16/fp16 tokens without quantisation:

    - A2 (full-mesh): ``2 · (BS · ep · min(local experts, K) · H · 2 B + 2 MB)``;
    - A3: ``2 · (local experts · BS · ep · Align512(Align32(2H) + 64) + (K + shared) · BS · Align512(2H))``
      (some CANN releases write 44 for the 64; the larger is kept).
    """
    local = experts // world
    if gen == "a2":
        need = 2 * (max_tokens * world * min(local, k) * hidden * 2 + 2 * MB)
    elif gen == "a3":
        need = 2 * (local * max_tokens * world * _align(_align(2 * hidden, 32) + 64, 512)
                    + (k + shared_experts) * max_tokens * _align(2 * hidden, 512))
    else:
        raise ValueError(f"the fused MoE dispatch has no documented window on SoC generation {gen}")
    return max(2, -(-need // MB))


def _hidden_ok(gen: str, h: int) -> bool:
    return h == 7168 if gen == "a3" else (0 < h <= 7168 and h % 32 == 0)


def local_problem(
    gen: str, world: int, hidden: torch.Tensor, topk_ids: torch.Tensor, expert_rank: torch.Tensor, expert_local: torch.Tensor
) -> str | None:
    """Why this rank's call cannot use the fused ops (None when it can)."""
    lim = LIMITS.get(gen)
    if lim is None:
        return f"npu_moe_distribute_dispatch is not offered on SoC generation {gen}"
    if world not in lim["worlds"]:
        return f"EP world size {world} is not one of {sorted(lim['worlds'])}"
    if hidden.dtype not in (torch.bfloat16, torch.float16) or hidden.dim() != 2 or not _hidden_ok(gen, hidden.shape[1]):
        return f"hidden states {tuple(hidden.shape)} {hidden.dtype} are outside the op's dtype/width limits"
    tokens, k = topk_ids.shape
    if not (0 < tokens <= lim["max_tokens"] and 0 < k <= lim["max_k"]):
        return f"{tokens} tokens with k={k} are outside 0 < tokens <= {lim['max_tokens']}, k <= {lim['max_k']}"
    if tokens > planned_tokens(gen):
        return f"{tokens} tokens exceed the {planned_tokens(gen)} the communication window is planned for ({MAX_TOKENS_ENV})"
    experts = expert_rank.shape[0]
    if experts > MAX_EXPERTS or experts % world:
        return f"{experts} experts do not split evenly over {world} ranks within {MAX_EXPERTS}"
    local = experts // world
    if lim["max_local"] is not None and local > lim["max_local"]:
        return f"{local} experts per rank exceed {lim['max_local']}"
    e = torch.arange(experts, device=expert_rank.device)
    if not (torch.equal(expert_rank.to(e.dtype), e // local) and torch.equal(expert_local.to(e.dtype), e % local)):
        return "experts are not placed in contiguous equal blocks per rank (EPLB placements need the all-to-all path)"
    if bool(((topk_ids < 0) | (topk_ids >= experts)).any()):
        return "some slots hold no valid expert id"
    ordered = topk_ids.sort(dim=-1).values
    if k > 1 and bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        return "a token chose the same expert twice"
    return None


@dataclass
class FusedDispatchHandle(DispatchHandle):
    """What ``npu_moe_distribute_combine`` needs back from the dispatch call."""

    expert_ids: torch.Tensor = field(default=None)  # type: ignore[assignment]
    expert_scales: torch.Tensor = field(default=None)  # type: ignore[assignment]
    expand_idx: torch.Tensor = field(default=None)  # type: ignore[assignment]
    ep_recv_counts: torch.Tensor = field(default=None)  # type: ignore[assignment]
    tp_recv_counts: torch.Tensor | None = None
    expand_rows: int = 0
    group_name: str = ""
    moe_expert_num: int = 0
    global_bs: int = 0
    ep_rank: int = 0
    ep_world: int = 0
    #: the per-row weights dispatch returned, which combine needs back on A2 (None elsewhere)
    expand_scales: torch.Tensor | None = None


def dispatch(
    tn, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    moe_expert_num: int, group_name: str, rank: int, world: int, global_bs: int, gen: str = "a3",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, FusedDispatchHandle]:
    """Send each (token, expert) row to the expert's rank.

    ``torch_npu.npu_moe_distribute_dispatch(Tensor x, Tensor expert_ids, str group_ep,
    int ep_world_size, int ep_rank_id, int moe_expert_num, *, scales=None,
    x_active_mask=None, expert_scales=None, group_tp="", tp_world_size=0,
    tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
    shared_expert_rank_num=0, quant_mode=0, global_bs=0,
    expert_token_nums_type=1) -> (expand_x, dynamic_scales, expand_idx,
    expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales)``:
    ``x`` ``[BS, H]``, ``expert_ids`` int32 ``[BS, K]``; ``expand_x`` ``[A, H]``
    holds the received rows grouped by local expert, ``expert_token_nums``
    (``expert_token_nums_type=1``) how many rows each local expert got.
    No quantisation, no TP domain, no shared-expert ranks. On A2 (``gen``) the routing weights go in as
    ``expert_scales`` and the ``expand_scales`` that come out are kept for ``combine``, as CANN requires there.
    """
    expert_ids = topk_ids.to(torch.int32).contiguous()
    scales = topk_weights.float().contiguous()
    a2 = gen == "a2"
    expand_x, _, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = tn.npu_moe_distribute_dispatch(
        hidden.contiguous(), expert_ids, group_name, world, rank, moe_expert_num,
        expert_scales=scales if a2 else None, quant_mode=0, global_bs=global_bs, expert_token_nums_type=1,
    )
    counts = expert_token_nums.to(torch.int64)
    received = int(counts.sum())
    local = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts)
    k = topk_ids.shape[1]
    ids = torch.full((received, k), -1, dtype=topk_ids.dtype, device=hidden.device)
    ids[:, 0] = local.to(topk_ids.dtype)
    weights = torch.zeros((received, k), dtype=topk_weights.dtype, device=hidden.device)
    weights[:, 0] = 1
    handle = FusedDispatchHandle(
        send_token_index=torch.empty(0, dtype=torch.int64, device=hidden.device),
        send_splits=[], recv_splits=[received], num_tokens=hidden.shape[0],
        expert_ids=expert_ids, expert_scales=scales, expand_idx=expand_idx,
        ep_recv_counts=ep_recv_counts, tp_recv_counts=tp_recv_counts, expand_rows=expand_x.shape[0],
        group_name=group_name, moe_expert_num=moe_expert_num, global_bs=global_bs, ep_rank=rank, ep_world=world,
        expand_scales=expand_scales if a2 else None,
    )
    return expand_x[:received], ids, weights, handle


def combine(tn, hidden: torch.Tensor, handle: FusedDispatchHandle) -> torch.Tensor:
    """Bring the expert outputs back and sum them weighted per token.

    ``torch_npu.npu_moe_distribute_combine(expand_x, expert_ids, expand_idx,
    ep_send_counts, expert_scales, group_ep, ep_world_size, ep_rank_id,
    moe_expert_num, *, tp_send_counts=None, ..., global_bs=0, ...) -> Tensor``
    returns ``[BS, H]`` with ``out[t] = Σ_k expert_scales[t, k] · row(t, k)``;
    ``ep_send_counts`` is dispatch's ``ep_recv_counts``. The rows past the
    received ones (``expand_x`` has ``A`` rows) are zero padding.
    """
    received = sum(handle.recv_splits)
    if hidden.shape[0] != received:
        raise ValueError(f"combine got {hidden.shape[0]} rows, but dispatch delivered {received}")
    padded = hidden.new_zeros((handle.expand_rows, hidden.shape[1]))
    padded[:received] = hidden
    return tn.npu_moe_distribute_combine(
        padded, handle.expert_ids, handle.expand_idx, handle.ep_recv_counts, handle.expert_scales,
        handle.group_name, handle.ep_world, handle.ep_rank, handle.moe_expert_num,
        tp_send_counts=handle.tp_recv_counts, expand_scales=handle.expand_scales, global_bs=handle.global_bs,
    )

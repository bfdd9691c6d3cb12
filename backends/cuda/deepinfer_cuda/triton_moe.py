"""MoE routing (learned top-k or hash table) and the clamped SwiGLU activation.

Routing: a program takes a tile of tokens × all experts. It scores the row
(``sqrt(softplus)``, sigmoid or softmax, in fp32), adds the load-balancing
bias and picks the top k by ``k`` rounds of argmax (the first index among
equals, so ties go in expert order like the reference's stable sort). With a
hash table the experts come from the table instead. Either way the weights
are the unbiased scores of the chosen experts, recomputed from their logits,
then renormalised and scaled, all in the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, next_power_of_2, num_warps_for, rows

#: scoring functions by the code the kernel is specialised on
SCORING_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}


@triton.jit
def _score(z, row_max, row_sum, SCORING: tl.constexpr):
    """Router score of logits ``z``; ``row_max`` / ``row_sum`` are the softmax statistics of their rows."""
    if SCORING == 0:
        # softplus(z) = max(z, 0) + log1p(exp(-|z|)); log1p(a) = log(1 + a) · a / ((1 + a) − 1) stays exact for small a
        a = tl.exp(-tl.abs(z))
        b = 1.0 + a
        exact = b == 1.0
        log1p = tl.where(exact, a, tl.log(b) * a / tl.where(exact, 1.0, b - 1.0))
        return tl.sqrt(tl.maximum(z, 0.0) + log1p)
    elif SCORING == 1:
        return tl.sigmoid(z)
    else:
        return tl.exp(z - row_max) / row_sum


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr,
    T, E, TOPK, routed_scaling, stride_l, stride_tab,
    SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    r_ok = rows < T
    row_base = logits_ptr + rows[:, None].to(tl.int64) * stride_l
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    kk = tl.arange(0, BLOCK_K)
    k_ok = kk < TOPK
    out_mask = r_ok[:, None] & k_ok[None, :]
    z = tl.load(row_base + e[None, :], mask=r_ok[:, None] & e_ok[None, :], other=float("-inf")).to(tl.float32)
    row_max = tl.max(z, axis=1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(tl.where(e_ok[None, :], tl.exp(z - row_max[:, None]), 0.0), axis=1)
    row_sum = tl.where(row_sum > 0, row_sum, 1.0)
    if HASH:
        tok = tl.load(tok_ptr + rows, mask=r_ok, other=0)
        ids = tl.load(table_ptr + tok[:, None] * stride_tab + kk[None, :], mask=out_mask, other=0).to(tl.int64)
    else:
        choice = _score(z, row_max[:, None], row_sum[:, None], SCORING)
        if HAS_BIAS:
            choice += tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(e_ok[None, :], choice, float("-inf"))
        ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int64)
        for i in range(0, TOPK):
            best = tl.argmax(choice, axis=1, tie_break_left=True)
            ids = tl.where(kk[None, :] == i, best[:, None].to(tl.int64), ids)
            choice = tl.where(e[None, :] == best[:, None], float("-inf"), choice)
    id_ok = out_mask & (ids >= 0) & (ids < E)
    # the weight of a pick is its unbiased score, recomputed from its logit
    picked = tl.load(row_base + ids, mask=id_ok, other=0.0).to(tl.float32)
    w = tl.where(id_ok, _score(picked, row_max[:, None], row_sum[:, None], SCORING), 0.0)
    if RENORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    w = w * routed_scaling
    out = rows[:, None].to(tl.int64) * TOPK + kk[None, :]
    tl.store(w_ptr + out, w, mask=out_mask)
    tl.store(ids_ptr + out, ids, mask=out_mask)


def route_tiles(experts: int, top_k: int) -> Tiles:
    """Every expert of a row at once, and as many rows (up to 16) as keep a program near 4096 logits."""
    block_e = next_power_of_2(experts)
    block_t = max(1, min(choose(4096, 64) // block_e, choose(16, 4)))
    return Tiles({"BLOCK_T": block_t, "BLOCK_E": block_e, "BLOCK_K": next_power_of_2(top_k)},
                 num_warps=num_warps_for(block_t * block_e))


def route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    routed_scaling: float,
    scoring: str,
    renormalize: bool,
    token_ids: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Kernels.moe_route`` (or, given ``token_ids`` and ``tid2eid``, ``Kernels.hash_route``) for ``T >= 1`` tokens."""
    if logits.dim() != 2:
        raise ValueError(f"moe routing: logits must be [T, E], got shape {tuple(logits.shape)}")
    tokens, experts = logits.shape
    hashed = tid2eid is not None
    if hashed:
        assert token_ids is not None
        if tid2eid.dim() != 2 or tuple(token_ids.shape) != (tokens,):
            raise ValueError(
                f"hash_route: need tid2eid [V, top_k] and token_ids [{tokens}]; got {tuple(tid2eid.shape)} and {tuple(token_ids.shape)}"
            )
        top_k = tid2eid.shape[1]
    if bias is not None and tuple(bias.shape) != (experts,):
        raise ValueError(f"moe_route: bias must be [E={experts}], got {tuple(bias.shape)}")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    dev = logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=dev)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=dev)
    tiles = route_tiles(experts, top_k)
    table = tid2eid.contiguous() if hashed else logits
    toks = token_ids.to(torch.int64).contiguous() if hashed else logits
    _route_kernel[(triton.cdiv(tokens, tiles.blocks["BLOCK_T"]),)](
        logits, logits if bias is None else bias.contiguous(), table, toks, weights, ids,
        tokens, experts, top_k, float(routed_scaling), logits.stride(0), table.stride(0) if hashed else 0,
        SCORING=SCORING_CODES[scoring], HAS_BIAS=bias is not None, HASH=hashed, RENORM=bool(renormalize), **tiles.kwargs(),
    )
    return weights, ids


@triton.jit
def _swiglu_kernel(
    gate_ptr, up_ptr, out_ptr, W, stride_g, stride_u, stride_o, limit,
    HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < W
    g = tl.load(gate_ptr + row * stride_g + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    tl.store(out_ptr + row * stride_o + c, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=ok)


def swiglu_tiles(width: int) -> Tiles:
    """Rows of ``width`` values, up to 2048 per program."""
    block = min(next_power_of_2(width), choose(2048, 32))
    return Tiles({"BLOCK": block}, num_warps=num_warps_for(block))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``Kernels.swiglu`` on the device for a non-empty ``gate``."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    width = gate.shape[-1]
    g2, u2 = rows(gate, width), rows(up, width)
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    tiles = swiglu_tiles(width)
    _swiglu_kernel[(g2.shape[0], triton.cdiv(width, tiles.blocks["BLOCK"]))](
        g2, u2, out, width, g2.stride(0), u2.stride(0), out.stride(0), 0.0 if limit is None else float(limit),
        HAS_LIMIT=limit is not None, **tiles.kwargs(),
    )
    return out.view(gate.shape)

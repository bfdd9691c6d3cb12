"""Grammar token-bitmask application, in place, on xgrammar's int32 layout.

A program covers one row and a block of tokens. It never reads the logits:
it only writes ``-inf`` where the token's bit is 0 (or the token lies beyond
the mask's words), so allowed logits cost no memory traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Tiles, choose, num_warps_for, unit_inner


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, V, W, stride_l, stride_m, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = v < V
    word = v // 32
    # lanes of one word read the same address: a broadcast, not 32 loads
    bits = tl.load(mask_ptr + row * stride_m + word, mask=in_vocab & (word < W), other=0)
    allowed = ((bits >> (v % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_l + v, neg_inf, mask=in_vocab & ~allowed)


def bitmask_tiles() -> Tiles:
    """4096 tokens per program (128 mask words); half as many warps as a dense kernel, since it only stores."""
    block = choose(4096, 32)
    return Tiles({"BLOCK": block}, num_warps=num_warps_for(block // 2))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``Kernels.apply_token_bitmask`` on the device: masks ``logits`` ``[B, V]`` in place and returns it."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"apply_token_bitmask: need logits [B, V] and bitmask [B, ceil(V/32)], got {tuple(logits.shape)} and {tuple(bitmask.shape)}"
        )
    if bitmask.dtype != torch.int32:
        raise ValueError(f"apply_token_bitmask: bitmask must be int32 (xgrammar layout), got {bitmask.dtype}")
    if logits.stride(-1) != 1:
        raise ValueError("apply_token_bitmask: logits must have unit stride along the vocab (it is masked in place)")
    bitmask = bitmask.to(logits.device, non_blocking=True)
    bitmask = unit_inner(bitmask)
    batch, vocab = logits.shape
    tiles = bitmask_tiles()
    grid = (batch, triton.cdiv(vocab, tiles.blocks["BLOCK"]))
    _apply_bitmask_kernel[grid](
        logits, bitmask, vocab, bitmask.shape[1], logits.stride(0), bitmask.stride(0), **tiles.kwargs(),
    )
    return logits

"""The fused MC2 MoE dispatch/combine glue: its HCCL window planned from CANN's formulas, the A2 scales
handed back to combine, and batches beyond the planned window refused (they take the all-to-all path).

The ops themselves need an NPU; the glue runs against a stand-in for torch_npu passed in as its ``tn``
argument, which returns what the ops document and records how they were called."""

from __future__ import annotations

import pytest
import torch

from deepinfer_ascend import fused_dispatch
from deepinfer_ascend.fused_dispatch import MAX_TOKENS_ENV, hccl_buffer_mb, local_problem, planned_tokens


class StandInMC2:
    """``npu_moe_distribute_dispatch`` / ``_combine`` on one rank of world 1: every row stays here."""

    def __init__(self) -> None:
        self.dispatch_kwargs: dict = {}
        self.combine_kwargs: dict = {}

    def npu_moe_distribute_dispatch(self, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, **kw):
        self.dispatch_kwargs = kw
        tokens, k = expert_ids.shape
        order = expert_ids.reshape(-1).argsort(stable=True)
        expand_x = x[order // k]
        counts = torch.bincount(expert_ids.reshape(-1).long(), minlength=moe_expert_num)
        scales = kw["expert_scales"].reshape(-1)[order] if kw.get("expert_scales") is not None else torch.empty(0)
        self.order = order
        return expand_x, torch.empty(0), order.int(), counts, torch.tensor([tokens * k]), torch.empty(0), scales

    def npu_moe_distribute_combine(self, expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                                   ep_world_size, ep_rank_id, moe_expert_num, **kw):
        self.combine_kwargs = kw
        tokens, k = expert_ids.shape
        rows = torch.zeros(tokens * k, expand_x.shape[1], dtype=expand_x.dtype)
        rows[expand_idx.long()] = expand_x[: tokens * k]
        return (rows.view(tokens, k, -1) * expert_scales[..., None].to(rows.dtype)).sum(1)


def test_the_window_reproduces_cann_s_formulas():
    # A3, V4 decode at the op's most: 512 tokens per rank, hidden 7168, 16 ranks, 256 experts, top-8 (~3.8 GB)
    assert hccl_buffer_mb("a3", 512, 16, 256, 8, 7168) == 3824
    assert hccl_buffer_mb("a3", 512, 16, 256, 6, 7168) == 3796
    # A2 full-mesh: 2 * (BS * ep * min(local, K) * H * 2 B + 2 MB)
    assert hccl_buffer_mb("a2", 256, 16, 256, 8, 7168) == 900
    assert hccl_buffer_mb("a2", 1, 16, 16, 8, 64) == 5  # at least the fixed 2 x 2 MB, rounded up
    with pytest.raises(ValueError, match="no documented window on SoC generation 950"):
        hccl_buffer_mb("950", 1, 16, 256, 8, 7168)


def test_the_planned_tokens_come_from_the_environment_within_the_op_s_limit(monkeypatch):
    monkeypatch.delenv(MAX_TOKENS_ENV, raising=False)
    assert planned_tokens("a3") == 512 and planned_tokens("a2") == 256
    monkeypatch.setenv(MAX_TOKENS_ENV, "64")
    assert planned_tokens("a3") == 64
    ids = torch.arange(16 * 65 * 2, dtype=torch.int64).remainder(16 * 8).view(-1, 2)[:65]
    rank, local = torch.arange(128) // 8, torch.arange(128) % 8
    hidden = torch.zeros(65, 7168, dtype=torch.bfloat16)
    assert "exceed the 64 the communication window is planned for" in local_problem("a3", 16, hidden, ids, rank, local)
    assert local_problem("a3", 16, hidden[:64], ids[:64], rank, local) is None
    for bad, message in (("600", r"outside \(0, 512\]"), ("many", "is not an integer")):
        monkeypatch.setenv(MAX_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=message):
            planned_tokens("a3")


@pytest.mark.parametrize("gen", ["a2", "a3"])
def test_a2_hands_the_dispatch_scales_back_to_combine(gen):
    tn = StandInMC2()
    g = torch.Generator().manual_seed(0)
    tokens, k, experts, hidden = 5, 2, 4, 32
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=g)
    recv, local_ids, weights, handle = fused_dispatch.dispatch(tn, x, ids, w, experts, "ep", 0, 1, tokens, gen)
    out = fused_dispatch.combine(tn, recv, handle)
    assert torch.allclose(out.float(), (x.float()[:, None, :] * w[..., None]).sum(1), atol=3e-2)
    if gen == "a2":  # CANN requires both there
        assert torch.equal(tn.dispatch_kwargs["expert_scales"], w.float())
        assert handle.expand_scales is not None and tn.combine_kwargs["expand_scales"] is handle.expand_scales
    else:
        assert tn.dispatch_kwargs["expert_scales"] is None and tn.combine_kwargs["expand_scales"] is None

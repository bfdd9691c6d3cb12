"""The contiguous cache's slot layout and bookkeeping, and the batch builder's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.errors import DeepInferError
from deepinfer.models.common import CSA, HCA, SLIDING, Batch, ContiguousCache
from deepinfer.models.registry import parse_config

RAW = dict(
    model_type="deepseek_v4", vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, head_dim=16, q_lora_rank=24, n_routed_experts=4, num_experts_per_tok=2, o_groups=2,
    o_lora_rank=8, sliding_window=8, layer_types=[SLIDING, CSA, HCA],
    compress_rates={CSA: 4, HCA: 16}, index_head_dim=8, partial_rotary_factor=0.5,
)
CFG = parse_config(RAW)


def _a(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def test_live_rows_are_distinct_and_negative_positions_map_to_minus_one():
    cache = ContiguousCache(CFG, 2, 64, max_step_tokens=4, dtype=torch.float32)
    assert cache.window_rows == 8 - 1 + 4
    csa = cache.geometry.specs[CSA]
    # the rows one step of 4 tokens at position 20 needs, for both sequences, never collide
    win = np.arange(20 - 7, 24)
    rows = np.concatenate([cache.window_rows_of(np.full_like(win, s), win) for s in (0, 1)])
    entries = np.arange(0, 24 // 4)
    rows = np.concatenate([rows] + [cache.entry_rows_of(csa, np.full_like(entries, s), entries) for s in (0, 1)])
    assert len(np.unique(rows)) == len(rows) and rows.min() >= 0 and rows.max() < cache.kv_pool(1).shape[0]
    state = np.arange(20 - 4, 24)
    srows = np.concatenate([cache.state_rows_of(csa, np.full_like(state, s), state) for s in (0, 1)])
    assert len(np.unique(srows)) == len(srows) and srows.max() < cache.state_pool(1, "compressor")[0].shape[0]
    assert cache.window_rows_of(_a(0, 1, -1), _a(-3, 2, 5)).tolist() == [-1, 1 * 11 + 2, -1]
    assert cache.entry_rows_of(cache.geometry.specs[HCA], _a(1), _a(-1)).tolist() == [-1]


def test_floor_and_shared_tokens_protect_state_the_sequence_did_not_compute():
    cache = ContiguousCache(CFG, 2, 64, max_step_tokens=4, dtype=torch.float32)
    csa = cache.geometry.specs[CSA]
    cache.set_sequence(0, list(cache.tables[0][cache.tables[0] >= 0]), floor=10, shared_tokens=16)
    assert cache.window_rows_of(_a(0, 0), _a(9, 10)).tolist()[0] == -1 and cache.window_rows_of(_a(0), _a(10))[0] >= 0
    assert cache.state_rows_of(csa, _a(0), _a(9)).tolist() == [-1]
    # entries 0-3 come from shared blocks: readable, never rewritten
    assert (cache.entry_rows_of(csa, _a(0, 0), _a(3, 4)) >= 0).all()
    assert cache.entry_write_rows_of(csa, _a(0, 0), _a(3, 4))[0] == -1
    assert cache.entry_write_rows_of(csa, _a(0, 0), _a(3, 4))[1] >= 0


def test_pool_shapes_follow_layer_types_and_the_geometry():
    cache = ContiguousCache(CFG, 2, 64, dtype=torch.bfloat16)
    assert cache.kv_pool(0).shape == (2 * 64, 16)  # ring as long as the sequence: no wrap at all
    assert cache.kv_pool(2).shape == (2 * (64 + 64 // 16), 16)
    assert cache.state_pool(1, "compressor")[0].shape[1] == 32 and cache.state_pool(1, "indexer")[1].shape[1] == 16
    assert cache.state_pool(2, "compressor")[0].shape[1] == 16
    assert cache.index_pool(1).shape == (2 * 16, 8) and cache.index_pool(1).dtype == torch.bfloat16
    assert cache.pool_bytes() == cache.geometry.pool_bytes(cache.num_slots, cache.num_blocks, torch.bfloat16)


def test_bookkeeping_errors():
    cache = ContiguousCache(CFG, 1, 32, max_step_tokens=4, dtype=torch.float32)
    with pytest.raises(DeepInferError, match="not allocated"):
        cache.begin_forward(Batch.build([[1]], [0], [0]))
    slot = cache.allocate()
    with pytest.raises(DeepInferError, match="slots of the cache are in use"):
        cache.allocate()
    with pytest.raises(DeepInferError, match=r"holds 0 tokens but the batch continues it at position 2"):
        cache.begin_forward(Batch.build([[1]], [slot], [2]))
    with pytest.raises(DeepInferError, match="at most 4"):
        cache.begin_forward(Batch.build([[1] * 5], [slot], [0]))
    for start in range(0, 12, 4):
        cache.begin_forward(Batch.build([[1] * 4], [slot], [start]))
    assert cache.lengths[slot] == 12
    with pytest.raises(DeepInferError, match="cannot roll sequence slot 0 back from 12 to 7"):
        cache.truncate(slot, 7)
    with pytest.raises(DeepInferError, match="0 <= new_len <= 12"):
        cache.truncate(slot, 13)
    cache.truncate(slot, 8)
    assert cache.lengths[slot] == 8
    cache.truncate(slot, 0)
    for start in range(0, 32, 4):
        cache.begin_forward(Batch.build([[1] * 4], [slot], [start]))
    with pytest.raises(DeepInferError, match="at most 32"):
        cache.begin_forward(Batch.build([[1]], [slot], [32]))
    cache.free(slot)
    assert cache.allocate() == slot and cache.lengths[slot] == 0


def test_batch_build_layout_and_errors():
    b = Batch.build([[5, 6, 7], [8]], [3, 1], [10, 0], logits=[[0, 2], [0]])
    assert b.query_start_loc == (0, 3, 4)
    assert b.logits_indices == (0, 2, 3)
    assert b.max_context_len == 13 and b.num_tokens == 4 and b.num_seqs == 2
    assert Batch.build([[5, 6]], [0], [0], logits="all").logits_indices == (0, 1)
    empty = Batch.build([], [], [])
    assert empty.num_tokens == 0 and empty.max_context_len == 0
    with pytest.raises(DeepInferError, match="repeated cache slots"):
        Batch.build([[1], [2]], [0, 0], [0, 0])
    with pytest.raises(DeepInferError, match="at least one token"):
        Batch.build([[]], [0], [0])
    with pytest.raises(DeepInferError, match="one of each per sequence"):
        Batch.build([[1]], [0, 1], [0])

"""DeepSeek-V4 with ``kv_cache_dtype="auto"`` against a dense oracle of the KV rounding it was trained with.

``tests/helpers/v4_oracle.py`` computes V4's forward in float64 from the
published math and rounds what DeepSeek's inference code rounds (FP8 window and
compressed K=V past the rotary channels, Walsh–Hadamard-rotated FP4 indexer keys
and queries); ``tests/helpers/kv_rounding.py`` writes that rounding from the
formulas. The checkpoint is in the release's layout with ``quantization_config``
(so ``auto`` packs), one layer of each kind (sliding, CSA whose indexer keeps 8
of up to 25 entries, HCA at ratio 16), widths that are whole scale blocks
(128-channel rows, 64 of them rotary; 64-channel indexer keys) and DSpark draft
stages. The engine must give the oracle's log-probabilities (mean within
``MEAN_ATOL``) and greedy tokens: prompt and generation, after an exactly
replayed prefix hit, after a bounded replay (against the oracle's bounded
replay), after preemption; speculation must not change a token; and
``kv_cache_dtype="model"`` must stay the unrounded math, measurably apart.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.models.registry import load_config
from deepinfer_interfaces import KVFormat
from deepinfer_interfaces.kv_format import round_rows
from tests.helpers.checkpoints import BOS_ID, byte_tokens
from tests.helpers.kv_rounding import e2m1_round, e4m3_round, hadamard
from tests.helpers.published import DSPARK_FIELDS, make_published_checkpoint
from tests.helpers.trained_kv import (
    MEAN_ATOL, agreement, check_float32, check_preemption, check_speculation, greedy, one_by_one,
)
from tests.helpers.v4_oracle import oracle_forward

pytestmark = pytest.mark.usefixtures("one_thread")

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
CONFIG = dict(
    head_dim=128, qk_rope_head_dim=64, index_head_dim=64, index_topk=8, compress_rate_hca=16,
    compress_ratios=[0, 4, 16, 0, 0, 0], layer_types=[SLIDING, CSA, HCA],
)
ENGINE = dict(backend="cpu", dtype="float64", max_model_len=256, kv_cache_memory=64 << 20, max_num_seqs=4, speculative_method=None)
PREFIX = [BOS_ID] + byte_tokens(80, 1)
PROMPTS = [PREFIX + byte_tokens(7, 2), PREFIX + byte_tokens(9, 3)]
TOKENS = 8
#: a top-k choice (indexer, routing) closer than this, relative to its row, could go either way in fp32
MIN_MARGIN = 2e-6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_published_checkpoint(tmp_path_factory.mktemp("v4_trained_kv"), name="v4", draft="dspark", **CONFIG)


def _oracle(ckpt, ids, rounding=True, **replay):
    result = oracle_forward(ckpt, ids, rounding=rounding, **replay)
    assert result.min_margin > MIN_MARGIN, f"a near tie in a top-k choice ({result.min_margin:.2e}): pick other prompts"
    return result


@pytest.fixture(scope="module")
def auto(ckpt):
    """The first prompt with its prompt log-probabilities, then the second hitting the shared prefix (exact replay)."""
    llm = LLM(model=str(ckpt), kv_cache_dtype="auto", swa_replay="exact", **ENGINE)
    done = one_by_one(llm, [(PROMPTS[0], greedy(TOKENS, True)), (PROMPTS[1], greedy(TOKENS, False))])
    return llm, done


def test_the_cache_holds_the_published_records_and_the_oracle_rounds_alike(ckpt):
    formats = load_config(ckpt).kv_cache_formats("auto")
    kv = KVFormat("v4.kv.fp8", 128, "e4m3", 64, "ue8m0", 64)
    index = KVFormat("v4.index.fp4", 64, "e2m1", 32, "ue8m0")
    assert (formats.window, formats.entry, formats.index, formats.index_rotate) == (kv, kv, index, True)
    assert formats.state_dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 128, generator=g) * torch.exp(3 * torch.randn(64, 1, generator=g))
    rows[0, :64] = 0  # an all-zero block keeps the floor's scale
    rows[1, :32] = (torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0**-3).repeat(4)  # e2m1 midpoints, scale 2^-3
    assert torch.equal(e4m3_round(rows, 64, "ue8m0", keep=64), round_rows(rows, kv))
    assert torch.equal(e2m1_round(hadamard(rows[:, :64]), 32), round_rows(hadamard(rows[:, :64]), index))
    assert torch.equal(e2m1_round(rows[:, :64], 32), round_rows(rows[:, :64], index))


def test_auto_matches_the_rounded_oracle_before_and_after_an_exact_prefix_hit(ckpt, auto):
    llm, (first, hit) = auto
    assert first.cached_tokens == 0 and hit.cached_tokens == 80
    assert llm.get_metrics()["replayed_tokens"] == llm.engine.replay_tokens
    for done in (first, hit):
        agree = agreement(done, _oracle(ckpt, done.ids).logits)
        assert agree.mean <= MEAN_ATOL and agree.same_tokens, str(agree)
    # the comparison tells rounded from unrounded: the oracle without rounding is far off
    unrounded = agreement(first, oracle_forward(ckpt, first.ids).logits)
    assert unrounded.mean > 10 * MEAN_ATOL, str(unrounded)


def test_a_bounded_replay_matches_the_oracles_bounded_replay(ckpt):
    llm = LLM(model=str(ckpt), kv_cache_dtype="auto", swa_replay="bounded", **ENGINE)
    first, hit = one_by_one(llm, [(PROMPTS[0], greedy(1, False)), (PROMPTS[1], greedy(TOKENS, False))])
    w = llm.engine.runner.config.sliding_window
    assert hit.cached_tokens == 80 and llm.get_metrics()["replayed_tokens"] == w
    bounded = _oracle(ckpt, hit.ids, hit=80, replay=w)
    agree = agreement(hit, bounded.logits, bounded.start)
    assert agree.mean <= MEAN_ATOL and agree.same_tokens, str(agree)
    # the bounded replay is not the dense forward: the comparison above could tell them apart
    dense = agreement(hit, oracle_forward(ckpt, hit.ids, rounding=True).logits)
    assert dense.mean > 10 * MEAN_ATOL, f"bounded {agree}; dense {dense}"


def test_preemption_recomputes_the_rounded_state(ckpt):
    prompts = [PREFIX[i:] + byte_tokens(5, 10 + i) for i in range(0, 40, 10)]
    check_preemption(ckpt, ENGINE, prompts, TOKENS, lambda ids: _oracle(ckpt, ids).logits)


def test_speculation_keeps_greedy_output_under_auto(ckpt, auto, tmp_path):
    check_speculation(ckpt, auto[1], DSPARK_FIELDS["dspark_markov_rank"], tmp_path, ENGINE, TOKENS)


def test_float32_rounds_as_trained_and_the_model_dtype_stays_unrounded(ckpt):
    check_float32(ckpt, ENGINE, PROMPTS[0], TOKENS, lambda ids, rounding: _oracle(ckpt, ids, rounding=rounding).logits)

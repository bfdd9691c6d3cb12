"""DeepSeek V4.1 with ``kv_cache_dtype="auto"`` against a dense oracle of the KV rounding it was trained with.

``tests/helpers/v41_oracle.py`` with ``rounding=True`` rounds what the published
code rounds (FP8 window K=V per 32 channels, FP4 compressed entries with e4m3
scales per 16, FP4 indexer keys and queries per 32); ``tests/helpers/kv_rounding.py``
writes that rounding from the formulas. The checkpoint stores its weights as the
release does (``quantization_config``, so ``auto`` packs) with widths that are
whole scale blocks (32-channel K=V rows and indexer keys) and holds every role
of ``tiny_v41``: sliding layers, a ratio-2 group (source, reindexing reader,
reusing reader), a ratio-1 group whose source keeps candidate blocks for a
reindexing reader (two-level top-k), Engram; and DSpark draft stages. The
engine must give the oracle's log-probabilities (mean within ``MEAN_ATOL``) and
greedy tokens: prompt and generation, after an exactly replayed prefix hit,
after a bounded replay (against the oracle's bounded replay), after preemption;
speculation must not change a token; and ``kv_cache_dtype="model"`` must stay
the unrounded math, measurably apart.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.models.registry import load_config
from deepinfer_interfaces import KVFormat
from deepinfer_interfaces.kv_format import round_rows
from tests.helpers.kv_rounding import e2m1_round, e4m3_round
from tests.helpers.tiny_v41_draft import DRAFT_FIELDS, write_tiny_v41_draft
from tests.helpers.trained_kv import (
    MEAN_ATOL, agreement, check_float32, check_preemption, check_speculation, greedy, one_by_one,
)
from tests.helpers.v41_oracle import oracle_forward

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(backend="cpu", dtype="float64", max_model_len=256, kv_cache_memory=64 << 20, max_num_seqs=4, speculative_method=None)
#: the shared prefix: six blocks, longer than the exact replay (8 layers x the window of 8)
HIT = 96


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = _ids(HIT, 1)
PROMPTS = [PREFIX + _ids(7, 2), PREFIX + _ids(9, 3)]
TOKENS = 8
#: a top-k choice (indexer, candidate blocks, routing) closer than this, relative to its row, could go either
#: way in fp32
MIN_MARGIN = 2e-6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_v41_draft(tmp_path_factory.mktemp("v41_trained_kv") / "tiny", quantized=True, index_head_dim=32)


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
    window = KVFormat("v41.window.fp8", 32, "e4m3", 32, "ue8m0")
    entry = KVFormat("v41.entry.fp4", 32, "e2m1", 16, "e4m3")
    index = KVFormat("v41.index.fp4", 32, "e2m1", 32, "ue8m0")
    assert (formats.window, formats.entry, formats.index, formats.index_rotate) == (window, entry, index, False)
    assert formats.state_dtype == torch.float32
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 32, generator=g) * torch.exp(3 * torch.randn(64, 1, generator=g))
    rows[0] = 0  # an all-zero block keeps the floor's scale
    rows[1] = (torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0**-3).repeat(4)  # e2m1 midpoints, scale 2^-3
    assert torch.equal(e4m3_round(rows, 32), round_rows(rows, window))
    assert torch.equal(e2m1_round(rows, 16, "e4m3"), round_rows(rows, entry))
    assert torch.equal(e2m1_round(rows, 32), round_rows(rows, index))


def test_auto_matches_the_rounded_oracle_before_and_after_an_exact_prefix_hit(ckpt, auto):
    llm, (first, hit) = auto
    assert first.cached_tokens == 0 and hit.cached_tokens == HIT
    assert llm.get_metrics()["replayed_tokens"] == llm.engine.replay_tokens
    for done in (first, hit):
        agree = agreement(done, _oracle(ckpt, done.ids).logits)
        assert agree.mean <= MEAN_ATOL and agree.same_tokens, str(agree)
    # the comparison tells rounded from unrounded: the oracle without rounding is far off
    unrounded = agreement(first, oracle_forward(ckpt, first.ids, rounding=False).logits)
    assert unrounded.mean > 10 * MEAN_ATOL, str(unrounded)


def test_a_bounded_replay_matches_the_oracles_bounded_replay(ckpt):
    llm = LLM(model=str(ckpt), kv_cache_dtype="auto", swa_replay="bounded", **ENGINE)
    first, hit = one_by_one(llm, [(PROMPTS[0], greedy(1, False)), (PROMPTS[1], greedy(TOKENS, False))])
    w = llm.engine.runner.config.sliding_window
    assert hit.cached_tokens == HIT and llm.get_metrics()["replayed_tokens"] == w
    bounded = _oracle(ckpt, hit.ids, hit=HIT, replay=w)
    agree = agreement(hit, bounded.logits, bounded.start)
    assert agree.mean <= MEAN_ATOL and agree.same_tokens, str(agree)
    # the bounded replay is not the dense forward: the comparison above could tell them apart
    dense = agreement(hit, oracle_forward(ckpt, hit.ids, rounding=True).logits)
    assert dense.mean > 10 * MEAN_ATOL, f"bounded {agree}; dense {dense}"


def test_preemption_recomputes_the_rounded_state(ckpt):
    prompts = [PREFIX[i:] + _ids(5, 10 + i) for i in range(0, 40, 10)]
    check_preemption(ckpt, ENGINE, prompts, TOKENS, lambda ids: _oracle(ckpt, ids).logits)


def test_speculation_keeps_greedy_output_under_auto(ckpt, auto, tmp_path):
    check_speculation(ckpt, auto[1], DRAFT_FIELDS["dspark_markov_rank"], tmp_path, ENGINE, TOKENS)


def test_float32_rounds_as_trained_and_the_model_dtype_stays_unrounded(ckpt):
    check_float32(ckpt, ENGINE, PROMPTS[0], TOKENS, lambda ids, rounding: _oracle(ckpt, ids, rounding=rounding).logits)

"""Offline DSpark acceptance: the chain of draft passes greedy speculative decoding makes, and the bundled
draft's measured acceptance and calibration on held-out text."""

from __future__ import annotations

import pytest
import torch

from training.dspark_train import decoding_passes

pytestmark = pytest.mark.usefixtures("one_thread")


def test_passes_chain_past_accepted_tokens_and_the_bonus_token():
    # a pass at anchor j accepting k tokens is followed by one at j + k + 1
    accepted = torch.tensor([[2, 5, 5, 0, 1, 4, 0, 0, 3]])
    continuation = torch.full((1, 14), 7)
    rows, cols, lengths = decoding_passes(accepted, continuation, eos_id=1)
    assert cols.tolist() == [0, 3, 4, 6, 7, 8]
    assert lengths.tolist() == [2, 0, 1, 0, 0, 3]
    assert rows.tolist() == [0] * 6


def test_generation_ends_at_eos_and_drafts_past_it_do_not_count():
    accepted = torch.tensor([[5, 5, 5, 5, 5, 5], [1, 5, 0, 5, 5, 5], [5, 5, 5, 5, 5, 5]])
    continuation = torch.tensor([
        [3, 3, 3, 1, 3, 3, 3, 3, 3, 3],  # EOS inside the first pass's accepted tokens: 3 count, then it ends
        [3, 3, 1, 3, 3, 3, 3, 3, 3, 3],  # EOS is the token verification adds after the first pass
        [1, 3, 3, 3, 3, 3, 3, 3, 3, 3],  # the prefill sampled EOS: no pass at all
    ])
    rows, cols, lengths = decoding_passes(accepted, continuation, eos_id=1)
    assert list(zip(rows.tolist(), cols.tolist(), lengths.tolist())) == [(0, 0, 3), (1, 0, 1)]


@pytest.mark.slow
def test_bundled_draft_accepts_half_its_block_and_is_calibrated():
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    from deepinfer.engine import BUNDLED_MODEL
    from training.corpus import build_corpus
    from training.data import corpus_streams
    from training.evaluate_checkpoint import draft_acceptance
    from training.tokenizer import EOS_TOKEN
    from training.train_tiny import SETTINGS

    tok = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    _, heldout = corpus_streams(tok, build_corpus(heldout_per_mille=SETTINGS[False]["heldout_per_mille"]))
    hf = DeepseekV4ForCausalLM.from_pretrained(str(BUNDLED_MODEL)).eval()
    acc = draft_acceptance(BUNDLED_MODEL, hf, heldout, tok.token_to_id(EOS_TOKEN))
    assert acc["samples"] > 200 and acc["draft_passes"] > 2000
    assert sum(acc["accepted_histogram"]) == acc["draft_passes"]
    assert acc["mean_accepted"] >= 2.5, acc
    for observed, predicted in zip(acc["survival_observed"], acc["survival_predicted"]):
        assert abs(observed - predicted) <= 0.1, acc

"""``SamplingParams(n=...)``: n completions of one prompt in one output, the prompt prefilled once."""

from __future__ import annotations

import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from tests.helpers.checkpoints import BOS_ID, make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "mixed")


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [BOS_ID] + torch.randint(0, 256, (n,), generator=g).tolist()


def _llm(ckpt, **kw):
    return LLM(model=str(ckpt), backend="cpu", kv_cache_memory=32 << 20, max_model_len=256, **kw)


@pytest.mark.parametrize("length", [16, 37])  # a prompt ending on a block boundary, and one inside a block
def test_greedy_n4_gives_four_copies_of_n1_and_prefills_once(ckpt, length):
    prompt = _prompt(length - 1, length)
    one = _llm(ckpt).generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    llm = _llm(ckpt)
    out = llm.generate([prompt], SamplingParams(n=4, temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    assert all(c.token_ids == one.outputs[0].token_ids for c in out.outputs)
    assert all(c.text == one.outputs[0].text and c.finish_reason == "length" for c in out.outputs)
    m = llm.get_metrics()
    # the prompt once, then each completion's 11 fed-back tokens
    assert m["computed_tokens"] == length + 4 * 11 and m["prefill_tokens"] == length
    assert m["forked_sequences"] == 3 and m["generated_tokens"] == 48


def test_forks_after_a_chunked_prefill_and_beside_running_requests(ckpt):
    prompts = [_prompt(60, 8), _prompt(9, 9)]
    sp = [SamplingParams(n=3, temperature=0, max_tokens=7, ignore_eos=True), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    alone = [_llm(ckpt).generate([p], SamplingParams(temperature=0, max_tokens=s.max_tokens, ignore_eos=True))[0] for p, s in zip(prompts, sp)]
    for overlap in (False, True):
        llm = _llm(ckpt, max_prefill_chunk=16, max_num_batched_tokens=24, overlap_scheduling=overlap)
        outs = llm.generate(prompts, sp)
        assert [c.token_ids for c in outs[0].outputs] == [alone[0].outputs[0].token_ids] * 3
        assert outs[1].outputs[0].token_ids == alone[1].outputs[0].token_ids
        assert llm.get_metrics()["forked_sequences"] == 2


def test_seeded_n4_sampling_is_reproducible_and_each_completion_has_its_own_stream(ckpt):
    prompt = _prompt(20, 1)
    sp = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_tokens=10, seed=11, ignore_eos=True)
    a = _llm(ckpt).generate([prompt], sp)[0]
    b = _llm(ckpt).generate([prompt, _prompt(9, 2)], [sp, SamplingParams(temperature=1.0, max_tokens=5)])[0]
    tokens = [c.token_ids for c in a.outputs]
    assert tokens == [c.token_ids for c in b.outputs]
    assert len({tuple(t) for t in tokens}) > 1
    # completion i draws like a single request seeded seed + i
    for i in (0, 2):
        single = _llm(ckpt).generate([prompt], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=11 + i, ignore_eos=True))[0]
        assert single.outputs[0].token_ids == tokens[i]


def test_n_with_structured_output_logprobs_and_a_batch(ckpt):
    llm = _llm(ckpt)
    sp = SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=20, logprobs=2, prompt_logprobs=1,
                        structured_outputs=StructuredOutputsParams(regex="(yes|no|maybe)"))
    outs = llm.generate([_prompt(12, 3), _prompt(30, 4)], [sp, SamplingParams(temperature=0, max_tokens=6)])
    grouped = outs[0]
    assert len(grouped.outputs) == 3 and len(outs[1].outputs) == 1
    for c in grouped.outputs:
        assert c.text in ("yes", "no", "maybe") and c.finish_reason == "stop"
        assert len(c.logprobs) == len(c.token_ids) and all(t in pos for t, pos in zip(c.token_ids, c.logprobs))
    assert grouped.prompt_logprobs[0] is None and len(grouped.prompt_logprobs) == 13


def test_without_room_to_copy_the_completions_prefill_on_their_own(ckpt):
    prompt = _prompt(25, 5)
    one = _llm(ckpt).generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    llm = _llm(ckpt, max_num_seqs=2, max_n=3, enable_prefix_caching=False)  # n past the batch: completions wait their turn
    out = llm.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert all(c.token_ids == one.outputs[0].token_ids for c in out.outputs)
    m = llm.get_metrics()
    assert m["forked_sequences"] == 1 and m["prefill_tokens"] == 2 * 26


def test_streaming_and_abort_cover_every_completion(ckpt):
    llm = _llm(ckpt)
    seen = []
    for out in llm.generate_stream([_prompt(10, 6)], SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True)):
        seen.append([len(c.token_ids) for c in out.outputs])
    assert seen[-1] == [5, 5] and len(seen) >= 5
    stream = llm.generate_stream([_prompt(10, 7)], SamplingParams(n=3, temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()  # abandoning the stream aborts all three
    assert not llm.engine.has_unfinished and not llm.engine.requests


def test_bad_n_is_refused_with_its_field():
    with pytest.raises(InvalidRequestError, match="'n' = 0"):
        SamplingParams(n=0)

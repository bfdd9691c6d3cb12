"""The engine's thinking budget under preemption and parallel sampling: every completion's reasoning is closed
by ``</think>`` right after its budget (unless the model closed it first), and a cache too small for the batch
(requests preempted and recomputed) writes exactly what a roomy one writes, speculating in both."""

from __future__ import annotations

import math

import pytest

from deepinfer.llm import LLM
from deepinfer.sampling_params import InvalidRequestError, SamplingParams
from tests.helpers.chat_models import END_THINK, IDS, THINK, v4_chat_model

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTIONS = ["Weather in Oslo?", "Name a color.", "Count to three.", "What is tea?"]
BUDGET = 3
MAX_LEN = 96


def test_budget_holds_under_preemption_and_n():
    convs = [[{"role": "user", "content": q + " " + "Think it over. " * 6}] for q in QUESTIONS]
    params = SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=14, thinking_budget=BUDGET)
    roomy = LLM(backend="cpu", max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=32, max_prefill_chunk=16,
                enable_prefix_caching=False)
    expected = roomy.chat(convs, params, thinking=True)
    end = roomy.get_tokenizer().encode("</think>", add_special_tokens=False).ids
    for out in expected:
        for c in out.outputs:
            assert any(c.token_ids[i:i + len(end)] == end for i in range(BUDGET + 1)), c.text
    plan = roomy.engine.runner.plan  # room for about two of the eight sequences
    small = (plan.bytes_per_slot + plan.draft_bytes_per_slot) * 8 + plan.bytes_per_block * (2 * math.ceil(MAX_LEN / plan.block_size) + 1)
    tight = LLM(backend="cpu", max_model_len=MAX_LEN, kv_cache_memory=small, max_num_seqs=8, max_num_batched_tokens=32,
                max_prefill_chunk=16, enable_prefix_caching=False)
    got = tight.chat(convs, params, thinking=True)
    assert tight.get_metrics()["preemptions"] > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    with pytest.raises(InvalidRequestError, match="thinking_budget"):
        SamplingParams(thinking_budget=-1)


def test_budget_closes_with_the_tokenizers_own_end_token(tmp_path):
    """A DeepSeek-V4 tokenizer has ``</think>`` as one special token: that id is forced, right after the budget."""
    llm = LLM(model=str(v4_chat_model(tmp_path)), backend="cpu", speculative_method=None)
    conv = [{"role": "user", "content": "Weather in Oslo?"}]
    for budget in (0, 2):
        out = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=budget + 3, thinking_budget=budget), thinking=True)[0]
        assert out.prompt.endswith(THINK) and out.outputs[0].token_ids[budget] == IDS[END_THINK]

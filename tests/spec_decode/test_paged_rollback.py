"""The engine's paged cache rolls back provisional tokens (rejected drafts) across block and window edges."""

import torch

from deepinfer.llm import LLM
from deepinfer.models.common import Batch
from tests.helpers.checkpoints import BOS_ID, make_tiny_checkpoint


def test_rejected_tokens_leave_no_trace(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path, "mixed")
    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=32 << 20, max_model_len=128, max_num_seqs=2)
    runner = llm.engine.runner
    cache = runner.cache
    bs = cache.block_size
    cache.set_sequence(0, list(range(128 // bs)))
    g = torch.Generator().manual_seed(0)
    prompt = [BOS_ID] + torch.randint(0, 256, (13,), generator=g).tolist()
    follow = torch.randint(0, 256, (20,), generator=g).tolist()

    def run(tokens, start):
        return runner.model(Batch.build([tokens], [0], [start], logits="all"), cache)

    straight = torch.cat([run(prompt, 0), run(follow, len(prompt))])
    # same prefill, then a step of 6 provisional tokens that close compressor windows and a block,
    # all rejected; the sequence continues from where it was as if they never happened
    run(prompt, 0)
    run(torch.randint(0, 256, (6,), generator=g).tolist(), len(prompt))
    again = run(follow, len(prompt))
    assert torch.allclose(again, straight[len(prompt):], atol=1e-5)

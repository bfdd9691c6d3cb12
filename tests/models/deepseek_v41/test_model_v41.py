"""DeepSeek V4.1 runs: self-consistency of its shared-KV attention, two-level top-k, Engram and engine paths.

No installable oracle has ``deepseek_v41`` yet, so the model is checked against
itself on a tiny random checkpoint written under the release's names
(``tests/helpers/tiny_v41.py``): every layer role, ratios 2 and 1, a
candidate source confining a later indexer, Engram tables memory-mapped from
the file.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.models.common import Batch, ContiguousCache
from deepinfer.models.common.inputs import step_inputs
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from deepinfer_interfaces import Kernels
from tests.helpers.tiny_v41 import write_tiny_v41
from deepinfer.models.registry import load_model, parse_config

PROMPT = [(37 * i + 11) % 4000 + 5 for i in range(70)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_v41(tmp_path_factory.mktemp("v41") / "tiny")


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ckpt, Kernels(), dtype=torch.float32)


def _logits(model, chunks: list[int], ids=PROMPT, logits="all") -> torch.Tensor:
    """Prefill ``ids`` in chunks of the given sizes; the logits of every position, in order."""
    cache = ContiguousCache(model.config, 1, 256, dtype=torch.float32)
    slot = cache.allocate()
    out, at = [], 0
    for n in chunks:
        out.append(model(Batch.build([ids[at : at + n]], [slot], [at], logits), cache))
        at += n
    assert at == len(ids)
    return torch.cat(out)


def test_loads_the_release_names_with_the_tables_memory_mapped(model):
    assert isinstance(model, DeepseekV41Model) and model.mapped_tables
    names = model.named_parameters()
    assert "model.layers.1.engram.wkv.weight" in names and not any(".engram.embed." in n for n in names)
    table = model.layers[1].engram.table
    assert table.mapped and table.rows == model.config.text.engram_num_embeddings[0]
    roles = [(layer.role.mode, layer.layer_type) for layer in model.layers]
    assert roles == [
        ("sliding", "sliding_attention"), ("sliding", "sliding_attention"), ("full", "shared2.source"),
        ("reindex", "shared2.reader"), ("reuse", "shared2.reader"), ("full", "shared1.source"),
        ("reindex", "shared1.reader"), ("reuse", "shared1.reader"),
    ]


def test_the_release_storage_loads_kept_quantized_in_32_by_32_blocks(tmp_path):
    ckpt = write_tiny_v41(tmp_path / "fp8", quantized=True)
    kept = load_model(ckpt, Kernels(), dtype=torch.float32)
    plain = load_model(ckpt, Kernels(), dtype=torch.float32, quantization="dequantize")
    attn = kept.layers[2].attn
    assert attn.wq_b.block == (32, 32) and attn.wq_b.codes.dtype == torch.float8_e4m3fn
    assert kept.layers[2].ffn.w13.fmt == "e2m1" and kept.layers[5].attn.indexer.wq_b.block == (32, 32)
    torch.testing.assert_close(_logits(kept, [70]), _logits(plain, [70]), rtol=1e-4, atol=1e-4)


def test_chunked_prefill_and_decoding_equal_one_shot(model):
    whole = _logits(model, [70])
    for chunks in ([16, 16, 16, 22], [7] * 10, [33, 1, 1, 35]):
        torch.testing.assert_close(_logits(model, chunks), whole, rtol=1e-4, atol=1e-4)
    assert whole.std() > 0.1


def _tail_prefill(model, chunks: list[int], ids=PROMPT, fast=True) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill in chunks (each chunk's last logits), tail-only when ``fast``, then decode three tokens."""
    cache = ContiguousCache(model.config, 1, 256, dtype=torch.float32)
    slot = cache.allocate()
    out, at = [], 0
    for n in chunks:
        batch = Batch.build([ids[at : at + n]], [slot], [at], "last" if at + n == len(ids) else [[]])
        out.append(model(dataclasses.replace(batch, prefill_end=(len(ids),) if fast else ()), cache))
        at += n
    steps = [model(Batch.build([[t]], [slot], [at + i]), cache) for i, t in enumerate([9, 99, 999])]
    return out, torch.cat(steps)


def test_the_tail_only_prefill_keeps_the_last_logits_and_the_decode_state(model):
    """Layers 6 and 7 (past the last KV source) compute 15 and 8 of the 70 positions; the last logits and every
    later decode step equal a full prefill's."""
    geometry = ContiguousCache(model.config, 1, 256).geometry
    assert geometry.prefill_tail == (15, 8)
    full_chunks, full_steps = _tail_prefill(model, [70], fast=False)
    for chunks in ([70], [32, 32, 6], [50, 20]):
        chunk_logits, steps = _tail_prefill(model, chunks)
        torch.testing.assert_close(chunk_logits[-1], full_chunks[-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(steps, full_steps, rtol=1e-5, atol=1e-5)
    # a tail one window too short changes the result (the tails are as short as they can be)
    short = dataclasses.replace(geometry, prefill_tail=(14, 8))
    cache = ContiguousCache(model.config, 1, 256, dtype=torch.float32)
    cache.geometry = short
    batch = dataclasses.replace(Batch.build([PROMPT], [cache.allocate()], [0]), prefill_end=(70,))
    assert (model(batch, cache) - full_chunks[-1]).abs().max() > 1e-4


def test_two_level_topk_keeping_every_block_equals_dense_selection(tmp_path, model):
    """With more candidate blocks than a query sees, the candidate mask keeps everything; with few it changes
    the output (so this test would notice a mask that is never applied)."""
    dense = load_model(write_tiny_v41(tmp_path / "dense", candidate_source_layer_id=-1), Kernels(), dtype=torch.float32)
    every = load_model(write_tiny_v41(tmp_path / "every", candidate_topk_blocks=1000), Kernels(), dtype=torch.float32)
    torch.testing.assert_close(_logits(every, [70]), _logits(dense, [70]), rtol=0, atol=0)
    assert (_logits(model, [70]) - _logits(dense, [70])).abs().max() > 1e-3


def test_an_engram_adding_nothing_equals_the_plain_stack(tmp_path):
    silent = load_model(write_tiny_v41(tmp_path / "silent", engram_value_zero=True), Kernels(), dtype=torch.float32)
    plain = load_model(write_tiny_v41(tmp_path / "plain", engram_layer_ids=[]), Kernels(), dtype=torch.float32)
    assert not plain.engram_layers and len(silent.engram_layers) == 2
    torch.testing.assert_close(_logits(silent, [40, 30]), _logits(plain, [70]), rtol=1e-5, atol=1e-5)


def test_engram_hashes_follow_the_ngrams_across_steps(model):
    """A token's hash ids depend on the tokens before it, and a later step reads its look-back from the
    cache's token ring: decoding after a prefill hashes as a one-shot prefill does."""
    hashes = []
    original = model.hasher

    def spy(k, windows):
        out = original(k, windows)
        hashes.append(out[1].clone())
        return out

    model.hasher = spy
    try:
        cache = ContiguousCache(model.config, 3, 64, dtype=torch.float32)
        a, b, c = cache.allocate(), cache.allocate(), cache.allocate()
        model(Batch.build([[5, 6, 7, 9], [8, 6, 7, 9], [5, 6, 7, 9, 10]], [a, b, c], [0, 0, 0]), cache)
        model(Batch.build([[10], [11]], [a, b], [4, 4]), cache)
    finally:
        model.hasher = original
    prefill, step = hashes
    # the windows themselves: the token first, then the ones before it, the pad id past the sequence start
    cache = ContiguousCache(model.config, 1, 64, dtype=torch.float32)
    batch = Batch.build([[5, 6, 7, 9]], [cache.allocate()], [0])
    cache.begin_forward(batch)
    m, pad = model.token_map, model.pad_id
    want = [[m[5], pad, pad, pad], [m[6], m[5], pad, pad], [m[7], m[6], m[5], pad], [m[9], m[7], m[6], m[5]]]
    assert model.ngrams(step_inputs(batch, cache, "cpu"), cache).tolist() == [[int(t) for t in row] for row in want]
    h = model.config.text.engram_n_heads
    assert torch.equal(prefill[3, : 2 * h], prefill[7, : 2 * h])  # bigram (7, 9) and trigram (6, 7, 9) alike
    assert not torch.equal(prefill[3, 2 * h :], prefill[7, 2 * h :])  # the 4-grams differ in their first token
    assert torch.equal(step[0], prefill[12])  # (6, 7, 9, 10) decoded equals it prefilled
    assert not torch.equal(step[1][:h], step[0][:h])  # (9, 11) is another bigram


def test_the_forward_traces_without_graph_breaks(model):
    cache = ContiguousCache(model.config, 2, 160, dtype=torch.float32)
    slots = [cache.allocate(), cache.allocate()]
    model(Batch.build([PROMPT[:33], PROMPT[:50]], slots, [0, 0]), cache)
    for batch in (Batch.build([[3], [4]], slots, [33, 50]), Batch.build([[6], PROMPT[:20]], slots, [34, 51])):
        cache.begin_forward(batch)
        explained = torch._dynamo.explain(model.forward)(step_inputs(batch, cache, "cpu"), cache)
        assert (explained.graph_break_count, explained.graph_count) == (0, 1)


def test_the_engine_prefills_tail_only_with_the_same_outputs(ckpt):
    prompts = [PROMPT, PROMPT[10:], PROMPT[:40] + [5, 6, 7]]
    fast, _ = _generate(ckpt, prompts, enable_prefix_caching=False)
    full, _ = _generate(ckpt, prompts, enable_prefix_caching=False, prefill_fast_path=False)
    assert fast == full


def _generate(ckpt, prompts, **engine) -> list[list[int]]:
    llm = LLM(model=str(ckpt), backend="cpu", max_prefill_chunk=32, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    first = llm.generate(prompts[:1], params)  # its blocks are committed before the others arrive
    rest = llm.generate(prompts[1:], params)
    return [o.outputs[0].token_ids for o in first + rest], llm.get_metrics()


def test_greedy_with_prefix_caching_and_exact_replay_equals_no_cache(ckpt):
    shared = PROMPT + [(13 * i + 7) % 4000 + 5 for i in range(50)]  # 120 tokens; hits of 112 replay 64
    prompts = [shared, shared[:112] + [42, 43, 44, 45], shared[:96] + list(range(300, 330)), shared[:112] + [7]]
    plain, _ = _generate(ckpt, prompts, enable_prefix_caching=False)
    exact, stats = _generate(ckpt, prompts, swa_replay="exact")
    assert exact == plain
    assert stats["cached_tokens"] >= 3 * 96 and stats["replayed_tokens"] > 0
    bounded, stats = _generate(ckpt, prompts, swa_replay="bounded")
    assert bounded[0] == plain[0] and stats["cached_tokens"] >= 3 * 96
    assert sum(len(t) for t in bounded) == sum(len(t) for t in plain)


def test_preemption_and_parallel_sampling_keep_outputs(ckpt):
    prompts = [PROMPT[i:] for i in range(0, 40, 8)]
    engine = dict(enable_prefix_caching=False, max_num_seqs=8, max_model_len=96)
    roomy, _ = _generate(ckpt, prompts, **engine)
    tight, stats = _generate(ckpt, prompts, **engine, kv_cache_memory=_budget(ckpt, slots=8, blocks=12))
    assert tight == roomy and stats["preemptions"] > 0
    # n = 2 forks the first completion's state (window rings in shared pools, the token ring, partial blocks)
    llm = LLM(model=str(ckpt), backend="cpu", max_prefill_chunk=32, **engine)
    forked = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=6, n=2))
    assert [[c.token_ids for c in o.outputs] for o in forked] == [[roomy[0]] * 2, [roomy[1]] * 2]


def _budget(ckpt, slots: int, blocks: int) -> int:
    """The KV budget of ``slots`` sequence slots and ``blocks`` token blocks (prefill chunks of 32, 96 tokens)."""
    from deepinfer.loader import read_config
    from deepinfer.models.common import CacheGeometry, block_size_for

    config = parse_config(read_config(ckpt))
    g = CacheGeometry.build(config, block_size_for(config, 16), 32, 96)
    return slots * g.bytes_per_slot(torch.float32) + blocks * g.bytes_per_block(torch.float32)


def test_an_unknown_engram_vocabulary_is_named(tmp_path):
    directory = write_tiny_v41(tmp_path / "bad")
    raw = json.loads((directory / "config.json").read_text())
    raw["text_config"]["engram_compressed_vocab_size"] += 1
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size is"):
        load_model(directory, Kernels(), dtype=torch.float32)


def test_text_prompts_in_vllm_form_run_and_images_to_a_checkpoint_without_vision_are_refused_per_request(ckpt):
    llm = LLM(model=str(ckpt), backend="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=3)
    text, ids, image = llm.generate(
        [{"prompt": "hello there"}, {"prompt_token_ids": PROMPT[:12]}, {"prompt": "what?", "multi_modal_data": {"image": b"x"}}],
        params,
    )
    assert len(text.outputs[0].token_ids) == 3 and ids.prompt_token_ids == PROMPT[:12] and text.prompt == "hello there"
    assert image.error == "this checkpoint reads no images: its config.json has no vision_config; send text only"
    assert not image.outputs[0].token_ids
    assert ids.outputs[0].token_ids == llm.generate(PROMPT[:12], params)[0].outputs[0].token_ids


def test_expert_parallel_equals_one_rank(ckpt):
    """Two rank processes, each holding half of every layer's routed experts (the Engram tables mapped by both)."""
    prompts = [PROMPT, PROMPT[5:40]]
    single, _ = _generate(ckpt, prompts, enable_prefix_caching=False)
    llm = LLM(model=str(ckpt), backend="cpu", expert_parallel_size=2, max_prefill_chunk=32, enable_prefix_caching=False)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
        assert len(llm.engine.rank_pids) == 2
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == single

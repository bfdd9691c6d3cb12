"""Images in prompts through the engine core: block hashes, chunked spans, the encoder cache, bias_vl, Engram.

The tiny checkpoint's real vision tower encodes the images; the spans are set on
the requests directly (the front doors have their own tests), and the engine's
metrics count what the tower encoded. What is checked is the engine around it: every span
position takes its image's row whatever the chunking, an image is encoded once
(a step's new images of all requests in one call), a prefix hit over an image
reuses its blocks and encodes nothing, the same ids with another image miss,
image positions route with ``bias_vl`` and add no Engram value.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from deepinfer.config import EngineConfig
from deepinfer.engine import Engine
from deepinfer.models.common.batch import Batch
from deepinfer.models.common.cache import ContiguousCache
from deepinfer.models.common.inputs import step_inputs
from deepinfer.models.registry import load_model
from deepinfer.multimodal import ImageGrid, ImageSpan
from deepinfer.sampling_params import SamplingParams
from deepinfer_interfaces import Kernels
from tests.helpers.tiny_v41 import write_tiny_v41

#: the id the span positions hold here: a text id, since the spans are set on the requests directly (the front
#: doors, which expand ``image_token_id`` placeholders, and the n-gram cut at that id are checked in test_vision_oracle)
PLACEHOLDER_ID = 7
GRID = ImageGrid(9, 9, 3, 3)  # 81 patches of 14 x 14, 3 x 3 tokens: 14 span positions
TEXT = [(37 * i + 11) % 4000 + 20 for i in range(90)]


def image(offset: int, seed: int) -> ImageSpan:
    patches = torch.randn(GRID.patches, 3 * 14 * 14, generator=torch.Generator().manual_seed(seed))
    return ImageSpan(offset, GRID, patches, hashlib.sha256(patches.numpy().tobytes() + bytes([seed])).digest())


def prompt_with(spans: list[ImageSpan], length: int = 84) -> list[int]:
    ids = list(TEXT[:length])
    for span in spans:
        ids[span.offset : span.end] = [PLACEHOLDER_ID] * span.length
    return ids


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    ckpt = write_tiny_v41(tmp_path_factory.mktemp("v41img") / "tiny", vision=True)
    assert json.loads((ckpt / "config.json").read_text())["image_token_id"] != PLACEHOLDER_ID
    return ckpt


def engine_for(ckpt, **cfg) -> Engine:
    return Engine(EngineConfig(model=str(ckpt), backend="cpu", **cfg))


def encoded(engine: Engine) -> tuple[int, int]:
    """Images the engine's tower encoded, and in how many calls."""
    m = engine.get_metrics()
    return m["images_encoded"], m["image_encoder_calls"]


def run(engine: Engine, requests: list[tuple[list[int], list[ImageSpan]]], params: SamplingParams) -> list:
    """Add every request (its spans set on every completion), step until all finish, return their outputs."""
    reqs = []
    for ids, spans in requests:
        req = engine.add_request(ids, params)
        assert req.error is None, req.error
        for r in req.siblings:
            r.images = tuple(spans)
        reqs.append(req)
    while engine.has_unfinished:
        engine.step()
    return [engine.output(r) for r in reqs]


def lp_of(out) -> list[float]:
    return [next(v.logprob for t, v in row.items() if t == tok) for row, tok in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=5, logprobs=1)


def test_a_span_split_across_chunks_equals_one_chunk(ckpt):
    spans = [image(10, 1), image(40, 2)]
    ids = prompt_with(spans)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=1, prompt_logprobs=1)
    whole = engine_for(ckpt, max_prefill_chunk=128, enable_prefix_caching=False)
    [a] = run(whole, [(ids, spans)], params)
    chunked = engine_for(ckpt, max_prefill_chunk=8, enable_prefix_caching=False)
    [b] = run(chunked, [(ids, spans)], params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    pa = [next(iter(r.values())).logprob for r in a.prompt_logprobs[1:]]
    pb = [next(iter(r.values())).logprob for r in b.prompt_logprobs[1:]]
    assert max(abs(x - y) for x, y in zip(pa, pb)) < 1e-4
    assert encoded(whole) == (2, 1) and encoded(chunked)[0] == 2  # each image encoded once, however it is chunked
    # and the image counts: the same ids with the placeholder's own embedding answer otherwise
    plain = engine_for(ckpt, max_prefill_chunk=128, enable_prefix_caching=False)
    [c] = run(plain, [(ids, [])], params)
    assert max(abs(x - y) for x, y in zip(lp_of(a), lp_of(c))) > 1e-3 or a.outputs[0].token_ids != c.outputs[0].token_ids


def test_images_of_two_requests_in_one_step_are_encoded_in_one_call(ckpt):
    engine = engine_for(ckpt, enable_prefix_caching=False)
    spans_a, spans_b = [image(5, 3)], [image(20, 4), image(50, 5)]
    outs = run(engine, [(prompt_with(spans_a), spans_a), (prompt_with(spans_b), spans_b)], GREEDY)
    assert encoded(engine) == (3, 1)
    alone = engine_for(ckpt, enable_prefix_caching=False)
    [b] = run(alone, [(prompt_with(spans_b), spans_b)], GREEDY)
    assert outs[1].outputs[0].token_ids == b.outputs[0].token_ids
    assert max(abs(x - y) for x, y in zip(lp_of(outs[1]), lp_of(b))) < 1e-4


def test_a_prefix_hit_over_an_image_reuses_it_and_another_image_misses(ckpt):
    spans = [image(10, 6)]
    ids = prompt_with(spans)
    follow = ids + [31, 32, 33, 34, 35]
    engine = engine_for(ckpt, swa_replay="exact")
    run(engine, [(ids, spans)], GREEDY)
    before = engine.get_metrics()["cached_tokens"]
    [hit] = run(engine, [(follow, spans)], GREEDY)
    assert engine.get_metrics()["cached_tokens"] - before >= 64
    assert encoded(engine) == (1, 1)  # the image's blocks are reused; nothing is encoded again
    cold = engine_for(ckpt, enable_prefix_caching=False)
    [ref] = run(cold, [(follow, spans)], GREEDY)
    assert hit.outputs[0].token_ids == ref.outputs[0].token_ids
    assert max(abs(x - y) for x, y in zip(lp_of(hit), lp_of(ref))) < 1e-4
    # the same ids with another image share no block that reaches into the span (block 0 already does)
    other = [image(10, 7)]
    before = engine.get_metrics()["cached_tokens"]
    [miss] = run(engine, [(follow, other)], GREEDY)
    assert engine.get_metrics()["cached_tokens"] == before and encoded(engine) == (2, 2)
    [ref_other] = run(cold, [(follow, other)], GREEDY)
    assert miss.outputs[0].token_ids == ref_other.outputs[0].token_ids


def test_preemption_and_parallel_sampling_with_images(ckpt):
    reqs = [(prompt_with(s, 60 + 4 * i), s) for i, s in enumerate([[image(4, 10 + i)] for i in range(4)])]
    engine = dict(enable_prefix_caching=False, max_num_seqs=4, max_model_len=96, max_prefill_chunk=16)
    roomy = engine_for(ckpt, **engine)
    want = [o.outputs[0].token_ids for o in run(roomy, reqs, GREEDY)]
    tight = engine_for(ckpt, **engine, kv_cache_memory=_budget(ckpt, slots=4, blocks=9))
    got = [o.outputs[0].token_ids for o in run(tight, reqs, GREEDY)]
    assert got == want and tight.get_metrics()["preemptions"] > 0
    forked = engine_for(ckpt, **engine)
    outs = run(forked, reqs[:2], SamplingParams(temperature=0.0, max_tokens=5, n=2))
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[want[0]] * 2, [want[1]] * 2]
    assert encoded(forked)[0] == 2  # the second completion copies the first one's state: no image again


def _budget(ckpt, slots: int, blocks: int) -> int:
    from deepinfer.loader import read_config
    from deepinfer.models.common import CacheGeometry, block_size_for
    from deepinfer.models.registry import parse_config

    config = parse_config(read_config(ckpt))
    g = CacheGeometry.build(config, block_size_for(config, 16), 16, 96)
    return slots * g.bytes_per_slot(torch.float32) + blocks * g.bytes_per_block(torch.float32)


# ---- the model: bias_vl and Engram at image positions ------------------------------------------------------


def _logits(model, ids: list[int], rows: list[int], embeds: torch.Tensor | None) -> torch.Tensor:
    cache = ContiguousCache(model.config, 1, 128, dtype=torch.float32)
    batch = Batch.build([ids], [cache.allocate()], [0], "all")
    cache.begin_forward(batch)
    inputs = step_inputs(batch, cache, "cpu")
    if rows:
        inputs.image_rows = torch.tensor(rows, dtype=torch.int64)
        inputs.image_embeds = embeds
    with torch.inference_mode():
        return model.forward(inputs, cache)


def test_image_positions_route_with_bias_vl_and_only_they(ckpt):
    model = load_model(ckpt, Kernels(), dtype=torch.float32)
    ids = TEXT[:40]
    rows = list(range(8, 22))
    embeds = model.embed[torch.tensor([ids[r] for r in rows])].clone()  # the same vectors: only routing can differ
    text_before, image_before = _logits(model, ids, [], None), _logits(model, ids, rows, embeds)
    for layer in model.layers:
        b = layer.ffn.bias_vl
        b.copy_(torch.where(torch.arange(b.numel()) % 3 == 0, 50.0, -50.0))  # image rows: experts 0, 3, 6
    text_after, image_after = _logits(model, ids, [], None), _logits(model, ids, rows, embeds)
    assert torch.equal(text_after, text_before)  # text never reads bias_vl
    assert torch.allclose(image_after[:8], image_before[:8], atol=1e-6)  # positions before the image: causal
    assert (image_after[8:] - image_before[8:]).abs().max() > 1e-3


def test_engram_adds_nothing_at_image_positions(tmp_path, ckpt):
    full = load_model(ckpt, Kernels(), dtype=torch.float32)
    silent = load_model(write_tiny_v41(tmp_path / "silent", engram_value_zero=True, vision=True), Kernels(), dtype=torch.float32)
    ids = TEXT[:24]
    rows = list(range(24))
    embeds = torch.tanh(torch.randn(24, full.config.hidden_size, generator=torch.Generator().manual_seed(9)))
    assert torch.allclose(_logits(full, ids, rows, embeds), _logits(silent, ids, rows, embeds), atol=1e-5)
    assert (_logits(full, ids, [], None) - _logits(silent, ids, [], None)).abs().max() > 1e-3


def test_block_hashes_cover_the_images_they_reach():
    from deepinfer.block_pool import chain_hashes

    ids = prompt_with([image(10, 1)], 48)
    a, b = [image(10, 1)], [image(10, 2)]
    ha, hb, plain = chain_hashes(ids, 16, images=a), chain_hashes(ids, 16, images=b), chain_hashes(ids, 16)
    assert ha[0] != hb[0] and ha[1] != hb[1] and ha[0] != plain[0]  # blocks 0 and 1 reach into [10, 24)
    # block 2 holds no image position but chains after them; hashed in pieces it is the same
    assert ha[:1] + chain_hashes(ids[16:], 16, parent=ha[0], images=a, first_position=16) == ha
    assert all(x != y for x, y in zip(ha, hb))  # a chain: every later block differs too

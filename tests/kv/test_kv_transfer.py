"""A request prefilled by one engine and decoded by another: the decode engine installs the prompt's whole
cache state (blocks and ring rows by position, the draft's context) and continues exactly where a
single engine would, computing no prompt token itself."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.kv_transfer import PrefilledRequest, handoff

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()
PROMPTS = [
    "def read_file(path):",
    " ".join(WORDS[i % len(WORDS)] for i in range(150)),  # past the 128-token window: the rings wrap
    " ".join(WORDS[(3 * i) % len(WORDS)] for i in range(420)),  # several compressed blocks of every ratio
]


def _run(engine, prompt_ids, params, **kwargs):
    req = engine.add_request(prompt_ids, params, **kwargs)
    while not req.all_finished:
        engine.step()
    return req


@pytest.fixture(scope="module", params=["dspark", None], ids=["speculative", "plain"])
def engines(request):
    spec = request.param
    colocated = LLM(backend="cpu", speculative_method=spec)
    prefill = LLM(backend="cpu", speculative_method=spec, max_prefill_chunk=96)  # other chunking, other ring margins
    decode = LLM(backend="cpu", speculative_method=spec, max_num_seqs=8)  # other slots, other block ids
    yield colocated, prefill.engine, decode.engine


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "wraps", "long"])
def test_decode_engine_continues_exactly_where_the_prefill_engine_stopped(engines, prompt):
    colocated, prefill, decode = engines
    ids = colocated.get_tokenizer().encode(prompt).ids
    expected = colocated.generate([ids], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]

    _run(decode, colocated.get_tokenizer().encode("warm the slot up with another sequence").ids,
         SamplingParams(temperature=0.0, max_tokens=8))  # a slot that held another sequence first
    first = _run(prefill, ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), hold_kv=True)
    handed = prefill.export_prefilled(first.request_id)
    prefill.release_prefilled(first.request_id)
    prefill.release([first.request_id])
    assert handed.output_token_ids == expected.token_ids[:1]
    assert handed.state.num_tokens == len(ids) and handed.state.nbytes > 0

    before = decode.stats.prefill_tokens
    got = _run(decode, ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), prefilled=handed)
    out = decode.output(got).outputs[0]
    decode.release([got.request_id])
    assert out.token_ids == expected.token_ids
    assert out.text == expected.text
    assert decode.stats.prefill_tokens == before  # not one prompt token computed on the decode side


def test_held_cache_is_kept_until_released(engines):
    _, prefill, _ = engines
    free = prefill.kv.pool.num_free
    req = _run(prefill, list(range(10, 90)), SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    assert req.request_id in prefill.kv.held and prefill.kv.pool.num_free < free
    prefill.release_prefilled(req.request_id)
    prefill.release([req.request_id])
    assert req.request_id not in prefill.kv.held and prefill.kv.pool.num_free == free
    with pytest.raises(DeepInferError, match="holds no cache to export"):
        prefill.export_prefilled(req.request_id)


def test_a_state_for_another_prompt_is_refused(engines):
    colocated, prefill, decode = engines
    first = _run(prefill, list(range(10, 60)), SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    handed = prefill.export_prefilled(first.request_id)
    prefill.release_prefilled(first.request_id)
    prefill.release([first.request_id])
    req = decode.add_request(list(range(10, 70)), SamplingParams(max_tokens=4), prefilled=handed)
    assert req.finished and "holds 50 positions but the prompt has 60 tokens" in req.error
    decode.release([req.request_id])


def test_installed_state_reads_back_the_same(engines):
    """Written into another engine's slot and blocks, every part of the state (rings by position, blocks,
    the draft's context) reads back as it was exported."""
    colocated, prefill, decode = engines
    ids = colocated.get_tokenizer().encode(PROMPTS[1]).ids
    first = _run(prefill, ids, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    state = prefill.export_prefilled(first.request_id).state
    prefill.release_prefilled(first.request_id)
    prefill.release([first.request_id])
    blocks = decode.kv.pool.allocate(len(state.blocks))
    slot = decode.kv._free_slots[0]
    try:
        decode.runner.install_sequence(slot, blocks, state)
        back = decode.runner.read_sequence(slot, blocks, state.num_tokens)
    finally:
        decode.kv.pool.release(blocks)
    assert [[t.equal(u) for t, u in zip(a, b)] for a, b in zip(back.blocks, state.blocks)] == [[True] * len(a) for a in state.blocks]
    def same_tail(got, sent) -> bool:  # the positions both rings hold (a larger ring reads older rows it was never given)
        keep = min(len(got.positions), len(sent.positions))
        return keep > 0 and (got.positions[-keep:] == sent.positions[-keep:]).all() and got.data[-keep:].equal(sent.data[-keep:])

    assert all(same_tail(got, sent) for got, sent in zip(back.window, state.window))
    for got, sent in zip(back.states, state.states):
        assert got.keys() == sent.keys()
        assert all(same_tail(g, s) for branch in got for g, s in zip(got[branch], sent[branch]))
    if state.draft is None:
        assert back.draft is None
    else:
        assert len(state.draft.ctx_positions) > 0
        order = lambda p: p.argsort()  # noqa: E731 - rows come back in ring order
        assert (back.draft.ctx_positions[order(back.draft.ctx_positions)] == state.draft.ctx_positions[order(state.draft.ctx_positions)]).all()
        assert back.draft.ctx[order(back.draft.ctx_positions)].equal(state.draft.ctx[order(state.draft.ctx_positions)])
        assert back.draft.kv[:, order(back.draft.kv_positions)].equal(state.draft.kv[:, order(state.draft.kv_positions)])


@pytest.mark.slow
def test_a_state_crosses_expert_parallel_degrees():
    """Prefill on an EP 2 group (the rank that ran it exports its state with its last report), decode on an EP 2
    group: the colocated single engine's tokens, and no prompt token computed on the decode side."""
    colocated = LLM(backend="cpu")
    ids = colocated.get_tokenizer().encode(PROMPTS[1]).ids
    expected = colocated.generate([ids], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    prefill = LLM(backend="cpu", expert_parallel_size=2)
    try:
        first = _run(prefill.engine, ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), hold_kv=True)
        handed = prefill.engine.export_prefilled(first.request_id)
        prefill.engine.release_prefilled(first.request_id)
        with pytest.raises(DeepInferError, match="holds no cache to export"):
            prefill.engine.export_prefilled(first.request_id)
    finally:
        prefill.engine.close()
    assert handed.output_token_ids == expected.token_ids[:1] and handed.state.num_tokens == len(ids)
    decode = LLM(backend="cpu", expert_parallel_size=2)
    try:
        got = _run(decode.engine, ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), prefilled=handed)
        assert decode.engine.output(got).outputs[0].token_ids == expected.token_ids
        assert decode.engine.get_metrics()["prefill_tokens"] == 0
    finally:
        decode.engine.close()


@pytest.mark.parametrize("spec", ["dspark", None], ids=["speculative", "plain"])
def test_v41_state_crosses_engines(tmp_path, spec):
    """V4.1: shared compressed pools, ratio-1/2 compressor rings, the Engram token history and its draft's context
    carry over; only the positions a step reads again travel (the prefill side's step margin does not)."""
    from tests.helpers.tiny_v41_draft import write_tiny_v41_draft

    ckpt = str(write_tiny_v41_draft(tmp_path / "tiny"))
    colocated = LLM(model=ckpt, backend="cpu", speculative_method=spec)
    prefill = LLM(model=ckpt, backend="cpu", speculative_method=spec, max_prefill_chunk=24)
    decode = LLM(model=ckpt, backend="cpu", speculative_method=spec, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for ids in ([(37 * i + 11) % 4000 + 5 for i in range(61)], [5, 6, 7]):
        expected = colocated.generate([ids], params)[0].outputs[0]
        first = _run(prefill.engine, ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), hold_kv=True)
        handed = prefill.engine.export_prefilled(first.request_id)
        prefill.engine.release_prefilled(first.request_id)
        prefill.engine.release([first.request_id])
        geometry = prefill.engine.runner.cache.geometry
        assert all(len(rows.positions) <= geometry.sliding_window - 1 for rows in handed.state.window)
        got = _run(decode.engine, ids, params, prefilled=handed)
        assert decode.engine.output(got).outputs[0].token_ids == expected.token_ids
        decode.engine.release([got.request_id])


def _handed(engine, ids):
    """The state ``engine`` prefilled for ``ids`` (its cache released)."""
    first = _run(engine, ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), hold_kv=True)
    handed = engine.export_prefilled(first.request_id)
    engine.release_prefilled(first.request_id)
    engine.release([first.request_id])
    return handed


def _predicted_bytes(engine, state) -> tuple[int, int]:
    """What the cache geometry says ``state`` holds: its blocks and window rows, and the rest (compressor states,
    token history) in their pools' element sizes."""
    g, dtype, cache = engine.runner.geometry, engine.runner.dtype, engine.runner.cache
    kv = len(state.blocks) * g.bytes_per_block(dtype)
    kv += sum(len(rows.positions) * g.window_row_bytes(g.specs[lt], dtype) for rows, lt in zip(state.window, g.layer_types))
    rest = 0
    for i, layer in enumerate(state.states):
        for branch, pair in layer.items():
            for rows, pool in zip(pair, cache.state_pool(i, branch)):
                rest += len(rows.positions) * pool.shape[1] * pool.element_size()
    rest += len(state.history.positions) * 8 if state.history is not None else 0
    return kv, rest


def test_fp8_state_moves_as_records_and_continues_exactly():
    """kv_cache_dtype fp8 on both sides: blocks and window rows travel as the records the cache holds (never
    decoded), the decode engine continues as a colocated fp8 engine does, and the state is smaller than the
    model-dtype one by what the geometry predicts; a decode engine that stores rows otherwise refuses it."""
    import torch

    colocated = LLM(backend="cpu", kv_cache_dtype="fp8", speculative_method=None)
    prefill = LLM(backend="cpu", kv_cache_dtype="fp8", speculative_method=None, max_prefill_chunk=96).engine
    decode = LLM(backend="cpu", kv_cache_dtype="fp8", speculative_method=None, max_num_seqs=8).engine
    plain = LLM(backend="cpu", kv_cache_dtype="model", speculative_method=None, max_prefill_chunk=96).engine
    assert prefill.runner.cache.formats.name == "fp8" and plain.runner.cache.formats.name == "model"
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tok = colocated.get_tokenizer()
    ratios = []
    for prompt in PROMPTS[1:]:
        ids = tok.encode(prompt).ids
        expected = colocated.generate([ids], params)[0].outputs[0]
        handed = _handed(prefill, ids)
        s = handed.state
        assert s.blocks and all(t.dtype == torch.uint8 for block in s.blocks for t in block)
        assert all(rows.data.dtype == torch.uint8 and rows.data.shape[1] == 52 for rows in s.window)  # 16 FP8 + 16 bf16 rope + 1 scale, padded
        before = decode.stats.prefill_tokens
        got = _run(decode, ids, params, prefilled=handed)
        assert decode.output(got).outputs[0].token_ids == expected.token_ids
        assert decode.stats.prefill_tokens == before
        decode.release([got.request_id])

        as_model = _handed(plain, ids)
        kv8, rest8 = _predicted_bytes(prefill, s)
        kvm, restm = _predicted_bytes(plain, as_model.state)
        assert s.nbytes == kv8 + rest8 and as_model.state.nbytes == kvm + restm
        assert len(s.blocks) == len(as_model.state.blocks) and rest8 == restm  # float32 compressor states either way
        assert kvm / kv8 > 2.4  # 128-byte float32 window rows against 52-byte records; blocks alike
        ratios.append(s.nbytes / as_model.state.nbytes)
        payload, _ = handoff.encode(handed)
        assert len(payload) < len(handoff.encode(as_model)[0])

        refused = plain.add_request(ids, params, prefilled=handed)
        assert refused.finished and "start the prefill and decode engines with the same --kv-cache-dtype" in refused.error
        assert "stores rows as fp8: window v4.kv.fp8 (52 B, ue8m0 scales)" in refused.error and "model (plain rows" in refused.error
        plain.release([refused.request_id])
        # records of the same size with other scales (a float-scaled checkpoint under auto) are not these records either
        other = {**s.storage, "window": {**s.storage["window"], "scale": "fp32"}, "entry": {**s.storage["entry"], "scale": "fp32"}}
        refused = decode.add_request(ids, params, prefilled=PrefilledRequest(replace(s, storage=other), handed.output_token_ids))
        assert refused.finished and "window v4.kv.fp8 (52 B, fp32 scales)" in refused.error
        decode.release([refused.request_id])
    assert all(r < 0.55 for r in ratios)  # the float32 compressor states travel as they are

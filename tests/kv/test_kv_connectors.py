"""The KV connectors as plugins: discovered through their entry points, and moving a prefilled request's
state between processes (Mooncake's transfer engine over TCP, a shared directory) with its size and
checksum checked before anything decodes from it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.kv_transfer import handoff
from deepinfer.registry import discover, load_part
from deepinfer.sampling_params import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_thread")


def test_both_connectors_are_discovered_and_available():
    found = discover("kv_connectors")
    assert {"mooncake", "store"} <= set(found)
    for name in ("mooncake", "store"):
        assert found[name].error is None
        assert found[name].obj.is_available() == (True, None), found[name].obj.is_available()
    with pytest.raises(Exception, match="unknown kv_connector 'nixl'"):
        load_part("kv_connectors", "nixl")


@pytest.fixture(scope="module")
def prefilled():
    llm = LLM(backend="cpu")
    engine = llm.engine
    ids = llm.get_tokenizer().encode("def read_file(path):\n    with open(path) as f:").ids
    req = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    while not req.all_finished:
        engine.step()
    out = engine.export_prefilled(req.request_id)
    engine.release_prefilled(req.request_id)
    return out


def test_payload_round_trip_and_refusals(prefilled):
    payload, meta = handoff.encode(prefilled)
    back = handoff.decode(payload, meta)
    assert back.output_token_ids == prefilled.output_token_ids and back.state.num_tokens == prefilled.state.num_tokens
    assert all(a.equal(b) for x, y in zip(back.state.blocks, prefilled.state.blocks) for a, b in zip(x, y))
    with pytest.raises(InvalidRequestError, match="fails its checksum"):
        handoff.decode(payload[:-1] + bytes([payload[-1] ^ 1]), meta)
    with pytest.raises(InvalidRequestError, match="bytes, not the"):
        handoff.decode(payload[:-10], meta)


def test_store_connector_through_a_directory(prefilled, tmp_path):
    store = load_part("kv_connectors", "store")
    prefill_side, decode_side = store({"directory": str(tmp_path)}), store({"directory": str(tmp_path)})
    payload, meta = handoff.encode(prefilled)
    location = json.loads(json.dumps(prefill_side.publish("req-1", payload)))  # it travels as JSON
    assert handoff.decode(decode_side.fetch(location, meta.nbytes), meta).output_token_ids == prefilled.output_token_ids
    prefill_side.release("req-1")
    with pytest.raises(Exception, match="cannot read the transferred KV state"):
        decode_side.fetch(location, meta.nbytes)


#: a prefill side in a process of its own: publishes what it reads on stdin, then waits to be read from
PUBLISHER = textwrap.dedent("""
    import json, sys, time
    from deepinfer.registry import load_part
    payload = sys.stdin.buffer.read()
    side = load_part("kv_connectors", "mooncake")({"host": "127.0.0.1"})
    print(json.dumps(side.publish("req-1", payload)), flush=True)
    time.sleep(120)
""")


def test_mooncake_reads_from_another_process(prefilled):
    payload, meta = handoff.encode(prefilled)
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
        location = json.loads(proc.stdout.readline())
        reader = load_part("kv_connectors", "mooncake")({"host": "127.0.0.1"})
        got = reader.fetch(location, meta.nbytes)
        assert got == payload
        with pytest.raises(Exception, match="another decode server read it"):
            reader.fetch(location, meta.nbytes)  # read once: marked read, never handed out twice
        assert handoff.decode(got, meta).state.num_tokens == prefilled.state.num_tokens
        proc.kill()
        proc.wait(10)
        with pytest.raises(Exception, match="failed|status"):
            reader.fetch(location, meta.nbytes)  # the prefill side is gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("kv_cache_dtype", ["model", "fp8"])
def test_mooncake_reads_the_prefill_pools_in_place(kv_cache_dtype):
    """The prefill side registers its pools once and publishes a manifest; the decode side reads exactly the
    request's rows in one batch (a packed cache's records as they lie in its regions), the decode engine continues
    as a single engine would, and the prefill side's blocks are freed once the decode side says it has read them."""
    from deepinfer.kv_transfer.handoffs import Handoffs

    kw = dict(backend="cpu", kv_cache_dtype=kv_cache_dtype)
    colocated, prefill, decode = LLM(**kw), LLM(**kw, max_prefill_chunk=32), LLM(**kw, max_num_seqs=4)
    ids = colocated.get_tokenizer().encode(" ".join(f"word{i % 37}" for i in range(150))).ids
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = colocated.generate([ids], params)[0].outputs[0].token_ids
    connector = load_part("kv_connectors", "mooncake")
    sender, receiver = Handoffs(connector({"host": "127.0.0.1"}), 60.0), Handoffs(connector({"host": "127.0.0.1"}), 60.0)
    try:
        req = prefill.engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), hold_kv=True)
        while not req.all_finished:
            prefill.engine.step()
        transfer = json.loads(json.dumps(sender.publish(prefill.engine, req.request_id)))
        assert transfer["location"]["segments"] > 0 and req.request_id in prefill.engine.kv.held  # still in the pools
        pool_bytes = sum(t.numel() * t.element_size() for t in prefill.engine.transfer_pools())

        tampered = {**transfer, "checksum": "0" * 32}
        with pytest.raises(InvalidRequestError, match="checksum"):
            receiver._fetch(tampered)
        assert req.request_id in prefill.engine.kv.held and not sender.connector.fetched(req.request_id)  # refused unread
        got, nbytes, _ = receiver._fetch(transfer)
        assert 0 < nbytes < pool_bytes / 4  # the request's rows, not the pools
        sender.expire()
        assert req.request_id not in prefill.engine.kv.held and not sender.published  # read: its blocks are free
        assert sender.stats.kv_transfers_expired == 0

        out = decode.engine.add_request(ids, params, prefilled=got)
        while not out.all_finished:
            decode.engine.step()
        assert decode.engine.output(out).outputs[0].token_ids == expected
    finally:
        sender.close()
        receiver.close()

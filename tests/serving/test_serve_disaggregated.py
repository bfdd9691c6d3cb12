"""Prefill and decode in separate servers, the KV state handed over by a connector: through vLLM's router
unchanged, the outputs are a colocated server's; the decode server computes no prompt token; a transfer
that cannot be made fails its request alone."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.helpers.servers import free_port, running_server
from tests.helpers.disaggregation import BODY, PROMPTS, metric, prefill_then_decode
from tests.helpers.routers import routing, sglang_router_command, vllm_router_command

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def colocated():
    with running_server([]) as srv:
        yield srv


@pytest.fixture(scope="module")
def pd_pair():
    """A prefill server at EP 1 (its bootstrap port open for SGLang's router) and a decode server at EP 2 that
    verifies every drafted token (speculation crosses the split), over the default connector (Mooncake)."""
    boot = free_port()
    with running_server(["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(boot)]) as prefill, \
            running_server(["--disaggregation-mode", "decode", "--ep", "2", "--speculative-policy", "all"]) as decode:
        yield prefill, boot, decode


def _streamed_chat(url: str, chat: dict) -> str:
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    return text


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}


def _check_split(url: str, colocated_url: str, decode_url: str) -> None:
    """Through the router: greedy completions, a seeded sampled one, a streamed chat and a schema-constrained chat
    equal the colocated server's; the decode server computed no prompt token and verified drafted tokens."""
    computed = metric(decode_url, "prefill_tokens_computed_total")
    drafted = metric(decode_url, "spec_decode_num_draft_tokens_total")
    for prompt in PROMPTS:
        expected = httpx.post(colocated_url + "/v1/completions", json={**BODY, "prompt": prompt}, timeout=120).json()
        got = httpx.post(url + "/v1/completions", json={**BODY, "prompt": prompt}, timeout=120)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    seeded = {**BODY, "prompt": PROMPTS[0], "temperature": 0.8, "seed": 20261207}  # the split draws what colocated draws
    expected = httpx.post(colocated_url + "/v1/completions", json=seeded, timeout=120).json()
    got = httpx.post(url + "/v1/completions", json=seeded, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    chat = {**BODY, "messages": [{"role": "user", "content": "Write a haiku about tea."}], "max_tokens": 16}
    expected = httpx.post(colocated_url + "/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]["message"]["content"]
    assert _streamed_chat(url, chat) == expected
    shaped = {**chat, "ignore_eos": False, "max_tokens": 48,
              "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    expected = httpx.post(colocated_url + "/v1/chat/completions", json=shaped, timeout=120).json()["choices"][0]["message"]["content"]
    got = httpx.post(url + "/v1/chat/completions", json=shaped, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == expected
    assert expected.startswith('{"name"')  # the grammar held (the tiny model's JSON may run past max_tokens)
    assert metric(decode_url, "prefill_tokens_computed_total") == computed  # the decode server computed no prompt
    assert metric(decode_url, "spec_decode_num_draft_tokens_total") > drafted  # and drafted across the split
    assert metric(decode_url, "kv_transfers_total") >= 4 and metric(decode_url, "kv_transfer_bytes_total") > 0


def test_vllm_router_pd_mode_gives_the_colocated_outputs(colocated, pd_pair, tmp_path):
    """vLLM's router: prefill gets max_tokens 1 and do_remote_decode, decode gets the prefill's kv_transfer_params."""
    prefill, _, decode = pd_pair
    with routing([*vllm_router_command(), "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url],
                 tmp_path / "router.log") as url:
        _check_split(url, colocated.url, decode.url)


def test_store_connector_through_a_shared_directory(colocated, tmp_path):
    shared = ["--kv-connector", "store", "--kv-store", str(tmp_path / "shared")]
    with running_server(["--disaggregation-mode", "prefill", *shared]) as prefill, \
            running_server(["--disaggregation-mode", "decode", *shared]) as decode:
        expected = httpx.post(colocated.url + "/v1/completions", json={**BODY, "prompt": PROMPTS[1]}, timeout=120).json()
        got = prefill_then_decode(prefill.url, decode.url, PROMPTS[1])
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == expected["choices"][0]["text"]


def test_faults_fail_their_request_alone(tmp_path):
    shared = ["--kv-connector", "store", "--kv-store", str(tmp_path / "shared")]
    with running_server(["--disaggregation-mode", "prefill", "--kv-transfer-timeout", "1", *shared]) as prefill, \
            running_server(["--disaggregation-mode", "decode", *shared]) as decode:
        # a decode request without a prefill server's parameters
        bare = httpx.post(decode.url + "/v1/completions", json={**BODY, "prompt": "hi"}, timeout=60)
        assert bare.status_code == 400 and bare.json()["error"]["param"] == "kv_transfer_params"
        # a state nobody fetched in time is released: its late decode fails with 500, naming the transfer
        late = prefill_then_decode(prefill.url, decode.url, PROMPTS[0], before_decode=lambda: time.sleep(4))
        assert late.status_code == 500 and "KV transfer" in late.json()["error"]["message"], late.text
        assert metric(prefill.url, "kv_transfers_expired_total") >= 1
        assert metric(decode.url, "kv_transfer_failures_total") >= 1
        # a corrupted transfer is refused, never decoded from
        first = httpx.post(prefill.url + "/v1/completions", json={**BODY, "prompt": PROMPTS[0], "max_tokens": 1,
                                                                  "kv_transfer_params": {"do_remote_decode": True}}, timeout=60).json()
        params = {**first["kv_transfer_params"], "checksum": "0" * 32}
        bad = httpx.post(decode.url + "/v1/completions", json={**BODY, "prompt": PROMPTS[0], "kv_transfer_params": params}, timeout=60)
        assert bad.status_code == 500 and "checksum" in bad.json()["error"]["message"]
        # and the decode server goes on serving, its cache all free again
        ok = prefill_then_decode(prefill.url, decode.url, PROMPTS[0])
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
        assert metric(decode.url, "kv_cache_usage_perc") == 0


def test_sglang_router_pd_mode_meets_on_the_bootstrap_room(colocated, pd_pair, tmp_path):
    """SGLang's router sends each request to both servers with a bootstrap room; the decode server asks the prefill
    server's bootstrap port for the room's state."""
    prefill, boot, decode = pd_pair
    with routing([*sglang_router_command(), "--pd-disaggregation", "--prefill", prefill.url, str(boot), "--decode", decode.url],
                 tmp_path / "router.log") as url:
        _check_split(url, colocated.url, decode.url)


def test_recompute_policy_prefills_a_failed_transfer_on_the_decode_side(colocated, tmp_path):
    """``--kv-load-failure-policy recompute``: a state that expired, or a bootstrap port nobody answers, costs the
    decode server the prompt instead of failing the request; the output is still the colocated one."""
    shared = ["--kv-connector", "store", "--kv-store", str(tmp_path / "shared")]
    with running_server(["--disaggregation-mode", "prefill", "--kv-transfer-timeout", "1", *shared]) as prefill, \
            running_server(["--disaggregation-mode", "decode", "--kv-load-failure-policy", "recompute", *shared]) as decode:
        expected = httpx.post(colocated.url + "/v1/completions", json={**BODY, "prompt": PROMPTS[1]}, timeout=120).json()
        computed = metric(decode.url, "prefill_tokens_computed_total")
        late = prefill_then_decode(prefill.url, decode.url, PROMPTS[1], before_decode=lambda: time.sleep(4))
        assert late.status_code == 200, late.text
        assert late.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        assert metric(decode.url, "kv_transfers_recomputed_total") == 1
        assert metric(decode.url, "prefill_tokens_computed_total") > computed
        orphan = httpx.post(decode.url + "/v1/completions", json={
            **BODY, "prompt": PROMPTS[1], "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 7}, timeout=120)
        assert orphan.status_code == 200, orphan.text
        assert orphan.json()["choices"][0]["text"] == expected["choices"][0]["text"]

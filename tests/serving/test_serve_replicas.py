"""Replicas of ``deepinfer serve`` side by side: the render endpoints vLLM's router tokenizes with, the routers'
cache-aware policy keeping each shared prefix on one replica (a higher prefix-cache hit rate over the replicas
than round robin), and replicas on one KV store serving each other's prefixes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from benchmarks.common import load_script
from deepinfer.chat import chat_format_for, format_chat
from deepinfer.loader.tokenizer import load_tokenizer
from tests.helpers.servers import ServerPool

pytestmark = pytest.mark.slow

bench = load_script("replica_routing")
MODEL = bench.MODEL
#: three prefix groups over two replicas: round robin sends every group's prompts to both
GROUPS, PER_GROUP, PREFIX_WORDS = 3, 4, 160
#: a group's shared prefix fills at least this many KV blocks
MIN_PREFIX_BLOCKS = 8
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a haiku about tea."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
#: seconds the KV store's writer thread may take to land a prompt's blocks
STORE_WRITE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two colocated replicas, each with its own prefix cache; their access logs show what a router asked them."""
    with ServerPool(tmp_path_factory.mktemp("replicas")) as pool:
        yield bench.start_replicas(pool, 2, "--access-log", together=True)


@pytest.fixture(scope="module")
def store_replicas(tmp_path_factory):
    """Two replicas on one KV store directory; exact replay, so a prefix from the store gives a cold run's tokens."""
    store = tmp_path_factory.mktemp("kv-store")
    with ServerPool(tmp_path_factory.mktemp("store-replicas")) as pool:
        yield store, bench.start_replicas(pool, 2, "--kv-store", str(store), "--swa-replay", "exact", together=True)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    """``body`` POSTed to the replica at ``url``."""
    return httpx.post(url + path, json=body, timeout=120)


def _block_size(url: str) -> int:
    """The replica's KV block size (tokens), from its engine configuration."""
    return httpx.get(url + "/server_info", timeout=30).json()["engine_config"]["block_size"]


def _settled_block_files(store: Path, at_least: int) -> int:
    """Block files in the store once there are ``at_least`` and their count holds still (the writer thread is done)."""
    deadline = time.monotonic() + STORE_WRITE_TIMEOUT_S
    seen = -1
    while True:
        count = sum(1 for _ in store.rglob("*.kvb"))
        if count >= at_least and count == seen:
            return count
        assert time.monotonic() < deadline, f"the store holds {count} block files, {at_least} expected"
        seen = count
        time.sleep(0.5)


# ----- the render endpoints -----


def test_completion_render_gives_what_tokenize_gives(replicas):
    url = replicas[0].url
    prompts = ["def read_file(path):", "The capital of France is"]
    expected = [_post(url, "/tokenize", {"prompt": p}).json()["tokens"] for p in prompts]
    one = _post(url, "/v1/completions/render", {"model": MODEL, "prompt": prompts[0], "max_tokens": 4})
    assert one.status_code == 200, one.text
    assert [r["token_ids"] for r in one.json()] == expected[:1] and one.json()[0]["model"] == MODEL
    many = _post(url, "/v1/completions/render", {"model": MODEL, "prompt": prompts}).json()
    assert [r["token_ids"] for r in many] == expected and len({r["request_id"] for r in many}) == 2
    assert [r["token_ids"] for r in _post(url, "/v1/completions/render", {"prompt": expected}).json()] == expected
    assert _post(url, "/v1/completions/render", {"prompt": expected[1]}).json()[0]["token_ids"] == expected[1]
    used = _post(url, "/v1/completions", {"model": MODEL, "prompt": prompts, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert used == sum(map(len, expected))


def test_chat_render_gives_the_chat_templates_tokens(replicas):
    url = replicas[0].url
    info = httpx.get(url + "/server_info", timeout=30).json()
    tokenizer = load_tokenizer(info["model_path"])
    fmt = chat_format_for(info["model_path"], tokenizer, info["model_type"])
    plain = format_chat(fmt, tokenizer, CONVERSATION)[0].token_ids
    got = _post(url, "/v1/chat/completions/render", {"model": MODEL, "messages": CONVERSATION})
    assert got.status_code == 200, got.text
    assert got.json()["token_ids"] == plain and got.json()["model"] == MODEL
    assert _post(url, "/tokenize", {"messages": CONVERSATION}).json()["tokens"] == plain
    # the chat endpoint's own rendering: declared tools and template arguments change the prompt
    body = {"messages": CONVERSATION, "tools": TOOLS, "chat_template_kwargs": {"thinking": True}}
    rich = format_chat(fmt, tokenizer, CONVERSATION, tools=TOOLS, kwargs={"thinking": True})[0].token_ids
    assert rich != plain and _post(url, "/v1/chat/completions/render", body).json()["token_ids"] == rich
    assert _post(url, "/tokenize", body).json()["tokens"] == rich  # /tokenize renders messages the same way
    used = _post(url, "/v1/chat/completions", {**body, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert used == len(rich)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions/render", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions/render", {"prompt": "word " * 2000}, 400, "prompt"),
    ("/v1/completions/render", {"prompt": [10 ** 7]}, 400, "prompt"),
    ("/v1/completions/render", {"prompt": []}, 400, "prompt"),
    ("/v1/chat/completions/render", {"model": "nope", "messages": CONVERSATION}, 404, "model"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "messages"),
    ("/v1/chat/completions/render", {"messages": CONVERSATION, "continue_final_message": True}, 400, "messages"),
    ("/v1/chat/completions/render", {"messages": "hi"}, 400, "messages"),
])
def test_render_refuses_what_the_completion_refuses(replicas, path, body, status, param):
    url = replicas[0].url
    for where in (path, path.removesuffix("/render")):
        r = _post(url, where, body)
        assert r.status_code == status, (where, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error", (where, r.text)


# ----- replicas behind a router -----


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_cache_aware_routing_hits_more_than_round_robin(kind, replicas, tmp_path):
    items = bench.make_workload(GROUPS, PER_GROUP, PREFIX_WORDS)
    block = _block_size(replicas[0].url)
    tokens, ideal = bench.ideal_hits(replicas[0].url, items, block)
    assert ideal >= GROUPS * (PER_GROUP - 1) * MIN_PREFIX_BLOCKS * block, "each group's prefix fills several KV blocks"
    logged = [len(s.log_text()) for s in replicas]
    rr = bench.run_policy(kind, "round_robin", replicas, items, tmp_path)
    ca = bench.run_policy(kind, "cache_aware", replicas, items, tmp_path)
    assert rr.queries == ca.queries == tokens
    assert min(rr.per_replica_queries) > 0, rr  # round robin used both replicas
    assert ca.hit_rate > rr.hit_rate, (ca, rr)
    assert ca.hits == ideal, ca  # every prompt after its group's first hit the group's whole shared prefix
    if kind == "vllm":  # vLLM's router tokenized with the render endpoint, never falling back to /tokenize
        asked = "".join(s.log_text()[n:] for s, n in zip(replicas, logged))
        assert '"POST /v1/completions/render HTTP/1.1" 200' in asked and "/tokenize" not in asked


# ----- replicas on one KV store -----


def test_a_prefix_one_replica_computed_is_a_store_hit_on_another(store_replicas):
    store, (a, b) = store_replicas
    prompt = bench.make_workload(1, 1, PREFIX_WORDS)[0].prompt
    block = _block_size(a.url)
    reusable = (len(bench.render_ids(a.url, prompt)) - 1) // block  # a prompt's last token is always computed
    assert reusable >= MIN_PREFIX_BLOCKS
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    first = _post(a.url, "/v1/completions", body)
    assert first.status_code == 200, first.text
    _settled_block_files(store, reusable)
    before = bench.counters(b.url)
    second = _post(b.url, "/v1/completions", body)
    after = bench.counters(b.url)
    assert second.status_code == 200, second.text
    assert after["kv_store_hits"] - before["kv_store_hits"] == reusable * block
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]

"""``deepinfer serve`` with a warm profile cache: no start-up profiling, ready within a bound of its quiet time,
and the deltas it streams add up to what the same request returns whole."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.helpers.servers import ServerProcess

#: seconds a warm start may take: five times its quiet time on a 2-core CPU (about 4 s, the bound being 5 s)
WARM_START_BOUND_S = 25.0


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A first server fills a fresh profile cache; a second one, timed, starts from it."""
    cache = tmp_path_factory.mktemp("cache")
    env = {"DEEPINFER_CACHE_DIR": str(cache)}
    first = ServerProcess(env=env, log_dir=tmp_path_factory.mktemp("first"))
    try:
        first.start()
    finally:
        first.close()
    server = ServerProcess(env=env, log_dir=tmp_path_factory.mktemp("warm"))
    t0 = time.perf_counter()
    try:
        server.start()
        server.ready_s = time.perf_counter() - t0
        server.first_log = first.log_text()
        yield server
    finally:
        server.close()


def test_a_warm_start_measures_no_profile_and_is_quick(warm):
    assert "step-cost profile" in warm.first_log  # the first start measured (the cache was empty) ...
    deadline = time.monotonic() + 30  # /health answers a moment before the ready line reaches the log
    while "ready: serving" not in (log := warm.log_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "ready: serving" in log and "profile" not in log, log  # ... the second read it back
    assert warm.ready_s < WARM_START_BOUND_S


def _stream_text(url: str, body: dict) -> tuple[dict[int, str], int, int]:
    """Each choice's streamed text, the chunks with text, and the usage's completion tokens."""
    texts: dict[int, str] = {}
    chunks = tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                chunks += 1
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return texts, chunks, tokens


def test_streamed_deltas_add_up_to_the_whole_reply(warm):
    """Two completions (seeded sampling), a stop string and log-probabilities: the streamed pieces join into
    the non-streamed texts, one chunk at most per token."""
    base = {"prompt": "the market and the river", "max_tokens": 24, "n": 2, "temperature": 0.9, "seed": 11, "logprobs": 1}
    whole = httpx.post(warm.url + "/v1/completions", json=base, timeout=120).json()
    expected = {c["index"]: c["text"] for c in whole["choices"]}
    texts, chunks, tokens = _stream_text(warm.url, base)
    assert texts == expected
    assert tokens == whole["usage"]["completion_tokens"] and chunks <= tokens + 2
    stop = expected[0][len(expected[0]) // 2:][:3]
    if stop.strip():
        cut = httpx.post(warm.url + "/v1/completions", json={**base, "stop": [stop]}, timeout=120).json()
        texts, _, _ = _stream_text(warm.url, {**base, "stop": [stop]})
        assert texts == {c["index"]: c["text"] for c in cut["choices"]}
        assert stop not in texts[0]

"""``deepinfer serve`` fuzzed from its own OpenAPI schema (schemathesis + hypothesis): a few hundred generated
requests, valid and invalid, to every endpoint of one running server. None may get a 5xx, every refusal is
OpenAI's error object (Anthropic's on the Messages endpoints), and afterwards the server is healthy, idle, and its engine no larger than the bound."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from tests.helpers.process_tree import children
from tests.helpers.servers import ServerProcess, running_server

MODEL = "tiny-v4"
#: the server's bounds: small, so that generated requests that reach the engine stay cheap
ARGS = ["--max-model-len", "48", "--max-n", "3", "--max-logprobs", "4", "--served-model-name", MODEL]
#: examples per operation and mode (20 operations, valid and invalid bodies: a few hundred requests), more
#: valid ones for the endpoints that run the engine
EXAMPLES = 18
GENERATING_EXAMPLES = 45
#: seconds one generated request may take (a loaded two-core machine)
TIMEOUT_S = 120.0
#: the engine process may grow by this factor (plus a fixed allowance) over the fuzzing
RSS_GROWTH = 1.25
RSS_ALLOWANCE_KB = 64 << 10
#: a valid conversation and prompt, put into some bodies so that their sampling fields reach the engine
USER = [{"role": "user", "content": "Say hello."}]
PROMPT = "def read_file(path):"
#: the endpoints that run the engine
GENERATING = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    with running_server(ARGS, log_dir=tmp_path_factory.mktemp("fuzz")) as srv:
        yield srv


def _engine_pid(server_pid: int) -> int:
    """The engine process: the server's child running the engine (multiprocessing's spawn main)."""
    for child in children(server_pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"multiprocessing.spawn" in cmdline and b"resource_tracker" not in cmdline:
            return child
    raise AssertionError(f"the server {server_pid} has no engine process")


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _realistic(body: Any, path: str) -> Any:
    """Some generated bodies name the served model and carry a valid conversation, so that the sampling
    fields around them reach the engine instead of stopping at a 404 or a malformed message."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if "model" in body:
        body["model"] = MODEL
    if path.startswith("/v1/chat/completions"):
        body["messages"] = USER
    if path.startswith("/v1/completions"):
        body["prompt"] = PROMPT
    if path == "/v1/responses":
        body["input"] = USER
    if path.startswith("/v1/messages"):
        body["messages"] = USER
    return body


def _check(response: requests.Response, seen: Counter, path: str) -> None:
    status = response.status_code
    seen[status] += 1
    seen[(path, status)] += 1
    assert status < 500, f"{response.request.method} {response.request.url} -> {status}: {response.text[:500]}"
    if status >= 400:
        body = response.json()
        error = body.get("error")
        assert isinstance(error, dict), response.text[:500]
        assert isinstance(error.get("message"), str) and error["message"] and "\n" not in error["message"], error
        if path.startswith("/v1/messages"):  # Anthropic's error object
            assert body.get("type") == "error" and isinstance(error.get("type"), str), body
        else:
            assert error.get("code") == status and isinstance(error.get("type"), str), error


@pytest.mark.slow
def test_generated_requests_get_no_server_error(server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_dict(httpx.get(server.url + "/openapi.json", timeout=30).json())
    engine = _engine_pid(server.pid)
    httpx.post(server.url + "/v1/completions", json={"prompt": "def f(", "max_tokens": 8}, timeout=TIMEOUT_S).raise_for_status()
    rss_start = _rss_kb(engine)
    seen: Counter = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health"}
    started = time.monotonic()
    with requests.Session() as session:
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                examples = GENERATING_EXAMPLES if op.path in GENERATING and mode is GenerationMode.POSITIVE else EXAMPLES

                @settings(max_examples=examples, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode), realistic=st.sampled_from([True, False]))
                def fuzz(case, realistic: bool) -> None:
                    if op.path == "/bootstrap/rooms/{room}" and case.query:
                        case.query = {**case.query, "wait": 0}  # a colocated server answers at once, but keep it so
                    if case.body is not None and not isinstance(case.body, (bytes, str)):
                        case.body = _realistic(case.body, op.path) if realistic else case.body
                    _check(case.call(base_url=server.url, session=session, timeout=TIMEOUT_S), seen, op.path)

                try:
                    fuzz()
                except Unsatisfiable:
                    assert mode is GenerationMode.NEGATIVE, op.path  # an operation that takes no input has no invalid one
    elapsed = time.monotonic() - started
    total = sum(n for key, n in seen.items() if isinstance(key, int))
    served = sum(n for key, n in seen.items() if isinstance(key, tuple) and key[0] in GENERATING and key[1] == 200)
    assert total >= 250, seen
    assert served >= 30, f"too few generated requests reached the engine: {dict(seen)}"
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    deadline = time.monotonic() + 60
    while (load := httpx.get(server.url + "/get_load", timeout=30).json()[0])["num_reqs"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert load["num_reqs"] == 0 and load["num_tokens"] == 0, load
    rss_end = _rss_kb(engine)
    assert rss_end <= rss_start * RSS_GROWTH + RSS_ALLOWANCE_KB, (rss_start, rss_end)
    print(f"fuzzed {total} requests in {elapsed:.0f} s ({served} generated text): {seen}; engine RSS {rss_start} -> {rss_end} kB")


def _numeric_bounds(prop: dict[str, Any]) -> Iterator[tuple[str, float | None, float | None]]:
    """``(type, minimum, maximum)`` of a property's numeric schema, or of each numeric member of its ``anyOf``."""
    for member in prop.get("anyOf", [prop]):
        if member.get("type") in ("integer", "number") and ("minimum" in member or "maximum" in member):
            yield member["type"], member.get("minimum"), member.get("maximum")


def _edges(kind: str, low: float | None, high: float | None) -> list[int | float]:
    """Each stated bound, and its neighbours on both sides (a bound past 2**53 is stated as a float: rounded,
    so the true bound is among its integer neighbours)."""
    out: list[int | float] = []
    for bound in (b for b in (low, high) if b is not None):
        if kind == "integer":
            out += [int(bound) - 1, int(bound), int(bound) + 1]
        else:
            out += [bound, bound + 0.5, max(bound - 0.5, -1.0)]
    return out


@pytest.mark.slow
def test_every_stated_bound_and_its_neighbours(server: ServerProcess) -> None:
    """Each numeric bound the schema states, sent at and around its edge with the most completions allowed:
    answered 200 or 400, never a failure of the engine (the edges hypothesis seldom draws)."""
    spec = httpx.get(server.url + "/openapi.json", timeout=30).json()
    bodies = {
        "/v1/completions": ("CompletionRequest", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0.8}),
        "/v1/chat/completions": ("ChatCompletionRequest", {"model": MODEL, "messages": USER, "max_tokens": 3, "temperature": 0.8,
                                                           "logprobs": True}),
    }
    seen: Counter = Counter()
    with requests.Session() as session:
        for path, (name, base) in bodies.items():
            props = spec["components"]["schemas"][name]["properties"]
            most_n = int(next(_numeric_bounds(props["n"]))[2])
            for field, prop in props.items():
                for kind, low, high in _numeric_bounds(prop):
                    for value in _edges(kind, low, high):
                        body = {**base, "n": most_n, field: value}
                        _check(session.post(server.url + path, json=body, timeout=TIMEOUT_S), seen, f"{path} {field}={value}")
    assert seen[200] >= 20 and seen[400] >= 10, seen
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200

"""``deepinfer serve`` when things go wrong: bad requests, oversized bodies, disconnecting clients, overload,
API keys, SIGTERM and a dead rank — each answered with OpenAI's error object (status, ``type``, ``param``),
while a healthy request running beside the bad one still completes whole."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.helpers.chat_models import v4_chat_model
from tests.helpers.servers import ServerPool, ServerProcess, running_server

MODEL = "tiny-v4"
#: seconds any one HTTP call may take (a loaded two-core machine is slow)
TIMEOUT = 120.0
#: tokens of the healthy request run beside each bad one
HEALTHY_TOKENS = 32
USER = [{"role": "user", "content": "Say hello."}]


# ----- servers -----

@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    """The bundled model with default settings, shared by the module's cases that need nothing special."""
    with running_server([], log_dir=tmp_path_factory.mktemp("server")) as srv:
        yield srv


@pytest.fixture
def serve(tmp_path) -> Iterator:
    """``serve(*args, env=...)``: a server of the test's own, stopped when the test ends (failed or not)."""
    with ServerPool(tmp_path) as pool:
        yield pool.start


# ----- helpers -----

def sse_events(response: httpx.Response) -> Iterator[Any]:
    """The parsed ``data:`` events of a streaming response (``"[DONE]"`` as the string)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def stream_text(events: list[Any]) -> tuple[str, list[str | None], dict | None, list[dict]]:
    """``(text, finish reasons, usage, error events)`` of a completions stream's events."""
    text, reasons, usage, errors = "", [], None, []
    for e in events:
        if e == "[DONE]":
            continue
        if "error" in e:
            errors.append(e["error"])
            continue
        usage = e.get("usage") or usage
        for c in e["choices"]:
            text += c["text"]
            reasons.append(c["finish_reason"])
    return text, reasons, usage, errors


@contextmanager
def healthy_stream(url: str, headers: dict[str, str] | None = None, max_tokens: int = HEALTHY_TOKENS) -> Iterator[None]:
    """A streaming completion started (its first event read) before the block and read to its end after it:
    whatever the block did to the server, it must finish whole — every token, finish reason ``length``."""
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=TIMEOUT, headers=headers) as client:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200, response.read()
            events = sse_events(response)
            first = [next(events)]
            yield
            rest = list(events)
    all_events = first + rest
    text, reasons, usage, errors = stream_text(all_events)
    assert not errors, errors
    assert all_events[-1] == "[DONE]"
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1]), reasons
    assert usage is not None and usage["completion_tokens"] == max_tokens, usage
    assert text


def assert_error(response: httpx.Response, status: int, type_: str, param: Any = ..., contains: str | None = None) -> dict:
    """``response`` is OpenAI's error object with this status, type and (unless ``...``) param; its ``error``."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == type_ and error["code"] == status, error
    if param is not ...:
        assert error["param"] == param, error
    assert isinstance(error["message"], str) and error["message"], error
    if contains is not None:
        assert contains in error["message"], error
    if status == 503:
        assert int(response.headers["retry-after"]) >= 1
    return error


def metric(url: str, name: str) -> float:
    """One ``deepinfer:NAME`` sample of ``/metrics``."""
    for line in httpx.get(url + "/metrics", timeout=TIMEOUT).text.splitlines():
        if line.startswith(f"deepinfer:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"/metrics has no deepinfer:{name}")


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)


def idle(url: str) -> bool:
    return metric(url, "num_requests_running") == 0 and metric(url, "num_requests_waiting") == 0


def post(url: str, path: str, **kwargs) -> httpx.Response:
    return httpx.post(url + path, timeout=TIMEOUT, **kwargs)


def completion(**fields) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def chat(**fields) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# ----- malformed and invalid requests (the shared server) -----

def test_models_report_the_context_length(server):
    models = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, 1024)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("raw, contains", [(b'{"prompt": "hi",', "not valid JSON"), (b"\xff\xfe{", None),
                                           (b"[1, 2]", "invalid request body")])
def test_malformed_body(server, path, raw, contains):
    with healthy_stream(server.url):
        r = post(server.url, path, content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, "invalid_request_error", None, contains)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", completion(max_tokens="lots"), "max_tokens"),
    ("/v1/completions", completion(temperature="hot"), "temperature"),
    ("/v1/completions", completion(prompt=5), "prompt"),  # a union: the field, not 'prompt.str'
    ("/v1/completions", completion(stop=5), "stop"),
    ("/v1/completions", completion(stream_options={"include_usage": "x"}), "stream_options.include_usage"),
    ("/v1/completions", {"model": MODEL, "max_tokens": 4}, "prompt"),
    ("/v1/chat/completions", chat(messages="hi"), "messages"),
    ("/v1/chat/completions", chat(n="two"), "n"),
    ("/v1/chat/completions", chat(response_format={"type": "xml"}), "response_format.type"),
])
def test_wrong_field_types(server, path, body, param):
    with healthy_stream(server.url):
        error = assert_error(post(server.url, path, json=body), 400, "invalid_request_error", param)
    assert f"'{param}'" in error["message"]


def test_missing_field_does_not_echo_the_body(server):
    error = assert_error(post(server.url, "/v1/completions", json={"max_tokens": 4, "padding": "z" * 500}), 400,
                         "invalid_request_error", "prompt")
    assert "zzzz" not in error["message"]


@pytest.mark.parametrize("path, body", [("/v1/completions", completion(model="gpt-4")),
                                        ("/v1/chat/completions", chat(model="gpt-4"))])
def test_unknown_model_is_404(server, path, body):
    with healthy_stream(server.url):
        assert_error(post(server.url, path, json=body), 404, "invalid_request_error", "model", "gpt-4")


def test_unknown_model_through_openai_client(server):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    with healthy_stream(server.url):
        with pytest.raises(openai.NotFoundError) as caught:
            client.chat.completions.create(model="gpt-4", messages=USER, max_tokens=4)
    assert caught.value.status_code == 404
    assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["param"] == "model"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", completion(temperature=-1), "temperature"),
    ("/v1/completions", completion(top_p=0), "top_p"),
    ("/v1/completions", completion(n=0), "n"),
    ("/v1/completions", completion(max_tokens=0), "max_tokens"),
    ("/v1/completions", completion(logprobs=50), "logprobs"),
    ("/v1/chat/completions", chat(temperature=-1), "temperature"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    ("/v1/chat/completions", chat(max_completion_tokens=0), "max_completion_tokens"),
])
def test_invalid_sampling_values(server, path, body, param):
    with healthy_stream(server.url):
        assert_error(post(server.url, path, json=body), 400, "invalid_request_error", param)


#: the bundled model's defaults: max_n is max_num_seqs, max_logprobs 20
MAX_N, MAX_LOGPROBS = 64, 20
HUGE = 9223372036854775808


@pytest.mark.parametrize("path, body, param, contains", [
    ("/v1/completions", completion(n=100000), "n", f"less than or equal to {MAX_N} (the server's --max-n)"),
    ("/v1/chat/completions", chat(n=HUGE), "n", f"less than or equal to {MAX_N} (the server's --max-n)"),
    ("/v1/completions", completion(best_of=100000), "best_of", f"less than or equal to {MAX_N}"),
    ("/v1/completions", completion(best_of=3), "best_of", "best_of 3 with n 1 is not supported"),
    ("/v1/completions", completion(prompt_logprobs=100000), "prompt_logprobs", f"less than or equal to {MAX_LOGPROBS}"),
    ("/v1/completions", completion(logprobs=21), "logprobs", f"less than or equal to {MAX_LOGPROBS} (the server's --max-logprobs)"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=HUGE), "top_logprobs", f"less than or equal to {MAX_LOGPROBS}"),
    ("/v1/completions", completion(seed=2**80), "seed", "less than or equal to"),
    ("/v1/completions", completion(top_k=10**20), "top_k", "less than or equal to 2147483647"),
    ("/v1/completions", completion(stop=["x"] * 65), "stop", "at most 64 items"),
    ("/v1/completions", completion(stop="s" * 1025), "stop", "at most 1024 characters"),
    ("/v1/completions", completion(stop_token_ids=[1] * 1025), "stop_token_ids", "at most 1024 items"),
    ("/v1/completions", completion(stop_token_ids=[HUGE]), "stop_token_ids.0", "less than or equal to 2147483647"),
    ("/v1/completions", completion(logit_bias={str(i): 1.0 for i in range(1025)}), "logit_bias", "at most 1024 items"),
    ("/v1/completions", completion(logit_bias={"5": 10.0}), "logit_bias", "logit_bias is not supported"),
    ("/v1/completions", completion(prompt=["hi"] * 257), "prompt", "at most 256 items"),
    ("/v1/chat/completions", chat(messages=USER * 4097), "messages", "at most 4096 items"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f"}}] * 257), "tools", "at most 256 items"),
    ("/v1/completions", completion(max_tokens=HUGE), "max_tokens", "at most"),
    ("/v1/completions", completion(temperature=float("inf")), "temperature", "finite"),
])
def test_request_bounds(server, path, body, param, contains):
    """What a request multiplies is bounded: refused with a 400 naming the field and the limit, while a
    healthy stream beside it runs whole and the server stays healthy."""
    with healthy_stream(server.url):
        r = post(server.url, path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert_error(r, 400, "invalid_request_error", param, contains)
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200


def test_bounds_at_their_edges_are_served(server):
    """The largest values the bounds allow are served, every completion whole (a seed at the top of its
    64-bit range too, where each completion's seed wraps)."""
    r = post(server.url, "/v1/completions", json=completion(n=MAX_N, max_tokens=2, seed=2**64 - 1, temperature=0.9,
                                                            logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS))
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == MAX_N and all(len(c["logprobs"]["tokens"]) == 2 for c in choices)
    prompt_lps = choices[0]["prompt_logprobs"]
    assert prompt_lps[0] is None and all(len(p) >= MAX_LOGPROBS for p in prompt_lps[1:]), prompt_lps


def test_openapi_schema_states_the_bounds(server):
    spec = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["n"]["maximum"] == MAX_N and props["n"]["minimum"] == 1
    assert any(m.get("maximum") == MAX_LOGPROBS for m in props["logprobs"]["anyOf"])
    chat_props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat_props["messages"]["maxItems"] == 4096
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"} <= set(spec["paths"])
    docs = httpx.get(server.url + "/docs", timeout=TIMEOUT)
    assert docs.status_code == 200 and "/openapi.json" in docs.text


def test_prompt_longer_than_the_context(server):
    limit = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["max_model_len"]
    with healthy_stream(server.url):
        r = post(server.url, "/v1/completions", json=completion(prompt=[5] * limit, max_tokens=1))
        assert_error(r, 400, "invalid_request_error", "prompt", f"max_model_len is {limit}")
        r = post(server.url, "/v1/completions", json=completion(prompt="hello world " * limit))
        assert_error(r, 400, "invalid_request_error", "prompt")
        r = post(server.url, "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": "hello world " * limit}]))
        assert_error(r, 400, "invalid_request_error", "messages")
    # one token shorter fits, with room for one generated token
    ok = post(server.url, "/v1/completions", json=completion(prompt=[5] * (limit - 1), max_tokens=1))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"] == {"prompt_tokens": limit - 1, "completion_tokens": 1, "total_tokens": limit}


def test_max_tokens_past_the_context(server):
    limit = httpx.get(server.url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["max_model_len"]
    prompt = [5] * (limit - 4)
    with healthy_stream(server.url):
        r = post(server.url, "/v1/completions", json=completion(prompt=prompt, max_tokens=5))
        assert_error(r, 400, "invalid_request_error", "max_tokens", "at most 4 tokens")
        r = post(server.url, "/v1/chat/completions", json=chat(max_completion_tokens=limit))
        assert_error(r, 400, "invalid_request_error", "max_completion_tokens")
        r = post(server.url, "/v1/chat/completions", json=chat(max_tokens=limit))
        assert_error(r, 400, "invalid_request_error", "max_tokens")
    ok = post(server.url, "/v1/completions", json=completion(prompt=prompt, max_tokens=4, ignore_eos=True))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 4


NONSENSE_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, body", [("/v1/completions", completion(response_format=NONSENSE_SCHEMA)),
                                        ("/v1/chat/completions", chat(response_format=NONSENSE_SCHEMA))])
def test_invalid_json_schema(server, path, body, stream):
    """Refused when the engine takes it, before the response starts: a 400 naming the field, streamed or not."""
    with healthy_stream(server.url):
        assert_error(post(server.url, path, json={**body, "stream": stream}), 400, "invalid_request_error", "response_format",
                     contains="nonsense")


@pytest.mark.parametrize("body, param", [
    (completion(response_format={"type": "json_schema"}), "response_format"),
    (completion(guided_json="{not json"), "guided_json"),
    (completion(guided_regex="[a-"), "guided_regex"),
])
def test_malformed_output_constraints(server, body, param):
    with healthy_stream(server.url):
        assert_error(post(server.url, "/v1/completions", json=body), 400, "invalid_request_error", param)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion(router_extra=1, stream_options={"include_usage": True, "extra": 2})),
    ("/v1/chat/completions", chat(router_extra=1, metadata={"tenant": "a"})),
])
def test_unknown_fields_are_ignored(server, path, body):
    with healthy_stream(server.url):
        r = post(server.url, path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("method, path, status", [("GET", "/v1/engines", 404), ("GET", "/v1/completions", 405),
                                                  ("POST", "/health", 405)])
def test_unknown_routes_and_methods(server, method, path, status):
    with healthy_stream(server.url):
        assert_error(httpx.request(method, server.url + path, timeout=TIMEOUT), status, "invalid_request_error", None)


def test_client_errors_log_no_traceback(server):
    """A refused request is the client's problem: the server's log stays free of tracebacks (all cases above ran)."""
    assert_error(post(server.url, "/v1/completions", json=completion(model="gpt-4")), 404, "invalid_request_error")
    assert_error(post(server.url, "/v1/completions", json=completion(temperature=-1)), 400, "invalid_request_error")
    assert "Traceback" not in server.log_text(), server.log_tail(80)


# ----- clients that go away (the shared server) -----

def test_client_disconnect_mid_stream_frees_the_request(server):
    wait_for(lambda: idle(server.url), 60, "the server is idle")
    generated = metric(server.url, "generation_tokens_total")
    body = completion(max_tokens=400, ignore_eos=True, stream=True)
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events(r)
            for _ in range(3):
                next(events)
            assert metric(server.url, "num_requests_running") == 1
            assert metric(server.url, "kv_cache_usage_perc") > 0
        # leaving the block closes the connection mid-stream
    wait_for(lambda: metric(server.url, "num_requests_running") == 0, 30, "the abandoned stream stops running")
    assert metric(server.url, "kv_cache_usage_perc") == 0
    assert metric(server.url, "generation_tokens_total") - generated < 400  # aborted, not run to its end
    with healthy_stream(server.url):
        pass


def test_abandoned_non_streaming_request_is_aborted(server):
    wait_for(lambda: idle(server.url), 60, "the server is idle")
    generated = metric(server.url, "generation_tokens_total")
    outcome: list[BaseException] = []

    def give_up() -> None:
        try:
            httpx.post(server.url + "/v1/completions", json=completion(max_tokens=1000, ignore_eos=True), timeout=3.0)
        except httpx.TimeoutException as exc:
            outcome.append(exc)

    client = threading.Thread(target=give_up)
    client.start()
    wait_for(lambda: metric(server.url, "num_requests_running") == 1, 30, "the request runs")
    client.join(60)
    assert outcome, "the client was expected to time out (the request should take much longer than 3 s)"
    wait_for(lambda: metric(server.url, "num_requests_running") == 0, 30, "the abandoned request stops running")
    assert metric(server.url, "kv_cache_usage_perc") == 0
    assert metric(server.url, "generation_tokens_total") - generated < 1000
    assert "Traceback" not in server.log_text(), server.log_tail(40)


# ----- servers of their own -----

def test_tools_with_a_chat_format_that_cannot_render_them(serve, tmp_path):
    model = v4_chat_model(tmp_path / "model")
    srv = serve("--model", str(model), "--served-model-name", MODEL)
    assert httpx.get(srv.url + "/server_info", timeout=TIMEOUT).json()["chat_format"] == "deepseek_v4"
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    with healthy_stream(srv.url):
        r = post(srv.url, "/v1/chat/completions", json=chat(tools=tools))
        error = assert_error(r, 400, "invalid_request_error", "tools")
    assert "tools" in error["message"]
    plain = post(srv.url, "/v1/chat/completions", json=chat())  # the format itself works
    assert plain.status_code == 200, plain.text


def test_oversized_body_is_413(serve):
    srv = serve("--max-request-bytes", "2000", "--disable-docs", "--max-n", "2")
    for path in ("/openapi.json", "/docs"):  # and with --disable-docs, no schema
        assert_error(httpx.get(srv.url + path, timeout=TIMEOUT), 404, "invalid_request_error")
    assert_error(post(srv.url, "/v1/completions", json=completion(n=3)), 400, "invalid_request_error", "n",
                 "less than or equal to 2 (the server's --max-n)")
    big = json.dumps(completion(prompt="x" * 10_000)).encode()

    def chunked(data: bytes) -> Iterator[bytes]:
        for i in range(0, len(data), 512):
            yield data[i:i + 512]

    def exactly(size: int) -> bytes:
        body = json.dumps(completion(padding=""))
        return json.dumps(completion(padding="p" * (size - len(body)))).encode()

    with healthy_stream(srv.url):
        r = post(srv.url, "/v1/completions", content=big, headers={"content-type": "application/json"})
        assert_error(r, 413, "invalid_request_error", None, "2000 bytes")
        r = post(srv.url, "/v1/completions", content=chunked(big), headers={"content-type": "application/json"})
        assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
        assert_error(r, 413, "invalid_request_error", None, "2000 bytes")
        r = post(srv.url, "/v1/completions", content=chunked(exactly(2001)), headers={"content-type": "application/json"})
        assert_error(r, 413, "invalid_request_error", None)
    at_limit = exactly(2000)
    assert len(at_limit) == 2000
    for content in (at_limit, chunked(at_limit)):
        r = post(srv.url, "/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
    assert "Traceback" not in srv.log_text(), srv.log_tail(40)


def test_overload_is_503_with_retry_after(serve):
    srv = serve("--max-num-seqs", "1", "--max-queued-requests", "2")
    max_tokens = 48

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=16)) as client:
            body = completion(max_tokens=max_tokens, ignore_eos=True)
            return await asyncio.gather(*(client.post(srv.url + "/v1/completions", json=body) for _ in range(8)))

    with healthy_stream(srv.url):  # holds the one running slot while the burst arrives
        responses = asyncio.run(burst())
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert accepted and refused, [r.status_code for r in responses]
    for r in refused:
        assert_error(r, 503, "service_unavailable_error", None, "--max-queued-requests 2")
    for r in accepted:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == max_tokens
    # and it serves afterwards
    assert httpx.get(srv.url + "/health", timeout=TIMEOUT).status_code == 200
    wait_for(lambda: idle(srv.url), 60, "the queue drains")
    with healthy_stream(srv.url):
        pass
    assert "Traceback" not in srv.log_text(), srv.log_tail(40)


API_KEY = "sk-deepinfer-test-8e1d2c"
WRONG_KEY = "sk-wrong-key-5b7a90"


def test_api_key_flag(serve):
    srv = serve("--api-key", API_KEY, "--access-log")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with healthy_stream(srv.url, headers=auth):
        assert_error(post(srv.url, "/v1/completions", json=completion()), 401, "authentication_error")
        assert_error(post(srv.url, "/v1/completions", json=completion(), headers={"Authorization": f"Bearer {WRONG_KEY}"}),
                     401, "authentication_error")
        assert_error(post(srv.url, "/v1/completions", json=completion(), headers={"Authorization": API_KEY}),
                     401, "authentication_error")  # not a bearer token
        assert_error(httpx.get(srv.url + "/v1/models", timeout=TIMEOUT), 401, "authentication_error")
        assert_error(httpx.get(srv.url + "/openapi.json", timeout=TIMEOUT), 401, "authentication_error")  # the schema too
        assert_error(httpx.get(srv.url + "/docs", timeout=TIMEOUT), 401, "authentication_error")
        assert httpx.get(srv.url + "/openapi.json", headers=auth, timeout=TIMEOUT).json()["paths"]
        assert httpx.get(srv.url + "/health", timeout=TIMEOUT).status_code == 200
        assert "deepinfer:num_requests_running" in httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text
    good = OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)
    assert good.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
    assert [m.id for m in good.models.list().data] == [MODEL]
    bad = OpenAI(base_url=srv.url + "/v1", api_key=WRONG_KEY, max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    log = srv.log_text()
    assert "API key required" in log and "/v1/completions" in log  # the access log is on, and still:
    assert API_KEY not in log and WRONG_KEY not in log


def test_api_key_from_the_environment(serve):
    srv = serve(env={"DEEPINFER_API_KEY": API_KEY})
    with healthy_stream(srv.url, headers={"Authorization": f"Bearer {API_KEY}"}):
        assert_error(post(srv.url, "/v1/completions", json=completion()), 401, "authentication_error")
        assert_error(post(srv.url, "/v1/completions", json=completion(), headers={"Authorization": f"Bearer {WRONG_KEY}"}),
                     401, "authentication_error")
    client = OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)
    assert client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3).usage.completion_tokens == 3
    assert API_KEY not in srv.log_text()


# ----- shutting down, and dying -----

def refused(url: str) -> bool:
    """Whether a new connection is refused, or answered 503 (the server is draining)."""
    try:
        r = httpx.post(url + "/v1/completions", json=completion(), timeout=10)
    except httpx.TransportError:
        return True
    return r.status_code == 503


@pytest.mark.slow
def test_sigterm_drains_the_request_in_flight(serve):
    srv = serve("--shutdown-timeout", "60")
    body = completion(max_tokens=200, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
            events = sse_events(r)
            seen = [next(events)]
            srv.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "shutting down" in srv.log_text(), 30, "the server starts draining")
            assert refused(srv.url)
            seen += list(events)
    text, reasons, usage, errors = stream_text(seen)
    assert not errors and seen[-1] == "[DONE]"
    assert reasons[-1] == "length" and usage["completion_tokens"] == 200
    assert srv.wait(60) == 0, srv.log_tail()


@pytest.mark.slow
@pytest.mark.parametrize("timeout", ["1", "0"])
def test_sigterm_past_the_shutdown_timeout_cuts_the_request_off(serve, timeout):
    srv = serve("--shutdown-timeout", timeout, "--speculative", "none")
    body = completion(max_tokens=1000, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    seen: list[Any] = []
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
            events = sse_events(r)
            seen.append(next(events))
            srv.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            try:
                seen += list(events)
            except httpx.TransportError:
                pass  # the connection is closed mid-stream
    code = srv.wait(60)
    took = time.monotonic() - signalled
    assert code == 0, srv.log_tail()
    assert took < 20, took  # quietly ~2 s; the whole request would take ~30 s
    _, reasons, usage, _ = stream_text(seen)
    assert "length" not in reasons and usage is None  # cut off: never finished
    assert seen[-1] != "[DONE]"


@pytest.mark.slow
def test_killed_rank_fails_the_requests_and_the_server_exits(serve):
    srv = serve("--ep", "2", ready_timeout=300)
    ranks = srv.rank_pids()
    assert len(ranks) == 2, (srv.children(), ranks)
    outcome: dict[str, httpx.Response] = {}

    def non_streaming() -> None:
        outcome["r"] = httpx.post(srv.url + "/v1/completions", json=completion(max_tokens=500, ignore_eos=True), timeout=TIMEOUT)

    waiting = threading.Thread(target=non_streaming)
    waiting.start()
    body = completion(max_tokens=500, ignore_eos=True, stream=True)
    with httpx.Client(timeout=TIMEOUT) as client:
        with client.stream("POST", srv.url + "/v1/completions", json=body) as r:
            events = sse_events(r)
            seen = [next(events)]
            wait_for(lambda: metric(srv.url, "num_requests_running") == 2, 60, "both requests run")
            os.kill(ranks[-1], signal.SIGKILL)
            seen += list(events)
    waiting.join(TIMEOUT)
    _, reasons, _, errors = stream_text(seen)
    assert [e["type"] for e in errors] == ["server_error"] and "rank" in errors[0]["message"], seen[-3:]
    assert "length" not in reasons
    assert_error(outcome["r"], 500, "server_error", None, "rank")
    try:
        health = httpx.get(srv.url + "/health", timeout=10)
        assert_error(health, 503, "service_unavailable_error")
    except httpx.TransportError:
        pass  # already gone
    assert srv.wait(60) != 0
    assert "engine failed" in srv.log_text()
    wait_for(lambda: not any(process_alive(p) for p in ranks), 30, "every rank process is gone")

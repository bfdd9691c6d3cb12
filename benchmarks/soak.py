"""Soak ``deepinfer serve``: thousands of mixed requests, good and bad, from 16-64 clients for a bounded time; does
the server stay up, answer every request as it should, and end where it started (memory and KV cache)?

The script starts ``deepinfer serve`` itself (a free 127.0.0.1 port, a session of its own, always stopped on exit;
``--server-arg`` flags are passed on) or drives a running one (``--url``, loopback only). It builds a seeded random
mix of ``--requests`` requests and sends them from ``--clients`` asynchronous clients in a closed loop (``httpx``, SSE
parsed by hand), stopping issuing after ``--duration-s`` whatever is left:

- chat completions: plain, streamed, ``n`` 2-4, ``response_format`` ``json_schema`` (a small object schema);
- completions: plain, streamed, a list of two prompts, ``logprobs``;
- ~10 % disconnects: a stream closed after its first chunk, a non-streamed request with a tiny read timeout, a
  request task cancelled after a few milliseconds;
- ~10 % bad requests whose expected answer is a 4xx with OpenAI's error object ``{"error": {"message", "type",
  "param", "code"}}``: invalid JSON, ``n`` / ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` / ``best_of``
  100000, negative ``max_tokens``, an unknown model, empty ``messages``, ``seed`` 2**80, ``top_k`` 10**20, wrong types.

Every request asks for 8-48 tokens, so a run finishes on a small CPU. Counted: requests sent and served (a 2xx
answered to its end: a stream's ``[DONE]``), errors by kind (4xx by status, 503 overload, other 5xx, error events in a
stream, transport errors, disconnects issued), and ``unexpected``: a bad request that got anything but a 4xx with an
error object, a good one that got anything but a complete 2xx (a 503 for overload excepted). Latency p50 / p99 of
served requests per kind: chat and completion (request sent to the reply read), streams' TTFT (to the first chunk
with a choice) and total (to ``[DONE]``).

Memory: VmRSS of the server process and of its engine process (the server's ``multiprocessing`` spawn child, with
every process below it: an ``--ep`` engine's ranks) at start (after a warm-up, drained), in the middle (half the
requests or half the time) and at the end (drained: ``/get_load`` 0 requests); target: end within 5 % of start. KV
cache: ``deepinfer:kv_cache_usage_perc`` from ``/metrics`` at start and at the end, drained (target: back to the
start value; blocks from the server's start-up line when this script started it). ``/health`` at the end should be
200. When the server or its engine dies during the run (``/health`` not 200 for a few seconds, or the process gone),
issuing stops and the report says when, the engine's error, and which bad requests had just been sent.

    .venv/bin/python benchmarks/soak.py [--clients 32] [--requests 2000] [--duration-s 300] [--seed 0]
        [--model PATH] [--server-arg=--max-num-seqs=32 ...] [--url http://127.0.0.1:8000] [--exclude KIND ...] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.common import add_json_flag, emit_json  # noqa: E402
from tests.helpers.process_tree import children  # noqa: E402

#: words the prompts are made of
WORDS = (
    "the of and to in is was for on that with as by at from they this had not are but which have one were all "
    "river stone light north ocean table window garden market letter winter summer morning evening city road "
    "water field mountain forest island bridge school church music story paper number family friend kitchen "
    "engine signal memory cache kernel thread socket server client request reply token batch layer matrix"
).split()
#: tokens a request may generate
MAX_TOKENS = (8, 48)
#: the small schema of the json_schema requests
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
#: the good kinds and their weights (the rest of the mix: disconnects and bad requests, ~10 % each)
GOOD_KINDS = {
    "chat": 14, "chat_stream": 12, "chat_n": 8, "chat_json_schema": 6,
    "completion": 14, "completion_stream": 12, "completion_two_prompts": 8, "completion_logprobs": 6,
}
DISCONNECT_KINDS = ("disconnect_stream_first_chunk", "disconnect_read_timeout", "disconnect_cancel")
#: bad requests: name -> (endpoint, body: a dict merged into a valid body, or raw bytes)
BIG = 100000
BAD_CASES: dict[str, tuple[str, Any]] = {
    "bad_invalid_json": ("completions", b'{"prompt": "the river", "max_tokens": 8'),
    "bad_body_not_object": ("chat", b"[1, 2, 3]"),
    "bad_n_huge": ("chat", {"n": BIG}),
    "bad_n_huge_completion": ("completions", {"n": BIG}),
    "bad_logprobs_huge": ("completions", {"logprobs": BIG}),
    "bad_top_logprobs_huge": ("chat", {"logprobs": True, "top_logprobs": BIG}),
    "bad_prompt_logprobs_huge": ("completions", {"prompt_logprobs": BIG}),
    "bad_best_of_huge": ("completions", {"best_of": BIG}),
    "bad_negative_max_tokens": ("chat", {"max_tokens": -5}),
    "bad_unknown_model": ("completions", {"model": "no-such-model-soak"}),
    "bad_empty_messages": ("chat", {"messages": []}),
    "bad_seed_huge": ("completions", {"seed": 2**80}),
    "bad_top_k_huge": ("chat", {"top_k": 10**20}),
    "bad_wrong_type_max_tokens": ("completions", {"max_tokens": "eight"}),
    "bad_wrong_type_messages": ("chat", {"messages": "hello"}),
    "bad_wrong_type_temperature": ("chat", {"temperature": "hot"}),
    "bad_top_p_out_of_range": ("completions", {"top_p": 5.0}),
}
#: share of the mix that is disconnects, and bad requests
DISCONNECT_SHARE = 0.10
BAD_SHARE = 0.10
#: warm-up requests per good kind (not counted)
WARMUP_PER_KIND = 2
#: seconds of /health not 200 (or no answer) after which the server counts as down and issuing stops
DOWN_AFTER_S = 5.0
#: read timeout of a normal request
REQUEST_TIMEOUT_S = 300.0
#: seconds a bad request sent before the server went down counts as a suspect
SUSPECT_WINDOW_S = 10.0


# ----- the mix -----


@dataclass
class Spec:
    """One request of the mix."""

    index: int
    kind: str
    #: "chat" or "completions"
    endpoint: str
    #: the JSON body, or raw bytes (an invalid body)
    body: dict[str, Any] | bytes
    #: "ok" (a complete 2xx), "4xx" (refused with an error object) or "disconnect" (the client leaves)
    expect: str
    #: choices a good reply must carry
    choices: int = 1
    #: a disconnect: seconds before the client leaves (read timeout or cancel)
    cut_s: float = 0.0

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))


def _chat(rng: random.Random, model: str) -> dict[str, Any]:
    messages = [{"role": "user", "content": _prompt(rng)}]
    if rng.random() < 0.2:
        messages = [{"role": "system", "content": "You answer briefly."}, *messages]
    body: dict[str, Any] = {"model": model, "messages": messages, "temperature": round(rng.uniform(0.0, 1.0), 2)}
    body["max_completion_tokens" if rng.random() < 0.3 else "max_tokens"] = rng.randint(*MAX_TOKENS)
    return body


def _completion(rng: random.Random, model: str) -> dict[str, Any]:
    return {"model": model, "prompt": _prompt(rng), "max_tokens": rng.randint(*MAX_TOKENS), "temperature": round(rng.uniform(0.0, 1.0), 2)}


def _stream(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    body["stream"] = True
    if rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return body


def good_spec(index: int, kind: str, rng: random.Random, model: str) -> Spec:
    if kind.startswith("chat"):
        body = _chat(rng, model)
        n = 1
        if kind == "chat_stream":
            _stream(body, rng)
        elif kind == "chat_n":
            n = body["n"] = rng.randint(2, 4)
            if rng.random() < 0.3:
                _stream(body, rng)
        elif kind == "chat_json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            body["messages"][-1]["content"] = "Describe a person as JSON: " + body["messages"][-1]["content"]
        return Spec(index, kind, "chat", body, "ok", n)
    body = _completion(rng, model)
    n = 1
    if kind == "completion_stream":
        _stream(body, rng)
    elif kind == "completion_two_prompts":
        body["prompt"] = [body["prompt"], _prompt(rng)]
        n = 2
    elif kind == "completion_logprobs":
        body["logprobs"] = rng.randint(0, 5)
    return Spec(index, kind, "completions", body, "ok", n)


def disconnect_spec(index: int, kind: str, rng: random.Random, model: str) -> Spec:
    chat = rng.random() < 0.5
    body = _chat(rng, model) if chat else _completion(rng, model)
    body["max_tokens"] = body.pop("max_completion_tokens", None) or body["max_tokens"]
    body["max_tokens"] = MAX_TOKENS[1]  # the longest: the client leaves before the end, most of the time
    if kind == "disconnect_stream_first_chunk":
        _stream(body, rng)
    return Spec(index, kind, "chat" if chat else "completions", body, "disconnect", cut_s=round(rng.uniform(0.005, 0.3), 3))


def bad_spec(index: int, kind: str, rng: random.Random, model: str) -> Spec:
    endpoint, change = BAD_CASES[kind]
    if isinstance(change, bytes):
        return Spec(index, kind, endpoint, change, "4xx")
    body = _chat(rng, model) if endpoint == "chat" else _completion(rng, model)
    body.pop("max_completion_tokens", None)
    body.setdefault("max_tokens", rng.randint(*MAX_TOKENS))
    body.update(change)
    return Spec(index, kind, endpoint, body, "4xx")


ALL_KINDS = (*GOOD_KINDS, *DISCONNECT_KINDS, *sorted(BAD_CASES))


def make_mix(n: int, seed: int, model: str, exclude: frozenset[str] = frozenset()) -> list[Spec]:
    """``n`` requests drawn from ``seed``: ~10 % disconnects, ~10 % bad requests, the rest good ones by weight;
    a group whose kinds are all excluded gives its share to the good requests."""
    rng = random.Random(seed)
    kinds, weights = zip(*((k, w) for k, w in GOOD_KINDS.items() if k not in exclude)) if set(GOOD_KINDS) - exclude else ((), ())
    cuts = [k for k in DISCONNECT_KINDS if k not in exclude]
    bad = [k for k in sorted(BAD_CASES) if k not in exclude]
    out: list[Spec] = []
    while len(out) < n:
        i = len(out)
        roll = rng.random()
        if roll < DISCONNECT_SHARE:
            if cuts:
                out.append(disconnect_spec(i, rng.choice(cuts), rng, model))
        elif roll < DISCONNECT_SHARE + BAD_SHARE:
            if bad:
                out.append(bad_spec(i, rng.choice(bad), rng, model))
        elif kinds:
            out.append(good_spec(i, rng.choices(kinds, weights)[0], rng, model))
    return out


# ----- sending one request -----


@dataclass
class Outcome:
    """What one request got."""

    spec: Spec
    #: "served", "rejected" (a 4xx), "disconnected", or an error kind
    result: str
    status: int | None = None
    #: seconds from sending to the reply read (a stream: to [DONE])
    total_s: float | None = None
    ttft_s: float | None = None
    #: the error kind for errors_by_kind (None for served and clean disconnects)
    error: str | None = None
    unexpected: bool = False
    detail: str = ""
    #: seconds from the run's start to sending it and to its outcome
    sent_s: float = 0.0
    done_s: float = 0.0


def _error_object_ok(payload: Any) -> bool:
    err = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(err, dict) and all(k in err for k in ("message", "type", "param", "code")) and isinstance(err["message"], str)


def _status_kind(status: int, payload: Any) -> str:
    if status == 503:
        message = str((payload.get("error") or {}).get("message", "")) if isinstance(payload, dict) else ""
        return "http_503_overload" if "max-queued-requests" in message or "retry later" in message else "http_503_unavailable"
    return f"http_{status}"


def _check_reply(spec: Spec, payload: Any) -> str | None:
    """A problem with a good non-streamed reply, or None."""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or len(choices) != spec.choices:
        return f"{len(choices) if isinstance(choices, list) else 'no'} choices, expected {spec.choices}"
    if spec.kind == "chat_json_schema":
        for c in choices:
            if c.get("finish_reason") == "stop":
                try:
                    value = json.loads(c["message"]["content"])
                except (TypeError, KeyError, json.JSONDecodeError):
                    return "json_schema reply finished with 'stop' but is not JSON"
                if not isinstance(value, dict) or not {"name", "age"} <= value.keys():
                    return "json_schema reply lacks the schema's required keys"
    if spec.kind == "completion_logprobs" and any(not c.get("logprobs") for c in choices):
        return "logprobs missing"
    return None


async def _read_stream(resp: httpx.Response, spec: Spec, sent: float, first_only: bool) -> Outcome:
    ttft = None
    done = False
    seen: set[int] = set()
    buf = b""
    async for data in resp.aiter_raw():
        buf += data
        while (cut := buf.find(b"\n\n")) >= 0:
            event, buf = buf[:cut].strip(), buf[cut + 2:]
            if not event.startswith(b"data:"):
                continue
            payload = event[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError:
                return Outcome(spec, "error", 200, error="stream_bad_event", unexpected=True, detail=payload[:200].decode(errors="replace"))
            if "error" in chunk:
                return Outcome(spec, "error", 200, error="stream_error_event", unexpected=True, detail=str(chunk["error"])[:200])
            if chunk.get("choices"):
                if ttft is None:
                    ttft = time.perf_counter() - sent
                seen.update(c.get("index", 0) for c in chunk["choices"])
                if first_only:
                    return Outcome(spec, "disconnected", 200, ttft_s=ttft, error="disconnect_issued")
    total = time.perf_counter() - sent
    if first_only:  # the stream ended before a chunk: the server finished first
        return Outcome(spec, "disconnected", 200, total, ttft, error="disconnect_issued")
    if not done:
        return Outcome(spec, "error", 200, total, ttft, error="stream_incomplete", unexpected=True, detail="the stream ended without [DONE]")
    if len(seen) != spec.choices:
        return Outcome(spec, "error", 200, total, ttft, error="malformed_reply", unexpected=True, detail=f"{len(seen)} choices streamed, expected {spec.choices}")
    return Outcome(spec, "served", 200, total, ttft)


async def _request(client: httpx.AsyncClient, base: str, spec: Spec) -> Outcome:
    url = base + ("/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions")
    content = spec.body if isinstance(spec.body, bytes) else json.dumps(spec.body).encode()
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0, pool=REQUEST_TIMEOUT_S)
    if spec.kind == "disconnect_read_timeout":
        timeout = httpx.Timeout(30.0, read=spec.cut_s, pool=REQUEST_TIMEOUT_S)
    sent = time.perf_counter()
    req = client.build_request("POST", url, content=content, headers={"content-type": "application/json"}, timeout=timeout)
    resp = await client.send(req, stream=True)
    try:
        if spec.stream and resp.status_code == 200:
            return await _read_stream(resp, spec, sent, first_only=spec.kind == "disconnect_stream_first_chunk")
        raw = await resp.aread()
        total = time.perf_counter() - sent
    finally:
        await resp.aclose()
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError:
        payload = None
    status = resp.status_code
    if spec.expect == "4xx":
        if 400 <= status < 500 and _error_object_ok(payload):
            return Outcome(spec, "rejected", status, total, error=f"http_{status}")
        why = "no OpenAI error object" if 400 <= status < 500 else f"HTTP {status}"
        kind = _status_kind(status, payload) if status >= 300 else None
        return Outcome(spec, "error" if kind else "accepted", status, total, error=kind, unexpected=True,
                       detail=f"{why}: {raw[:200].decode(errors='replace')}")
    if 200 <= status < 300:
        if spec.expect == "disconnect":  # answered within the cut
            return Outcome(spec, "disconnected", status, total, error="disconnect_issued", detail="answered before the cut")
        problem = _check_reply(spec, payload)
        if problem:
            return Outcome(spec, "error", status, total, error="malformed_reply", unexpected=True, detail=problem)
        return Outcome(spec, "served", status, total)
    kind = _status_kind(status, payload)
    return Outcome(spec, "error", status, total, error=kind, unexpected=kind != "http_503_overload",
                   detail=raw[:200].decode(errors="replace"))


async def send(client: httpx.AsyncClient, base: str, spec: Spec) -> Outcome:
    """One request, every failure caught and classified."""
    try:
        if spec.kind == "disconnect_cancel":
            try:
                return await asyncio.wait_for(_request(client, base, spec), spec.cut_s)
            except asyncio.TimeoutError:
                return Outcome(spec, "disconnected", error="disconnect_issued")
        return await _request(client, base, spec)
    except httpx.ReadTimeout as exc:
        if spec.kind == "disconnect_read_timeout":
            return Outcome(spec, "disconnected", error="disconnect_issued")
        return Outcome(spec, "error", error="transport_timeout", unexpected=True, detail=repr(exc))
    except httpx.TimeoutException as exc:
        return Outcome(spec, "error", error="transport_timeout", unexpected=True, detail=repr(exc))
    except httpx.HTTPError as exc:
        kind = "transport_connect" if isinstance(exc, httpx.ConnectError) else "transport_error"
        return Outcome(spec, "error", error=kind, unexpected=True, detail=repr(exc))


#: outcomes after which the monitor looks at /health at once: the server may be down
ALARMS = frozenset({"http_500", "http_503_unavailable", "stream_error_event", "transport_connect", "transport_error"})


# ----- the server's processes, memory and gauges -----


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rss_mb(pid: int) -> float | None:
    """A process's VmRSS in MiB (None when it is gone)."""
    try:
        m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) / 1024 if m else None


def engine_pids(server_pid: int) -> list[int]:
    """The engine process (the server's ``multiprocessing`` spawn child) and every process below it (an ``--ep``
    engine's ranks), resource trackers left out."""
    engines = [p for p in children(server_pid) if "spawn_main" in _cmdline(p)]
    found, todo = [], list(engines)
    while todo:
        pid = todo.pop()
        if "resource_tracker" in _cmdline(pid):
            continue
        found.append(pid)
        todo += children(pid)
    return sorted(found)


def listening_pid(port: int) -> int | None:
    """The topmost process holding a socket listening on ``port`` (``--url``: the server's pid), if this user can see it."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    if not inodes:
        return None
    holders = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    holders.append(int(proc.name))
                    break
        except OSError:
            continue
    below = {c for h in holders for c in children(h)}
    top = [h for h in holders if h not in below]
    return min(top) if top else None


@dataclass
class Sample:
    """The server's memory and KV cache at one moment."""

    at_s: float
    server_mb: float | None
    engine_mb: float | None
    engine_processes: int
    kv_usage: float | None


class Watcher:
    """Where the server is: its pid (None when unknown), health, memory and gauges."""

    def __init__(self, base: str, pid: int | None, num_blocks: int | None, proc: Any = None) -> None:
        self.base = base
        self.pid = pid
        self.num_blocks = num_blocks
        #: the Popen of a server this script started
        self.proc = proc
        self.t0 = time.perf_counter()
        self.peak_server_mb = 0.0
        self.peak_engine_mb = 0.0

    def rss(self) -> tuple[float | None, float | None, int]:
        """(server MiB, engine MiB summed over its processes, engine processes) now; the peaks follow."""
        server = rss_mb(self.pid) if self.pid else None
        engines = engine_pids(self.pid) if self.pid else []
        figures = [f for f in map(rss_mb, engines) if f is not None]
        engine = sum(figures) if figures else None
        self.peak_server_mb = max(self.peak_server_mb, server or 0.0)
        self.peak_engine_mb = max(self.peak_engine_mb, engine or 0.0)
        return server, engine, len(figures)

    def sample(self) -> Sample:
        server, engine, count = self.rss()
        return Sample(round(time.perf_counter() - self.t0, 2), server, engine, count, self.gauges().get("kv_cache_usage_perc"))

    def gauges(self) -> dict[str, float]:
        try:
            text = httpx.get(self.base + "/metrics", timeout=30).text
        except httpx.HTTPError:
            return {}
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^deepinfer:(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M)
                if not m.group(1).endswith(("_bucket", "_created"))}

    def health(self) -> int | None:
        try:
            return httpx.get(self.base + "/health", timeout=10).status_code
        except httpx.HTTPError:
            return None

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def gone(self) -> str | None:
        """Why the server is known to be gone (its process ended), or None."""
        code = self.exited()
        if code is not None:
            return f"the server exited with status {code}"
        if self.proc is None and self.pid is not None and not Path(f"/proc/{self.pid}").exists():
            return f"the server process {self.pid} is gone"
        return None

    def engine_error(self) -> str | None:
        try:
            return httpx.get(self.base + "/server_info", timeout=10).json().get("engine_error")
        except (httpx.HTTPError, ValueError):
            return None

    def drain(self, timeout_s: float) -> bool:
        """Wait until ``/get_load`` reports no request; whether it did in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exited() is not None:
                return False
            try:
                load = httpx.get(self.base + "/get_load", timeout=10).json()
                if sum(x.get("num_reqs", 0) for x in load) == 0:
                    time.sleep(0.5)  # the gauges follow the engine's last step
                    return True
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.25)
        return False


# ----- the run -----


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    middle: Sample | None = None
    #: why issuing stopped before the mix or the time ran out (the server went down)
    stopped: str | None = None
    down_at_s: float | None = None

    def suspects(self) -> list[str]:
        """Bad requests that may have brought the server down: sent in the window before it went down and answered
        with neither the 4xx they should have got nor a refusal of a server already down (503, no connection)."""
        if self.down_at_s is None:
            return []
        return sorted({o.spec.kind for o in self.outcomes if o.spec.expect == "4xx" and o.unexpected
                       and self.down_at_s - SUSPECT_WINDOW_S <= o.sent_s <= self.down_at_s
                       and o.error not in ("http_503_unavailable", "http_503_overload", "transport_connect")})

    def first_server_error(self) -> str | None:
        """The first 5xx (or error event) the run got, what a failing engine says about itself."""
        errs = sorted((o for o in self.outcomes if o.error in ("http_500", "stream_error_event")), key=lambda o: o.done_s)
        return f"{errs[0].spec.kind} at {errs[0].done_s:.2f} s: {errs[0].detail}"[:300] if errs else None


async def drive(base: str, specs: list[Spec], clients: int, duration_s: float, watcher: Watcher, quiet: bool) -> Run:
    run = Run()
    next_i = 0
    stop = asyncio.Event()
    t0 = time.perf_counter()
    alarm = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal next_i
        while not stop.is_set() and next_i < len(specs) and time.perf_counter() - t0 < duration_s:
            spec = specs[next_i]
            next_i += 1
            sent = time.perf_counter() - t0
            out = await send(client, base, spec)
            out.sent_s, out.done_s = sent, time.perf_counter() - t0
            run.outcomes.append(out)
            if out.error in ALARMS:
                alarm.set()

    async def monitor() -> None:
        no_answer_since = None
        last_note = 0.0
        while True:
            try:
                await asyncio.wait_for(alarm.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            alarm.clear()
            elapsed = time.perf_counter() - t0
            watcher.rss()  # the peaks
            if run.middle is None and (len(run.outcomes) >= len(specs) // 2 or elapsed >= duration_s / 2):
                run.middle = await loop.run_in_executor(None, watcher.sample)
            if not quiet and elapsed - last_note >= 15:
                last_note = elapsed
                print(f"  {elapsed:6.0f} s: {len(run.outcomes)} answered, {sum(o.result == 'served' for o in run.outcomes)} served, "
                      f"{sum(o.unexpected for o in run.outcomes)} unexpected", flush=True)
            gone = watcher.gone()
            health = None if gone else await loop.run_in_executor(None, watcher.health)
            if health == 200:
                no_answer_since = None
                continue
            if health is None and not gone:  # no answer: a busy server gets a few seconds
                no_answer_since = elapsed if no_answer_since is None else no_answer_since
                if elapsed - no_answer_since < DOWN_AFTER_S:
                    continue
            error = None if gone else await loop.run_in_executor(None, watcher.engine_error)
            why = gone or (f"/health answered {health}" if health else f"/health did not answer for {DOWN_AFTER_S:.0f} s")
            run.stopped = why + (f" (engine error: {error})" if error else "")
            run.down_at_s = round(no_answer_since if no_answer_since is not None else elapsed, 2)
            stop.set()
            return

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits) as client:
        mon = asyncio.create_task(monitor())
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        run.wall_s = time.perf_counter() - t0
        mon.cancel()
        try:
            await mon
        except asyncio.CancelledError:
            pass
    if run.middle is None:  # a run shorter than the monitor's first look
        run.middle = watcher.sample()
    if run.stopped is None and (watcher.gone() or watcher.health() != 200):  # it went down as the last requests ran
        health = None if watcher.gone() else watcher.health()
        error = watcher.engine_error()
        run.stopped = (watcher.gone() or f"/health answered {health or 'nothing'}") + (f" (engine error: {error})" if error else "")
        errs = [o.done_s for o in run.outcomes if o.error in ALARMS]
        run.down_at_s = round(min(errs), 2) if errs else round(run.wall_s, 2)
    return run


async def warm_up(base: str, model: str, clients: int, seed: int) -> None:
    rng = random.Random(f"{seed}/warm-up")
    specs = [good_spec(i, k, rng, model) for i, k in enumerate(k for k in GOOD_KINDS for _ in range(WARMUP_PER_KIND))]
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients)) as client:
        await asyncio.gather(*(send(client, base, s) for s in specs))


def _pct(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile of ``values`` (nearest rank; None for none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else None


def _change(start: float | None, end: float | None) -> float | None:
    return (end - start) / start * 100 if start and end is not None else None


def _fmt(x: float | None, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def served_model(base: str) -> str:
    r = httpx.get(base + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def summarize(run: Run, start: Sample, end: Sample, watcher: Watcher, health_end: int | None, drained: bool,
              args: argparse.Namespace, model: str, server_exit: int | None) -> dict[str, Any]:
    outs = run.outcomes
    errors = Counter(o.error for o in outs if o.error)
    lat: dict[str, list[float]] = {"chat": [], "completion": [], "stream_ttft": [], "stream_total": []}
    for o in outs:
        if o.result != "served":
            continue
        if o.spec.stream:
            if o.ttft_s is not None:
                lat["stream_ttft"].append(o.ttft_s)
            lat["stream_total"].append(o.total_s)
        else:
            lat["chat" if o.spec.endpoint == "chat" else "completion"].append(o.total_s)
    by_kind: dict[str, dict[str, int]] = {}
    for o in outs:
        row = by_kind.setdefault(o.spec.kind, Counter())
        row["sent"] += 1
        row[o.result] += 1
        row["unexpected"] += o.unexpected
    unexpected_by_kind = Counter(o.spec.kind for o in outs if o.unexpected)
    examples: dict[str, str] = {}
    for o in outs:
        if o.unexpected and o.spec.kind not in examples:
            examples[o.spec.kind] = f"{o.error or o.result}: {o.detail}"[:240]
    num_blocks = watcher.num_blocks

    def used(usage: float | None) -> int | None:
        return round(usage * num_blocks) if usage is not None and num_blocks else None

    rss = {"server": {"start": start.server_mb, "middle": run.middle.server_mb if run.middle else None, "end": end.server_mb,
                      "peak": watcher.peak_server_mb or None},
           "engine": {"start": start.engine_mb, "middle": run.middle.engine_mb if run.middle else None, "end": end.engine_mb,
                      "peak": watcher.peak_engine_mb or None}}
    change = {k: _change(v["start"], v["end"]) for k, v in rss.items()}
    kv_back = None
    if start.kv_usage is not None:  # no end figure (the server is gone): not back
        kv_back = end.kv_usage is not None and (
            used(end.kv_usage) == used(start.kv_usage) if num_blocks else abs(end.kv_usage - start.kv_usage) < 1e-9)
    return dict(
        model=model, clients=args.clients, requests_planned=args.requests, seed=args.seed, duration_bound_s=args.duration_s,
        duration_s=round(run.wall_s, 2), cpus=os.cpu_count(),
        requests_sent=len(outs), served=sum(o.result == "served" for o in outs),
        rejected_as_expected=sum(o.result == "rejected" and not o.unexpected for o in outs),
        disconnects=sum(o.result == "disconnected" for o in outs),
        requests_per_s=len(outs) / run.wall_s if run.wall_s else None,
        errors_by_kind=dict(sorted(errors.items())),
        unexpected=sum(o.unexpected for o in outs), unexpected_by_kind=dict(sorted(unexpected_by_kind.items())),
        unexpected_examples=examples,
        latency_p50_s={k: _pct(v, 50) for k, v in lat.items()}, latency_p99_s={k: _pct(v, 99) for k, v in lat.items()},
        latency_counts={k: len(v) for k, v in lat.items()},
        by_kind={k: dict(v) for k, v in sorted(by_kind.items())},
        rss_mb=rss, rss_change_pct=change,
        rss_flat_within_5pct=all(c is not None and abs(c) <= 5 for c in change.values()) if any(c is not None for c in change.values()) else None,
        engine_processes={"start": start.engine_processes, "end": end.engine_processes},
        kv_usage_start=start.kv_usage, kv_usage_middle=run.middle.kv_usage if run.middle else None, kv_usage_end=end.kv_usage, kv_num_blocks=num_blocks,
        kv_free_blocks_start=num_blocks - used(start.kv_usage) if used(start.kv_usage) is not None else None,
        kv_free_blocks_end=num_blocks - used(end.kv_usage) if used(end.kv_usage) is not None else None,
        kv_back_to_start=kv_back, drained=drained, health_end=health_end, server_exit_status=server_exit,
        stopped_early=run.stopped, server_down_at_s=run.down_at_s, suspects=run.suspects(),
        first_server_error=run.first_server_error(), excluded=sorted(args.exclude),
    )


def print_report(f: dict[str, Any]) -> None:
    print(f"\nsoak: {f['requests_sent']} requests in {f['duration_s']:.1f} s ({_fmt(f['requests_per_s'])} req/s) from {f['clients']} clients "
          f"(planned {f['requests_planned']}, bound {f['duration_bound_s']:.0f} s, seed {f['seed']})")
    if f["stopped_early"]:
        print(f"STOPPED EARLY at {f['server_down_at_s']} s: {f['stopped_early']}")
        if f["suspects"]:
            print(f"  suspects (bad requests sent in the {SUSPECT_WINDOW_S:.0f} s before, answered neither 4xx nor 503): {', '.join(f['suspects'])}")
    if f["first_server_error"]:
        print(f"first server error: {f['first_server_error']}")
    print(f"{'sent':>6} {'served':>7} {'rejected (ok)':>13} {'disconnects':>11} {'unexpected':>10}")
    print(f"{f['requests_sent']:>6} {f['served']:>7} {f['rejected_as_expected']:>13} {f['disconnects']:>11} {f['unexpected']:>10}")
    print("errors by kind: " + (", ".join(f"{k} {v}" for k, v in f["errors_by_kind"].items()) or "none"))
    print(f"\n{'kind':<32} {'sent':>5} {'served':>6} {'rejected':>8} {'disconn':>7} {'errors':>6} {'accepted':>8} {'unexpected':>10}")
    for kind, row in f["by_kind"].items():
        print(f"{kind:<32} {row.get('sent', 0):>5} {row.get('served', 0):>6} {row.get('rejected', 0):>8} {row.get('disconnected', 0):>7} "
              f"{row.get('error', 0):>6} {row.get('accepted', 0):>8} {row.get('unexpected', 0):>10}")
    for kind, text in f["unexpected_examples"].items():
        print(f"  unexpected {kind}: {text}")
    print(f"\n{'latency (served)':<18} {'count':>6} {'p50 ms':>9} {'p99 ms':>9}")
    for k in f["latency_p50_s"]:
        p50, p99 = f["latency_p50_s"][k], f["latency_p99_s"][k]
        print(f"{k:<18} {f['latency_counts'][k]:>6} {_fmt(p50 and p50 * 1e3):>9} {_fmt(p99 and p99 * 1e3):>9}")
    print(f"\n{'RSS MiB':<10} {'start':>8} {'middle':>8} {'end':>8} {'peak':>8} {'end-start':>10}")
    for k, v in f["rss_mb"].items():
        c = f["rss_change_pct"][k]
        print(f"{k:<10} {_fmt(v['start']):>8} {_fmt(v['middle']):>8} {_fmt(v['end']):>8} {_fmt(v['peak']):>8} {_fmt(c, '+.1f') + ' %':>10}")
    flat = f["rss_flat_within_5pct"]
    print(f"RSS flat within 5 %: {'-' if flat is None else 'yes' if flat else 'no'}")
    blocks = (f" of {f['kv_num_blocks']} blocks; free blocks {_fmt(f['kv_free_blocks_start'], 'd')} -> {_fmt(f['kv_free_blocks_end'], 'd')}"
              if f["kv_num_blocks"] else "")
    back = {None: "-", True: "yes", False: "no"}[f["kv_back_to_start"]]
    print(f"KV cache usage: start {_fmt(f['kv_usage_start'], '.4f')}, middle {_fmt(f['kv_usage_middle'], '.4f')}, end "
          f"{_fmt(f['kv_usage_end'], '.4f')}{blocks}; back to start: {back}; drained: {'yes' if f['drained'] else 'no'}")
    print(f"/health at the end: {f['health_end'] or 'no answer'}" + (f"; server exit status {f['server_exit_status']}" if f["server_exit_status"] is not None else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32, help="concurrent clients, 16-64 (default 32)")
    ap.add_argument("--requests", type=int, default=2000, help="requests in the mix (default 2000)")
    ap.add_argument("--duration-s", type=float, default=300.0, help="stop issuing after this many seconds (default 300)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random mix")
    ap.add_argument("--model", help="the model directory to serve (default: serve's own, the bundled model)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="a flag for `deepinfer serve` (repeatable; write --server-arg=--max-num-seqs=16)")
    ap.add_argument("--url", help="drive this running server (loopback only) instead of starting one")
    ap.add_argument("--startup-timeout", type=float, default=240.0)
    ap.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to wait for the load to drain at the end")
    ap.add_argument("--exclude", action="append", default=[], metavar="KIND",
                    help=f"leave a kind out of the mix (repeatable), e.g. a bad request a known bug answers badly; kinds: {', '.join(ALL_KINDS)}")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    add_json_flag(ap)
    args = ap.parse_args()
    if not 16 <= args.clients <= 64:
        ap.error("--clients must be within 16-64")
    if args.requests < 1 or args.duration_s <= 0:
        ap.error("--requests and --duration-s must be positive")
    unknown = set(args.exclude) - set(ALL_KINDS)
    if unknown:
        ap.error(f"--exclude: unknown kinds {', '.join(sorted(unknown))} (kinds: {', '.join(ALL_KINDS)})")
    if not set(GOOD_KINDS) - set(args.exclude):
        ap.error("--exclude leaves no good request kind")
    if args.url and not _loopback(args.url):
        ap.error("--url must be a loopback address (127.0.0.1, ::1, localhost)")
    if args.url and (args.model or args.server_arg):
        ap.error("--model and --server-arg start a server; they do not go with --url")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind like Ctrl-C: the server is stopped in ``finally``

    server = None
    log_dir = None
    try:
        if args.url:
            base = args.url.rstrip("/")
            watcher = Watcher(base, listening_pid(urlsplit(base).port or 80), None)
        else:
            from tests.helpers.servers import ServerProcess

            log_dir = Path(tempfile.mkdtemp(prefix="soak_"))
            serve_args = ["--shutdown-timeout", "5", *(["--model", args.model] if args.model else []), *args.server_arg]
            server = ServerProcess(serve_args, log_dir=log_dir, ready_timeout=args.startup_timeout)
            try:
                server.start()
            except (RuntimeError, TimeoutError) as exc:
                lines = [ln.strip() for ln in server.log_text().splitlines() if ln.strip()]
                why = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "")
                print(f"soak: error: {str(exc).splitlines()[0].rstrip(':')}: {why} (server log: {server.log_path})", file=sys.stderr)
                return 1
            base = server.url
            m = re.search(r"KV cache: (\d+) blocks", server.log_text())
            watcher = Watcher(base, server.pid, int(m.group(1)) if m else None, server.proc)
        try:
            model = served_model(base)
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            print(f"soak: error: cannot list the served model at {base}: {exc}", file=sys.stderr)
            return 1
        specs = make_mix(args.requests, args.seed, model, frozenset(args.exclude))
        print(f"soak of {base} ('{model}'): {args.requests} requests (seed {args.seed}), {args.clients} clients, at most "
              f"{args.duration_s:.0f} s; server pid {watcher.pid or 'unknown'}; {os.cpu_count()} CPUs shared with this load generator"
              + (f"; server log {server.log_path}" if server else ""), flush=True)
        asyncio.run(warm_up(base, model, args.clients, args.seed))
        watcher.drain(args.drain_timeout)
        start = watcher.sample()
        watcher.t0 = time.perf_counter()
        run = asyncio.run(drive(base, specs, args.clients, args.duration_s, watcher, args.quiet))
        drained = watcher.drain(args.drain_timeout)
        end = watcher.sample()
        health_end = watcher.health()
        figures = summarize(run, start, end, watcher, health_end, drained, args, model, watcher.exited())
    finally:
        if server is not None:
            server.close()
    print_report(figures)
    emit_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load on ``deepinfer serve`` against ``LLM.generate``: what the HTTP server costs in throughput and latency.

The script starts ``deepinfer serve`` itself (a free port, the same engine flags as the offline engine, always
stopped on exit) and drives it with a fixed, seeded workload: prompts of 16-300 tokens of text built from a
word list, streamed completions (``ignore_eos``, greedy) of 16-``--max-output`` tokens (``--workload mixed``)
or 24-96 tokens, at least 48 requests a level (``--workload short``: agents' many small calls, where the
server's per-request and per-step costs show). At each concurrency level C a closed loop of C asynchronous
clients (this process) sends the requests through each client of ``--clients``: ``raw`` (asyncio sockets,
HTTP/1.1 keep-alive, SSE events found by byte search: as near free as a client gets), ``httpx`` (SSE parsed by
hand) and ``openai`` (the SDK's streaming completions, as users' code runs); the same requests also run
offline in this process, while the server sits idle, with at most C in flight: ``LLM.generate``'s own loop
(``add_request``, ``step``) topped up as requests finish (at C = 1 literally ``LLM.generate`` of each
request). The sides (offline and each client) take turns, the order rotating from round to round (at C = 1
request by request), and each side's best of ``--repeat`` rounds counts: this machine's timings drift. Every
round has the same lengths and fresh words, so no round hits the prefix cache an earlier one filled.

Start-up (unless ``--no-startup``): seconds from launching ``deepinfer serve`` to ``/health`` 200 on a fresh
profile cache directory (cold: the engine times its cost profiles) and again on the cache that start filled
(warm); the servers and the offline engine measured after share that directory.

Per level and client: output tokens/s through the server and offline and their ratio (targets at 16 and 64
clients: >= 0.95 through the raw client, >= 0.9 through ``openai``), TTFT p50/p99 (request sent to its first chunk with tokens) and inter-token latency p50/p99 from
the server's best round as the client saw it, output tokens per engine step on either side (speculation's
adaptive policy prices drafting from each process's own step times, so the two can differ), and the CPU
the load generator took. At C = 1 also the server's added latency per request: end-to-end time through the
server (request sent to the stream's end) minus ``LLM.generate`` of the same request, run back to back,
averaged over requests and rounds.

ITL attribution: chunks carry no token counts (the completions API has them only with ``logprobs``, which
would cost the server work), so each request asks for exactly ``max_tokens`` with ``ignore_eos``, the final
usage chunk (``stream_options.include_usage``) says how many came, the first chunk counts as one token (the
prompt's step emits one) and the rest are spread evenly over the later chunks: each gap between consecutive
chunks with tokens, over that request's mean tokens per later chunk, is one ITL sample. With speculative
decoding a chunk can carry several tokens, so this smooths the p99 within a request.

The load generator shares the machine with the server: on a small CPU its parsing takes cores the server's
stepping thread and event loop could use; the printout says so and how much it took.

    .venv/bin/python benchmarks/serve_load.py [--workload mixed|short] [--clients raw,openai] [--concurrency 1,16,64]
        [--requests N] [--repeat 2] [--threads 1] [--speculative auto|dspark|none] [--max-output 128] [--no-startup] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from benchmarks.common import add_json_flag, emit_json, model_dir  # noqa: E402
from deepinfer import LLM, SamplingParams  # noqa: E402

#: words the prompts are made of (plain English, one to three tokens each)
WORDS = (
    "the of and to in is was for on that with as by at from his her they this had not are but which have one "
    "were all their when there been has more who will would about out them into some time only could other "
    "new then these two may first any like over such our made after even most also did many before must "
    "through back years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being under never day "
    "same another know while last might great old year off come since against go came right used take three "
    "river stone light north ocean table window garden market letter winter summer morning evening city road "
    "water field mountain forest island bridge school church music story paper number family friend kitchen "
    "engine signal memory cache kernel thread socket server client request reply token batch layer matrix "
    "vector tensor gradient sample random order value result figure measure simple common public private"
).split()

PROMPT_TOKENS = (16, 300)
MIN_OUTPUT_TOKENS = 16
WARMUP_REQUESTS = 2
#: the short-request workload (agents' many small calls): outputs of this many tokens, at least this many requests
SHORT_OUTPUT_TOKENS = (24, 96)
SHORT_MIN_REQUESTS = 48
#: the load generators: ``raw`` (asyncio sockets, HTTP/1.1 keep-alive, SSE events found by byte search: close to
#: free), ``httpx`` (SSE parsed by hand), ``openai`` (the SDK's streaming completions, as a user's code runs)
CLIENTS = ("raw", "httpx", "openai")


@dataclass
class WorkItem:
    """One request of the workload."""

    index: int
    prompt: str
    prompt_tokens: int
    max_tokens: int


@dataclass
class Result:
    """One request as the client (server) or the engine loop (offline) saw it; times in seconds from its send."""

    index: int
    #: from sending it (offline: ``add_request``) to its end (the stream's ``[DONE]``; offline: the step finishing it)
    e2e: float
    completion_tokens: int
    #: arrival of each chunk that carried tokens (offline: none)
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    def itl_samples(self) -> list[float]:
        """Gaps between consecutive chunks with tokens, each over the request's mean tokens per later chunk
        (the first chunk counts as one token)."""
        k = len(self.chunk_times)
        if k < 2 or self.completion_tokens < 2:
            return []
        per_chunk = (self.completion_tokens - 1) / (k - 1)
        return [(b - a) / per_chunk for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass
class Round:
    """One pass of a level's workload through the server or offline."""

    wall: float
    results: list[Result]
    #: engine steps the round took (server: from /metrics; None when not readable)
    steps: int | None = None
    #: CPU seconds the load generator (this process) spent in a server round
    client_cpu_s: float | None = None

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall


@dataclass
class LevelFigures:
    """One concurrency level and client: each side's best round, and the server's latencies in its best round."""

    concurrency: int
    client: str
    requests: int
    output_tokens: int
    server_tokens_per_s: float
    offline_tokens_per_s: float
    ratio: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    #: output tokens per engine step in the best rounds (a smaller server figure: smaller batches, or less
    #: speculation: the adaptive policy prices drafting from each process's own step times)
    server_tokens_per_step: float | None
    offline_tokens_per_step: float | None
    #: the load generator's CPU time over the server round's wall time (cores it took from the server)
    client_cpu_share: float | None


@dataclass
class AddedLatency:
    """At concurrency 1: end-to-end time per request through the server and offline, and the difference of each
    pair (a request through the server, the same request offline in the same round), averaged."""

    requests: int
    pairs: int
    server_e2e_ms: float
    offline_e2e_ms: float
    added_ms: float
    added_median_ms: float


# ----- the workload -----


def _token_counts(tokenizer: Tokenizer) -> list[int]:
    """Tokens each word adds after a space (the pre-tokenizer splits on spaces, so counts add up)."""
    return [len(tokenizer.encode(" " + w, add_special_tokens=False).ids) for w in WORDS]


def build_prompt(tokenizer: Tokenizer, costs: list[int], target: int, rng: random.Random) -> tuple[str, int]:
    """Words drawn from ``rng`` until the encoded prompt has ``target`` tokens (within a word); the text and its tokens."""
    words: list[str] = []
    estimate = len(tokenizer.encode("").ids)
    while estimate < target:
        i = rng.randrange(len(WORDS))
        words.append(WORDS[i])
        estimate += costs[i]
    text = " ".join(words)
    n = len(tokenizer.encode(text).ids)
    while n > target and len(words) > 1:
        words.pop()
        text = " ".join(words)
        n = len(tokenizer.encode(text).ids)
    return text, n


def make_workload(tokenizer: Tokenizer, costs: list[int], n: int, seed: int, level: int, round_: int,
                  outputs: tuple[int, int]) -> list[WorkItem]:
    """``n`` requests of ``outputs`` (lowest, highest) tokens: lengths from (``seed``, ``level``), words from (``seed``,
    ``level``, ``round_``); every round has the same lengths and fresh words, so no round hits the prefix cache of
    another."""
    lengths = random.Random(f"{seed}/{level}")
    words = random.Random(f"{seed}/{level}/{round_}")
    items = []
    for i in range(n):
        target = lengths.randint(*PROMPT_TOKENS)
        out = lengths.randint(*outputs)
        text, tokens = build_prompt(tokenizer, costs, target, words)
        items.append(WorkItem(i, text, tokens, out))
    return items


def params_for(item: WorkItem) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True)


# ----- the server process -----


class ServerProcess:
    """``deepinfer serve`` on a free port; ``stop`` is idempotent and also runs at exit."""

    def __init__(self, engine_args: list[str], threads: int, log: IO[bytes]) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.started = time.perf_counter()
        self.model_name = ""
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--port", str(self.port), "--shutdown-timeout", "5", *engine_args]
        self.log = log
        self.proc: subprocess.Popen | None = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        atexit.register(self.stop)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited during start-up (status {self.proc and self.proc.returncode}):\n{self.log_tail()}")
                try:
                    if client.get(self.base + "/health").status_code == 200:
                        self.ready_s = time.perf_counter() - self.started
                        self.model_name = client.get(self.base + "/v1/models").json()["data"][0]["id"]
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        raise RuntimeError(f"the server was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def steps(self) -> int | None:
        """The engine's step counter from /metrics."""
        try:
            text = httpx.get(self.base + "/metrics", timeout=30.0).text
        except httpx.HTTPError:
            return None
        m = re.search(r"^deepinfer:engine_steps(?:_total)?\{[^}]*\} ([0-9.e+]+)$", text, re.MULTILINE)
        return int(float(m.group(1))) if m else None

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM it when this benchmark dies, even by SIGKILL."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# ----- the client -----


async def _send(client: httpx.AsyncClient, url: str, item: WorkItem) -> Result:
    body = json.dumps(_request_body(item)).encode()
    chunk_times: list[float] = []
    tokens = 0
    done = False
    sent = time.perf_counter()
    async with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"request {item.index}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        buf = b""
        async for data in resp.aiter_raw():
            now = time.perf_counter() - sent
            buf += data
            while (cut := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:cut], buf[cut + 2:]
                if not event.startswith(b"data: "):
                    continue
                payload = event[6:]
                if payload == b"[DONE]":
                    done = True
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"request {item.index} failed: {chunk['error']}")
                if chunk["choices"]:
                    chunk_times.append(now)
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    ended = time.perf_counter()
    if not done:
        raise RuntimeError(f"request {item.index}: the stream ended without [DONE]")
    return Result(item.index, ended - sent, tokens, chunk_times)


def _request_body(item: WorkItem) -> dict:
    return {"prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


_USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


class RawConnection:
    """One keep-alive HTTP/1.1 connection on asyncio streams: a request written as bytes, the chunked SSE reply
    read chunk by chunk; an event with ``"choices":[{`` counts as a chunk with tokens, the usage figure is found by
    a regular expression, nothing is parsed as JSON (the client's cost stays near nothing)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, item: WorkItem) -> Result:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = json.dumps(_request_body(item)).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        sent = time.perf_counter()
        self.writer.write(head + body)
        reader = self.reader
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"request {item.index}: {status.decode(errors='replace').strip()}")
        while await reader.readline() not in (b"\r\n", b""):
            pass
        chunk_times: list[float] = []
        tokens, done, buf = 0, False, b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            now = time.perf_counter() - sent
            buf += data[:-2]
            while (cut := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:cut], buf[cut + 2:]
                if event == b"data: [DONE]":
                    done = True
                elif b'"choices":[{' in event:
                    chunk_times.append(now)
                elif b'"usage":{' in event and (m := _USAGE.search(event)):
                    tokens = int(m.group(1))
                elif b'"error"' in event:
                    raise RuntimeError(f"request {item.index} failed: {event[:300]!r}")
        if not done:
            raise RuntimeError(f"request {item.index}: the stream ended without [DONE]")
        return Result(item.index, time.perf_counter() - sent, tokens, chunk_times)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _send_openai(client, model: str, item: WorkItem) -> Result:
    chunk_times: list[float] = []
    tokens = 0
    sent = time.perf_counter()
    stream = await client.completions.create(
        model=model, prompt=item.prompt, max_tokens=item.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            chunk_times.append(time.perf_counter() - sent)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return Result(item.index, time.perf_counter() - sent, tokens, chunk_times)


async def _closed_loop(server: ServerProcess, items: list[WorkItem], concurrency: int, client_kind: str = "httpx") -> Round:
    """``concurrency`` clients each sending the next request when its last one ends, through ``client_kind``."""
    results: list[Result | None] = [None] * len(items)
    next_item = 0

    async def worker(send) -> None:
        nonlocal next_item
        while next_item < len(items):
            slot = next_item
            next_item += 1
            results[slot] = await send(items[slot])

    if client_kind == "raw":
        conns = [RawConnection("127.0.0.1", server.port) for _ in range(concurrency)]
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(worker(c.send) for c in conns))
        finally:
            for c in conns:
                c.close()
    elif client_kind == "openai":
        import openai

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with openai.AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600.0,
                                      http_client=openai.DefaultAsyncHttpxClient(limits=limits)) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(lambda item: _send_openai(client, server.model_name, item)) for _ in range(concurrency)))
    else:
        url = server.base + "/v1/completions"
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(lambda item: _send(client, url, item)) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return Round(wall, [r for r in results if r is not None])


def server_round(server: ServerProcess, items: list[WorkItem], concurrency: int, client_kind: str = "httpx") -> Round:
    before = server.steps()
    cpu0 = os.times()
    out = asyncio.run(_closed_loop(server, items, concurrency, client_kind))
    cpu1 = os.times()
    after = server.steps()
    out.steps = after - before if before is not None and after is not None else None
    out.client_cpu_s = cpu1.user + cpu1.system - cpu0.user - cpu0.system
    return out


# ----- offline -----


def offline_round(llm: LLM, items: list[WorkItem], concurrency: int) -> Round:
    """The workload with at most ``concurrency`` requests in flight: at 1, ``LLM.generate`` of each request;
    above, ``LLM.generate``'s loop (``add_request``, ``step``) topped up as requests finish."""
    engine = llm.engine
    steps0 = llm.get_metrics()["steps"]
    results: list[Result] = []
    t0 = time.perf_counter()
    if concurrency == 1:
        for item in items:
            sent = time.perf_counter()
            out = llm.generate([item.prompt], params_for(item))[0]
            results.append(Result(item.index, time.perf_counter() - sent, len(out.outputs[0].token_ids)))
    else:
        pending = iter(items)
        live: dict[str, tuple[WorkItem, float]] = {}

        def top_up() -> None:
            while len(live) < concurrency:
                item = next(pending, None)
                if item is None:
                    return
                sent = time.perf_counter()
                live[engine.add_request(item.prompt, params_for(item)).request_id] = (item, sent)

        top_up()
        while live:
            finished = [req for req in engine.step() if req.request_id in live and req.all_finished]
            for req in finished:
                item, sent = live.pop(req.request_id)
                out = engine.output(req)
                results.append(Result(item.index, time.perf_counter() - sent, len(out.outputs[0].token_ids)))
            if finished:
                engine.release([r.request_id for r in finished])
                top_up()
    wall = time.perf_counter() - t0
    return Round(wall, sorted(results, key=lambda r: r.index), llm.get_metrics()["steps"] - steps0)


# ----- figures -----


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def level_figures(concurrency: int, client: str, server: Round, offline: Round) -> LevelFigures:
    ttft = [r.ttft for r in server.results if r.ttft is not None]
    itl = [s for r in server.results for s in r.itl_samples()]
    return LevelFigures(
        concurrency=concurrency, client=client, requests=len(server.results), output_tokens=server.output_tokens,
        server_tokens_per_s=server.tokens_per_s, offline_tokens_per_s=offline.tokens_per_s,
        ratio=server.tokens_per_s / offline.tokens_per_s,
        ttft_p50_ms=1e3 * _pct(ttft, 50), ttft_p99_ms=1e3 * _pct(ttft, 99),
        itl_p50_ms=1e3 * _pct(itl, 50), itl_p99_ms=1e3 * _pct(itl, 99),
        server_tokens_per_step=server.output_tokens / server.steps if server.steps else None,
        offline_tokens_per_step=offline.output_tokens / offline.steps if offline.steps else None,
        client_cpu_share=server.client_cpu_s / server.wall if server.client_cpu_s is not None else None,
    )


def added_latency(server_rounds: list[Round], offline_rounds: list[Round]) -> AddedLatency:
    """Each request's server time minus its offline time in the same round (the same text, so the same tokens
    and much the same speculation; run back to back), averaged over requests and rounds."""
    srv = [r.e2e for rnd in server_rounds for r in rnd.results]
    off = [r.e2e for rnd in offline_rounds for r in rnd.results]
    diff = [s - o for s, o in zip(srv, off)]
    return AddedLatency(len(server_rounds[0].results), len(diff), 1e3 * float(np.mean(srv)), 1e3 * float(np.mean(off)),
                        1e3 * float(np.mean(diff)), 1e3 * float(np.median(diff)))


def _check(level: int, side: str, rnd: Round, items: list[WorkItem]) -> None:
    bad = [r.index for r in rnd.results if r.completion_tokens != items[r.index].max_tokens]
    if len(rnd.results) != len(items) or bad:
        raise RuntimeError(f"{side} at concurrency {level}: {len(rnd.results)}/{len(items)} requests came back, "
                           f"{len(bad)} with another token count than asked (ignore_eos)")


def _rotated(sides: list[str], k: int) -> list[str]:
    k %= len(sides)
    return sides[k:] + sides[:k]


def run_side(side: str, server: ServerProcess, llm: LLM, items: list[WorkItem], concurrency: int) -> Round:
    """One pass of ``items`` offline (``side`` "offline") or through the server with client ``side``."""
    return offline_round(llm, items, concurrency) if side == "offline" else server_round(server, items, concurrency, side)


def interleaved_round(server: ServerProcess, llm: LLM, items: list[WorkItem], round_: int, sides: list[str]) -> dict[str, Round]:
    """Concurrency 1 with the sides taking turns request by request (which goes first rotates by request and
    round): a request's runs are seconds apart, so the machine's drift barely enters their difference. Each
    side's round is its requests one after another (wall: the sum of their times)."""
    parts: dict[str, list[Round]] = {side: [] for side in sides}
    for item in items:
        for side in _rotated(sides, item.index + round_):
            parts[side].append(run_side(side, server, llm, [item], 1))
    return {side: _joined(p) for side, p in parts.items()}


def _joined(parts: list[Round]) -> Round:
    steps = [p.steps for p in parts]
    cpu = [p.client_cpu_s for p in parts]
    return Round(sum(p.wall for p in parts), [r for p in parts for r in p.results],
                 None if None in steps else sum(s for s in steps if s is not None),
                 None if None in cpu else sum(c for c in cpu if c is not None))


def run_level(server: ServerProcess, llm: LLM, tokenizer: Tokenizer, costs: list[int], concurrency: int, n: int,
              outputs: tuple[int, int], args: argparse.Namespace) -> tuple[list[LevelFigures], AddedLatency | None]:
    """Rounds of every side (offline and each client), the order rotating from round to round (at concurrency 1
    the sides take turns request by request); each side's best round, one row per client."""
    sides = ["offline", *args.client_list]
    rounds: dict[str, list[Round]] = {side: [] for side in sides}
    for r in range(args.repeat):
        items = make_workload(tokenizer, costs, n, args.seed, concurrency, r, outputs)
        if concurrency == 1:
            done = interleaved_round(server, llm, items, r, sides)
        else:
            done = {side: run_side(side, server, llm, items, concurrency) for side in _rotated(sides, r)}
        for side, rnd in done.items():
            rounds[side].append(rnd)
            _check(concurrency, side, rnd, items)
            print(f"  [c={concurrency} round {r + 1}/{args.repeat}] {side:<7} {rnd.tokens_per_s:8.1f} tok/s  ({rnd.wall:.1f} s)",
                  file=sys.stderr, flush=True)
    best_offline = max(rounds["offline"], key=lambda x: x.tokens_per_s)
    rows = [level_figures(concurrency, c, max(rounds[c], key=lambda x: x.tokens_per_s), best_offline) for c in args.client_list]
    extra = added_latency(rounds[args.client_list[0]], rounds["offline"]) if concurrency == 1 else None
    return rows, extra


def warm_up(server: ServerProcess, llm: LLM, tokenizer: Tokenizer, costs: list[int], outputs: tuple[int, int],
            clients: list[str]) -> None:
    """A couple of requests on each side first (first-call costs), words no measured round uses."""
    items = make_workload(tokenizer, costs, WARMUP_REQUESTS, -1, 0, 0, outputs)
    for client in clients:
        asyncio.run(_closed_loop(server, items, WARMUP_REQUESTS, client))
    offline_round(llm, items, WARMUP_REQUESTS)


@dataclass
class StartupFigures:
    """Seconds from launching ``deepinfer serve`` to ``/health`` 200: with an empty profile cache, then again with
    the cache the first start filled."""

    cold_s: float
    warm_s: float


def measure_startup(engine_args: list[str], threads: int, log: IO[bytes], timeout_s: float) -> StartupFigures:
    """Two starts of the server on a fresh ``DEEPINFER_CACHE_DIR`` (set for this process too, so the servers and
    the offline engine measured after share it)."""
    os.environ["DEEPINFER_CACHE_DIR"] = tempfile.mkdtemp(prefix="serve_load_cache_")
    times = []
    for _ in range(2):
        server = ServerProcess(engine_args, threads, log)
        try:
            server.wait_ready(timeout_s)
            times.append(server.ready_s)
        finally:
            server.stop()
    return StartupFigures(*times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--speculative", default=None, choices=["auto", "dspark", "none"], help="default: the engine's")
    ap.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: 4 x concurrency, at least 16)")
    ap.add_argument("--repeat", type=int, default=2, help="alternating server / offline rounds per level; each side's best counts")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server and of the offline engine")
    ap.add_argument("--max-output", type=int, default=128, help=f"longest output of the mixed workload (outputs are {MIN_OUTPUT_TOKENS} to this many tokens)")
    ap.add_argument("--workload", default="mixed", choices=["mixed", "short"],
                    help=f"mixed: outputs {MIN_OUTPUT_TOKENS} to --max-output tokens; short: {SHORT_OUTPUT_TOKENS[0]}-{SHORT_OUTPUT_TOKENS[1]} tokens, "
                         f"at least {SHORT_MIN_REQUESTS} requests a level")
    ap.add_argument("--clients", default="raw,openai", help=f"comma-separated load generators ({', '.join(CLIENTS)})")
    ap.add_argument("--no-startup", action="store_true", help="skip timing the server's start-up (cold and warm profile cache)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the server's /health")
    add_json_flag(ap)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.max_output < 1 or args.repeat < 1 or any(c < 1 for c in levels):
        ap.error("--max-output, --repeat and every --concurrency must be at least 1")
    args.client_list = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = [c for c in args.client_list if c not in CLIENTS]
    if unknown or not args.client_list:
        ap.error(f"--clients: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CLIENTS)}")
    short = args.workload == "short"
    outputs = SHORT_OUTPUT_TOKENS if short else (min(MIN_OUTPUT_TOKENS, args.max_output), args.max_output)

    path = model_dir(args.model)
    engine_args = ["--model", str(path), "--backend", args.backend, "--max-num-seqs", str(args.max_num_seqs)]
    engine_kwargs: dict[str, object] = dict(backend=args.backend, max_num_seqs=args.max_num_seqs)
    if args.speculative is not None:
        engine_args += ["--speculative", args.speculative]
        engine_kwargs["speculative_method"] = args.speculative
    # SIGTERM to this script unwinds like Ctrl-C, so the server is stopped in ``finally``
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    costs = _token_counts(tokenizer)
    log = tempfile.NamedTemporaryFile(prefix="serve_load_", suffix=".log", delete=False)
    startup = None if args.no_startup else measure_startup(engine_args, args.threads, log, args.startup_timeout)
    server = ServerProcess(engine_args, args.threads, log)
    try:
        torch.set_num_threads(args.threads)
        # one after the other: each engine times its start-up cost profiles (speculation's prior) undisturbed
        server.wait_ready(args.startup_timeout)
        llm = LLM(str(path), **engine_kwargs)
        warm_up(server, llm, tokenizer, costs, outputs, args.client_list)
        print(f"deepinfer serve vs LLM.generate: {path.name}, backend {args.backend}, max_num_seqs {args.max_num_seqs}, "
              f"speculative {args.speculative or 'engine default'}, {args.threads} torch thread(s) each; {args.workload} workload: "
              f"prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens, outputs {outputs[0]}-{outputs[1]} "
              f"(ignore_eos, greedy), streamed completions; clients {', '.join(args.client_list)}; best of {args.repeat} "
              f"alternating rounds; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"note: the load generator (one asyncio process, this one) shares this machine's {os.cpu_count()} CPU(s) with the "
              "server; 'client CPU' is the cores it used during the server's best round")
        rows: list[LevelFigures] = []
        added: AddedLatency | None = None
        for c in levels:
            n = args.requests if args.requests is not None else max(SHORT_MIN_REQUESTS if short else 16, (2 if short else 4) * c)
            level_rows, extra = run_level(server, llm, tokenizer, costs, c, n, outputs, args)
            rows.extend(level_rows)
            added = extra or added
        llm.close()
    except BaseException:
        print(f"server log: {log.name}", file=sys.stderr)
        raise
    else:
        Path(log.name).unlink(missing_ok=True)
    finally:
        server.stop()
        log.close()
    head = (f"{'conc':>5} {'client':>6} {'reqs':>5} | {'server tok/s':>12} {'offline tok/s':>13} {'ratio':>6} | {'TTFT p50':>8} {'p99':>8} | "
            f"{'ITL p50':>7} {'p99':>7} ms | tok/step srv  off | client CPU")
    print(head)
    for r in rows:
        steps = (f"{r.server_tokens_per_step:>8.2f} {r.offline_tokens_per_step:>5.2f}"
                 if r.server_tokens_per_step and r.offline_tokens_per_step else f"{'-':>14}")
        client = f"{r.client_cpu_share:>10.0%}" if r.client_cpu_share is not None else f"{'-':>10}"
        print(f"{r.concurrency:>5} {r.client:>6} {r.requests:>5} | {r.server_tokens_per_s:>12.1f} {r.offline_tokens_per_s:>13.1f} {r.ratio:>6.3f} | "
              f"{r.ttft_p50_ms:>8.1f} {r.ttft_p99_ms:>8.1f} | {r.itl_p50_ms:>7.1f} {r.itl_p99_ms:>7.1f}    | {steps} | {client}")
    target = {"raw": 0.95, "httpx": 0.9, "openai": 0.9}
    for client in args.client_list:
        mine = [r for r in rows if r.client == client and r.concurrency >= 16]
        below = [r.concurrency for r in mine if r.ratio < target[client]]
        if mine:
            print(f"server/offline >= {target[client]} through {client} at 16+ clients: "
                  + ("yes" if not below else f"no (below at {', '.join(map(str, below))})"))
    if added is not None:
        print(f"added latency per request at concurrency 1 (mean of {added.pairs} pairs: {added.requests} requests x "
              f"{added.pairs // added.requests} rounds): server {added.server_e2e_ms:.1f} ms - offline LLM.generate "
              f"{added.offline_e2e_ms:.1f} ms = {added.added_ms:+.1f} ms (median {added.added_median_ms:+.1f} ms), "
              f"client {args.client_list[0]}")
    if startup is not None:
        print(f"start-up until /health 200: cold (empty profile cache) {startup.cold_s:.2f} s, warm {startup.warm_s:.2f} s")
    emit_json(args.json, dict(
        model=path.name, backend=args.backend, max_num_seqs=args.max_num_seqs, speculative=args.speculative,
        threads=args.threads, repeat=args.repeat, workload=args.workload, outputs=list(outputs), clients=args.client_list,
        cpus=os.cpu_count(), load_average=list(os.getloadavg()),
        levels=[asdict(r) for r in rows], added_latency=asdict(added) if added is not None else None,
        startup=asdict(startup) if startup is not None else None,
    ))


if __name__ == "__main__":
    main()

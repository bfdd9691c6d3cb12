"""Prefill and decode apart against colocated serving, at equal processes: TTFT, throughput and what the KV transfer costs.

The script starts, side by side, one prefill + one decode ``deepinfer serve`` per connector (``mooncake``, over TCP
here, and ``store``, through a temporary directory) and two colocated servers, each on a free port with one torch
thread, and always stops them. The same seeded workload (prompts of ``--prompt-tokens`` tokens built from a word
list, ``--max-output`` tokens out, ``ignore_eos``, greedy) runs at each concurrency level C as a closed loop of C
asynchronous clients through each setup:

- PD, driven the way vLLM's router drives a pair: the prefill server gets the request with ``max_tokens: 1`` and
  ``kv_transfer_params: {"do_remote_decode": true}``, the decode server the same request with the returned
  ``kv_transfer_params``, streamed; TTFT runs from the prefill request's send to the decode stream's first token.
- colocated: the two replicas take the requests round robin, streamed; TTFT to the first token.

Rounds alternate the setups (each round starts with the next one; this machine's timings drift) and each setup's
best round by throughput counts. Every round has fresh words, so no round hits a prefix cache another filled.

Printed: per level and setup, output tokens/s and TTFT p50/p99, each next to colocated's as a ratio; per level and
connector, from the decode server's ``/metrics`` (``kv_transfers_total``, ``kv_transfer_bytes_total``,
``kv_transfer_seconds_total``) around the level and the prefill responses' prompt token counts: KV bytes per prompt
token, KB per transfer and transfer time per MB (the read plus the size and checksum check and the decoding of the
state, on a thread of the decode server's engine process, as the server times it). On a small CPU the servers and
this load generator share cores: the ratios, not the absolute figures, are what carries over.

``--hosts`` runs the same across hosts (network namespaces on one bridge, ``tests/helpers/hosts.py``; root only):
every prefill server on host 0, every decode server on host 1, the colocated replicas on hosts 2 and 3, each
listening on its host's address, this process a client on the bridge. The KV state then crosses a real network
interface (Mooncake over TCP between the hosts; the ``store`` directory is one path every host sees, as a shared
mount would be). The hosts are removed at the end, on failure too.

    .venv/bin/python benchmarks/pd_serve.py [--concurrency 1,8] [--requests N] [--repeat 2] [--max-output 32]
        [--prompt-tokens 128,768] [--connectors mooncake,store] [--speculative auto|dspark|none] [--hosts] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from benchmarks.common import add_json_flag, emit_json, load_script, model_dir  # noqa: E402

serve_load = load_script("serve_load")

WARMUP_REQUESTS = 2
#: the decode server's counters this benchmark reads (Prometheus names, ``deepinfer:`` dropped)
TRANSFER_COUNTERS = ("kv_transfers_total", "kv_transfer_bytes_total", "kv_transfer_seconds_total", "kv_transfer_failures_total")


@dataclass
class Item:
    """One request of the workload."""

    index: int
    prompt: str
    max_tokens: int


@dataclass
class Reply:
    """One request as a client saw it; times in seconds from its first send."""

    index: int
    ttft: float
    e2e: float
    completion_tokens: int
    prompt_tokens: int
    text: str


@dataclass
class Round:
    """One pass of a level's workload through one setup."""

    wall: float
    replies: list[Reply]

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.replies)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall


@dataclass
class Setup:
    """What requests go through: a prefill and a decode server (``connector`` set), or colocated replicas."""

    name: str
    urls: list[str]
    connector: str | None = None
    rounds: dict[int, list[Round]] = field(default_factory=dict)
    #: PD: the decode server's transfer counters before and after each level
    counters: dict[int, tuple[dict[str, float], dict[str, float]]] = field(default_factory=dict)


@dataclass
class LevelRow:
    """One setup at one concurrency level (its best round), next to colocated's best."""

    concurrency: int
    setup: str
    requests: int
    tokens_per_s: float
    tokens_per_s_ratio: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_p50_ratio: float
    #: replies over all rounds whose text is the colocated reply's for the same request (greedy: all of them, unless
    #: another batch composition broke a near tie), and how many were compared
    same_text: int
    compared: int


@dataclass
class ConnectorRow:
    """One connector's transfers at one concurrency level, from its decode server's /metrics."""

    connector: str
    concurrency: int
    transfers: int
    failures: int
    prompt_tokens: int
    bytes_total: int
    bytes_per_prompt_token: float
    kb_per_transfer: float
    ms_per_mb: float
    mb_per_s: float


# ----- the workload -----


def make_items(tokenizer: Tokenizer, costs: list[int], n: int, seed: int, level: int, round_: int,
               prompt_tokens: tuple[int, int], max_tokens: int) -> list[Item]:
    """``n`` requests: lengths from (``seed``, ``level``), words from (``seed``, ``level``, ``round_``)."""
    lengths = random.Random(f"{seed}/{level}")
    words = random.Random(f"{seed}/{level}/{round_}")
    return [Item(i, serve_load.build_prompt(tokenizer, costs, lengths.randint(*prompt_tokens), words)[0], max_tokens)
            for i in range(n)]


# ----- the clients -----


def _body(item: Item, **extra) -> dict:
    return {"prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0, "ignore_eos": True, **extra}


async def _stream(client: httpx.AsyncClient, url: str, body: dict, sent: float) -> tuple[float, str, dict]:
    """POST a streamed completion: (time of its first chunk with text or tokens, its text, its usage)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    first: float | None = None
    text, usage = "", {}
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            if chunk["choices"]:
                first = first if first is not None else time.perf_counter() - sent
                text += chunk["choices"][0]["text"]
            usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError(f"{url}: the stream carried no token")
    return first, text, usage


async def colocated_request(client: httpx.AsyncClient, urls: list[str], item: Item) -> Reply:
    """One request on the replica its index picks (round robin)."""
    sent = time.perf_counter()
    ttft, text, usage = await _stream(client, urls[item.index % len(urls)], _body(item), sent)
    return Reply(item.index, ttft, time.perf_counter() - sent, usage["completion_tokens"], usage["prompt_tokens"], text)


async def pd_request(client: httpx.AsyncClient, urls: list[str], item: Item) -> Reply:
    """One request as vLLM's router sends it: the prefill server computes the prompt (one token), the decode server
    fetches its state and generates."""
    prefill, decode = urls
    sent = time.perf_counter()
    r = await client.post(prefill + "/v1/completions", json=_body(item, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    if r.status_code != 200:
        raise RuntimeError(f"{prefill}: HTTP {r.status_code}: {r.text[:300]}")
    first = r.json()
    params = first["kv_transfer_params"]
    ttft, text, usage = await _stream(client, decode, _body(item, kv_transfer_params=params), sent)
    return Reply(item.index, ttft, time.perf_counter() - sent, usage["completion_tokens"], first["usage"]["prompt_tokens"], text)


async def _closed_loop(setup: Setup, items: list[Item], concurrency: int) -> Round:
    send = pd_request if setup.connector is not None else colocated_request
    replies: list[Reply] = []
    queue = iter(items)

    async def worker(client: httpx.AsyncClient) -> None:
        for item in queue:
            replies.append(await send(client, setup.urls, item))

    limits = httpx.Limits(max_connections=4 * concurrency, max_keepalive_connections=4 * concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return Round(wall, sorted(replies, key=lambda r: r.index))


def run_round(setup: Setup, items: list[Item], concurrency: int) -> Round:
    """The workload through ``setup``; every request must bring back the tokens it asked for."""
    rnd = asyncio.run(_closed_loop(setup, items, concurrency))
    short = [r.index for r in rnd.replies if r.completion_tokens != items[r.index].max_tokens]
    if len(rnd.replies) != len(items) or short:
        raise RuntimeError(f"{setup.name} at concurrency {concurrency}: {len(rnd.replies)}/{len(items)} replies, "
                           f"{len(short)} with another token count than asked (ignore_eos)")
    return rnd


# ----- the servers -----


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def role_args(role: str, connector: str, store: Path) -> list[str]:
    """A prefill or decode server's flags for ``connector`` (a prefill server on a bootstrap port of its own)."""
    args = ["--disaggregation-mode", role, "--kv-connector", connector]
    if role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(_free_port())]
    if connector == "store":
        args += ["--kv-store", str(store / connector)]
    return args


def counters(url: str) -> dict[str, float]:
    """The decode server's transfer counters from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30.0).text
    out = {}
    for name in TRANSFER_COUNTERS:
        m = re.search(rf"^deepinfer:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


class HostedServer:
    """``deepinfer serve`` on a test host (``--hosts``), with ``serve_load.ServerProcess``'s face: ``base``,
    ``wait_ready``, ``stop``."""

    def __init__(self, host, port: int, engine_args: list[str], threads: int, log_dir: Path) -> None:
        from tests.helpers.multi_host_servers import HostServer

        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.server = HostServer(host, ["--shutdown-timeout", "5", *engine_args], log_dir, env=env, port=port).launch()
        self.base = self.server.url

    def wait_ready(self, timeout_s: float) -> None:
        self.server.wait_ready(timeout_s)

    def stop(self) -> None:
        self.server.close()


# ----- figures -----


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def best(rounds: list[Round]) -> Round:
    return max(rounds, key=lambda r: r.tokens_per_s)


def level_rows(concurrency: int, setups: list[Setup], colocated: Setup) -> list[LevelRow]:
    base = best(colocated.rounds[concurrency])
    base_ttft = _pct([r.ttft for r in base.replies], 50)
    texts = {(k, r.index): r.text for k, rnd in enumerate(colocated.rounds[concurrency]) for r in rnd.replies}
    rows = []
    for setup in setups:
        rounds = setup.rounds[concurrency]
        top = best(rounds)
        ttft = [r.ttft for r in top.replies]
        same = sum(texts.get((k, r.index)) == r.text for k, rnd in enumerate(rounds) for r in rnd.replies)
        rows.append(LevelRow(concurrency, setup.name, len(top.replies), top.tokens_per_s, top.tokens_per_s / base.tokens_per_s,
                             1e3 * _pct(ttft, 50), 1e3 * _pct(ttft, 99), _pct(ttft, 50) / base_ttft, same, len(texts)))
    return rows


def connector_row(setup: Setup, concurrency: int) -> ConnectorRow:
    """What ``setup``'s decode server fetched during a level's rounds, per prompt token and per MB."""
    before, after = setup.counters[concurrency]
    replies = [r for rnd in setup.rounds[concurrency] for r in rnd.replies]
    tokens = sum(r.prompt_tokens for r in replies)
    nbytes = after["kv_transfer_bytes_total"] - before["kv_transfer_bytes_total"]
    seconds = after["kv_transfer_seconds_total"] - before["kv_transfer_seconds_total"]
    transfers = int(after["kv_transfers_total"] - before["kv_transfers_total"])
    return ConnectorRow(
        setup.connector, concurrency, transfers, int(after["kv_transfer_failures_total"] - before["kv_transfer_failures_total"]), tokens,
        int(nbytes), nbytes / tokens, nbytes / transfers / 1e3, 1e3 * seconds / (nbytes / 1e6), nbytes / 1e6 / seconds,
    )


def print_tables(levels: list[LevelRow], connectors: list[ConnectorRow]) -> None:
    print(f"{'conc':>4} {'setup':<14} {'reqs':>4} | {'out tok/s':>9} {'x coloc':>7} | {'TTFT p50':>8} {'p99':>8} ms {'x coloc':>7} | "
          f"{'same text':>9}")
    for r in levels:
        print(f"{r.concurrency:>4} {r.setup:<14} {r.requests:>4} | {r.tokens_per_s:>9.1f} {r.tokens_per_s_ratio:>7.2f} | "
              f"{r.ttft_p50_ms:>8.1f} {r.ttft_p99_ms:>8.1f}    {r.ttft_p50_ratio:>7.2f} | {f'{r.same_text}/{r.compared}':>9}")
    print(f"{'conc':>4} {'connector':<9} {'transfers':>9} {'failed':>6} | {'B/prompt tok':>12} {'KB/transfer':>11} | {'ms/MB':>7} "
          f"{'MB/s':>7}")
    for c in connectors:
        print(f"{c.concurrency:>4} {c.connector:<9} {c.transfers:>9} {c.failures:>6} | {c.bytes_per_prompt_token:>12.0f} "
              f"{c.kb_per_transfer:>11.1f} | "
              f"{c.ms_per_mb:>7.2f} {c.mb_per_s:>7.1f}")


# ----- the run -----


def measure(setups: list[Setup], tokenizer: Tokenizer, costs: list[int], levels: list[int], args: argparse.Namespace) -> None:
    """Each level's rounds, the setups taking turns (round r starts with setup r); the decode servers' transfer
    counters around each level."""
    for c in levels:
        n = args.requests if args.requests is not None else max(8, 4 * c)
        before = {s.name: counters(s.urls[1]) for s in setups if s.connector is not None}
        for r in range(args.repeat):
            items = make_items(tokenizer, costs, n, args.seed, c, r, args.prompt_tokens, args.max_output)
            for k in range(len(setups)):
                setup = setups[(r + k) % len(setups)]
                rnd = run_round(setup, items, c)
                setup.rounds.setdefault(c, []).append(rnd)
                print(f"  [c={c} round {r + 1}/{args.repeat}] {setup.name:<14} {rnd.tokens_per_s:8.1f} tok/s  ({rnd.wall:.1f} s)",
                      file=sys.stderr, flush=True)
        for s in setups:
            if s.connector is not None:
                s.counters[c] = before[s.name], counters(s.urls[1])


def warm_up(setups: list[Setup], tokenizer: Tokenizer, costs: list[int], args: argparse.Namespace) -> None:
    """A couple of requests through each setup first (first-call costs, Mooncake's first handshake)."""
    items = make_items(tokenizer, costs, WARMUP_REQUESTS, -1, 0, 0, args.prompt_tokens, args.max_output)
    for setup in setups:
        run_round(setup, items, WARMUP_REQUESTS)


def _pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError("give LOW,HIGH with 1 <= LOW <= HIGH")
    return low, high


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=None, help="requests per level and round (default: 4 x concurrency, at least 8)")
    ap.add_argument("--repeat", type=int, default=2, help="rounds per level and setup; each setup's best counts")
    ap.add_argument("--max-output", type=int, default=32, help="output tokens per request")
    ap.add_argument("--prompt-tokens", type=_pair, default=(128, 768), help="LOW,HIGH: prompt lengths drawn in this range")
    ap.add_argument("--connectors", default="mooncake,store", help="comma-separated connectors, one PD pair each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    ap.add_argument("--speculative", default=None, choices=["auto", "dspark", "none"], help="every server's (default: the engine's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for every server's /health")
    ap.add_argument("--hosts", action="store_true",
                    help="run the servers on network-namespace hosts (prefill, decode, two colocated), this process a client on "
                         "their bridge (root only)")
    add_json_flag(ap)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    if args.max_output < 2 or args.repeat < 1 or any(c < 1 for c in levels) or not connectors:
        ap.error("--max-output must be at least 2, --repeat and every --concurrency at least 1, and name a connector")

    path = model_dir(args.model)
    engine = ["--model", str(path), "--backend", args.backend, *(["--speculative", args.speculative] if args.speculative else [])]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds like Ctrl-C: the servers are stopped in ``finally``
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    costs = serve_load._token_counts(tokenizer)
    scratch = Path(tempfile.mkdtemp(prefix="pd_serve_"))
    servers: list = []
    hosts = None
    if args.hosts:
        from tests.helpers.hosts import Hosts, namespaces_unavailable

        why = namespaces_unavailable()
        if why is not None:
            ap.error(f"--hosts: {why}")
        hosts = Hosts(4).__enter__()  # prefill, decode, two colocated replicas; closed in ``finally``
        placed = [h.address for h in hosts]
        scratch.chmod(0o755)
    #: --hosts: the next free port on each host
    ports: dict[int, int] = {}

    def start(name: str, extra: list[str], where: int):
        if hosts is not None:
            port = ports[where] = ports.get(where, 8000 - 1) + 1
            servers.append(HostedServer(hosts[where], port, [*engine, *extra], args.threads, scratch))
            return servers[-1]
        log = open(scratch / f"{name}.log", "wb")
        servers.append(serve_load.ServerProcess([*engine, *extra], args.threads, log))
        return servers[-1]

    try:
        setups: list[Setup] = []
        for c in connectors:
            prefill = start(f"{c}-prefill", role_args("prefill", c, scratch), 0)
            decode = start(f"{c}-decode", role_args("decode", c, scratch), 1)
            setups.append(Setup(f"PD {c}", [prefill.base, decode.base], c))
        replicas = [start(f"colocated{k}", [], 2 + k) for k in range(2)]
        colocated = Setup("colocated x2", [s.base for s in replicas])
        setups.append(colocated)
        for server in servers:
            server.wait_ready(args.startup_timeout)
        warm_up(setups, tokenizer, costs, args)
        measure(setups, tokenizer, costs, levels, args)
    except BaseException:
        print(f"server logs: {scratch}", file=sys.stderr)
        raise
    else:
        for server in servers:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    finally:
        for server in servers:
            server.stop()
        if hosts is not None:
            hosts.close()
    where = ""
    if hosts is not None:
        where = (f"across hosts (network namespaces on one bridge): prefill on {placed[0]}, decode on {placed[1]}, colocated on "
                 f"{placed[2]} and {placed[3]}, the client on the bridge ({hosts.client}); ")
    print(f"{where}prefill + decode server vs two colocated servers: {path.name}, backend {args.backend}, {args.threads} torch thread(s) "
          f"per server, speculative {args.speculative or 'engine default'}; prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} "
          f"tokens, {args.max_output} out (ignore_eos, greedy), "
          f"PD as vLLM's router drives it, colocated round robin; best of {args.repeat} alternating rounds")
    rows = [row for c in levels for row in level_rows(c, setups, colocated)]
    transfers = [connector_row(s, c) for c in levels for s in setups if s.connector is not None]
    print_tables(rows, transfers)
    emit_json(args.json, dict(
        model=path.name, backend=args.backend, threads=args.threads, speculative=args.speculative, repeat=args.repeat, hosts=args.hosts,
        max_output=args.max_output,
        prompt_tokens=list(args.prompt_tokens), levels=[asdict(r) for r in rows], connectors=[asdict(c) for c in transfers],
    ))


if __name__ == "__main__":
    main()

"""Replicas of ``deepinfer serve`` behind a router: the prefix-cache hit rate under the ``cache_aware`` policy
against ``round_robin``, with throughput and TTFT.

The script starts as many colocated replicas as the largest count asked for (``--replicas 2 4``: four; free
ports, one after the other so each times its start-up cost profiles undisturbed, all stopped on exit), and for
each count N puts the first N behind a fresh router per policy (sglang-router by default, ``--router vllm``
for vLLM's), flushes every replica's prefix cache and sends a shared-prefix workload: ``--groups`` groups of
``--per-group`` completions, each group's prompts one long prefix (``--prefix-words`` words, several KV blocks)
and a short question of their own, sent round by round (one prompt of every group per round, groups in
order), streamed, ``--concurrency`` clients in a closed loop. A group count with no factor in common with N
(the default 5, for 2 and 4) makes round robin send every group to every replica, as it does on average over
a long run; cache-aware routing keeps each group where its prefix is.

Hit rate: prompt tokens served from the prefix cache over prompt tokens looked up, summed over the N replicas'
``/metrics`` (``deepinfer:prefix_cache_hits_total`` / ``deepinfer:prefix_cache_queries_total``), the run's
difference. ``ideal`` is every group's first prompt missing and every later one hitting the whole-block part
of the prefix its group shares (the shared token counts come from ``/v1/completions/render``). TTFT is the
time from sending a request through the router to its stream's first chunk. Replicas and load generator
share this machine's CPUs, so throughput is the machine's, not N replicas'.

    .venv/bin/python benchmarks/replica_routing.py [--replicas 2 4] [--router sglang|vllm] [--groups 5]
        [--per-group 8] [--prefix-words 200] [--concurrency 4] [--max-tokens 4] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.common import add_json_flag, emit_json  # noqa: E402
from tests.helpers.servers import ServerPool, ServerProcess  # noqa: E402
from tests.helpers.routers import router  # noqa: E402

#: the name the replicas serve (the bundled model's)
MODEL = "tiny-v4"
#: words the prompts are made of
WORDS = (
    "river stone light north ocean table window garden market letter winter summer morning evening city road "
    "water field mountain forest island bridge school church music story paper number family friend kitchen "
    "engine signal memory cache kernel thread socket server client request reply token batch layer matrix"
).split()
#: the counters read from each replica's /metrics
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "kv_store_queries", "kv_store_hits")


@dataclass(frozen=True)
class Item:
    """One request of the workload: its group and its prompt."""

    group: int
    prompt: str


@dataclass
class RunFigures:
    """One policy over one set of replicas."""

    router: str
    policy: str
    replicas: int
    requests: int
    #: prompt tokens looked up in the prefix cache, and served from it, over all replicas
    queries: float
    hits: float
    #: prompt tokens looked up on each replica (how the router spread the work)
    per_replica_queries: list[float]
    seconds: float
    ttft_ms: list[float] = field(repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def summary(self) -> dict:
        """The figures as plain values (``--json``)."""
        return {**{k: v for k, v in asdict(self).items() if k != "ttft_ms"}, "hit_rate": self.hit_rate,
                "requests_per_s": self.requests / self.seconds, "ttft_p50_ms": _pct(self.ttft_ms, 50),
                "ttft_p99_ms": _pct(self.ttft_ms, 99)}


def _pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (nearest rank; 0 for none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0


def make_workload(groups: int, per_group: int, prefix_words: int, seed: int = 0) -> list[Item]:
    """``groups`` prefixes of ``prefix_words`` seeded words (each opening differently, so a router's prefix match
    between groups is nil), ``per_group`` prompts each (the prefix, then a question of its own), round by round:
    one prompt of every group per round."""
    rng = random.Random(seed)
    prefixes = [f"Document {g}: " + " ".join(rng.choice(WORDS) for _ in range(prefix_words)) for g in range(groups)]
    return [Item(g, f"{prefixes[g]}\nQuestion {r}: where is the {rng.choice(WORDS)}?") for r in range(per_group) for g in range(groups)]


def start_replicas(pool: ServerPool, n: int, *args: str, together: bool = False) -> list[ServerProcess]:
    """``n`` ready replicas with the same flags, owned (and stopped) by ``pool``; ``together``: started side by side,
    faster, each timing its start-up cost profiles (speculation's prior) on a busier machine."""
    if not together:
        return [pool.start(*args) for _ in range(n)]
    with ThreadPoolExecutor(n) as ex:
        return list(ex.map(lambda _: pool.start(*args), range(n)))


def counters(url: str) -> dict[str, float]:
    """A replica's cache counters (tokens) from its ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {name: float(re.search(rf"^deepinfer:{name}_total\S* (\S+)$", text, re.M).group(1)) for name in COUNTERS}


def render_ids(url: str, prompt: str) -> list[int]:
    """The prompt's token ids, as the replica's completions endpoint tokenizes it."""
    r = httpx.post(url + "/v1/completions/render", json={"model": MODEL, "prompt": prompt}, timeout=60)
    r.raise_for_status()
    return r.json()[0]["token_ids"]


def ideal_hits(url: str, items: list[Item], block_size: int) -> tuple[int, int]:
    """(prompt tokens, cache hits at best) of the workload: every group's first prompt misses, every later one hits
    the whole blocks of the prefix its group shares."""
    ids = [render_ids(url, it.prompt) for it in items]
    hits = 0
    for g in sorted({it.group for it in items}):
        mine = [t for t, it in zip(ids, items) if it.group == g]
        shared = len(os.path.commonprefix(mine))
        hits += (len(mine) - 1) * (min(shared, min(map(len, mine)) - 1) // block_size * block_size)
    return sum(map(len, ids)), hits


async def _first_chunk(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> float:
    """Stream one greedy completion to its end; seconds from sending it to its first chunk."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if "error" in json.loads(line[6:]):
                    raise RuntimeError(f"the stream failed: {line[6:300]}")
                first = first if first is not None else time.perf_counter() - sent
    if first is None:
        raise RuntimeError("the stream ended without a chunk")
    return first


async def drive(url: str, items: list[Item], concurrency: int, max_tokens: int) -> list[float]:
    """Send ``items`` in order from ``concurrency`` clients in a closed loop; each request's TTFT in seconds."""
    out: list[float] = [0.0] * len(items)
    todo = iter(range(len(items)))

    async def client_loop(client: httpx.AsyncClient) -> None:
        for i in todo:
            out[i] = await _first_chunk(client, url, items[i].prompt, max_tokens)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return out


def run_policy(kind: str, policy: str, servers: list[ServerProcess], items: list[Item], log_dir: Path,
               concurrency: int = 1, max_tokens: int = 4) -> RunFigures:
    """The workload through a fresh ``kind`` router with ``policy`` over ``servers``, every prefix cache flushed first."""
    with router(kind, [s.url for s in servers], policy, log_dir / f"{kind}-{policy}-{len(servers)}.log") as url:
        for s in servers:
            httpx.post(s.url + "/flush_cache", timeout=60).raise_for_status()
        before = [counters(s.url) for s in servers]
        started = time.perf_counter()
        ttft = asyncio.run(drive(url, items, concurrency, max_tokens))
        seconds = time.perf_counter() - started
        after = [counters(s.url) for s in servers]
    queries = [a["prefix_cache_queries"] - b["prefix_cache_queries"] for a, b in zip(after, before)]
    hits = sum(a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before))
    return RunFigures(kind, policy, len(servers), len(items), sum(queries), hits, queries, seconds, [t * 1e3 for t in ttft])


def _print_table(runs: list[RunFigures], ideal: float) -> dict[str, float]:
    """The runs side by side, per replica count; the cache_aware / round_robin hit-rate ratio per count."""
    print(f"{'replicas':>8} {'policy':<12} {'hit rate':>8} {'ideal':>6} {'hits / queries (tokens)':>24} {'req/s':>6} "
          f"{'TTFT p50':>8} {'p99 ms':>7}  prompt tokens per replica")
    ratios = {}
    for n in sorted({r.replicas for r in runs}):
        mine = {r.policy: r for r in runs if r.replicas == n}
        for r in mine.values():
            s = r.summary()
            print(f"{n:>8} {r.policy:<12} {r.hit_rate:>8.1%} {ideal:>6.1%} {f'{r.hits:.0f} / {r.queries:.0f}':>24} "
                  f"{s['requests_per_s']:>6.1f} {s['ttft_p50_ms']:>8.1f} {s['ttft_p99_ms']:>7.1f}  "
                  f"{' '.join(f'{q:.0f}' for q in r.per_replica_queries)}")
        if "cache_aware" in mine and "round_robin" in mine and mine["round_robin"].hit_rate > 0:
            ratios[str(n)] = mine["cache_aware"].hit_rate / mine["round_robin"].hit_rate
            print(f"{'':>8} cache_aware / round_robin hit rate: {ratios[str(n)]:.2f}x")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 4], help="replica counts to run (default: 2 4)")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    ap.add_argument("--router", choices=["sglang", "vllm"], default="sglang")
    ap.add_argument("--groups", type=int, default=5, help="prefix groups (best with no factor in common with a replica count)")
    ap.add_argument("--per-group", type=int, default=8, help="prompts per group")
    ap.add_argument("--prefix-words", type=int, default=200, help="words in each group's prefix")
    ap.add_argument("--concurrency", type=int, default=4, help="clients in the closed loop")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens generated per request (greedy, ignore_eos)")
    ap.add_argument("--together", action="store_true", help="start the replicas side by side (faster start-up)")
    add_json_flag(ap)
    args = ap.parse_args()
    if min(args.replicas) < 1 or args.groups < 1 or args.per_group < 2 or args.concurrency < 1:
        ap.error("--replicas and --groups must be at least 1, --per-group at least 2, --concurrency at least 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind like Ctrl-C: the replicas and routers are stopped

    items = make_workload(args.groups, args.per_group, args.prefix_words)
    log_dir = Path(tempfile.mkdtemp(prefix="replica_routing_"))
    runs: list[RunFigures] = []
    with ServerPool(log_dir) as pool:
        servers = start_replicas(pool, max(args.replicas), together=args.together)
        block = httpx.get(servers[0].url + "/server_info", timeout=30).json()["engine_config"]["block_size"]
        tokens, best = ideal_hits(servers[0].url, items, block)
        print(f"{args.router}-router over colocated replicas of {MODEL}: {args.groups} groups x {args.per_group} prompts "
              f"({tokens} prompt tokens; each group shares {best // (args.groups * (args.per_group - 1))} tokens, "
              f"block {block}), round by round, {args.concurrency} client(s), {args.max_tokens} streamed tokens each; "
              f"{os.cpu_count()} CPUs shared by replicas, router and client; logs in {log_dir}")
        for n in args.replicas:
            for policy in args.policies:
                runs.append(run_policy(args.router, policy, servers[:n], items, log_dir, args.concurrency, args.max_tokens))
    ratios = _print_table(runs, best / tokens)
    emit_json(args.json, dict(
        router=args.router, groups=args.groups, per_group=args.per_group, prompt_tokens=tokens, block_size=block,
        concurrency=args.concurrency, max_tokens=args.max_tokens, cpus=os.cpu_count(), ideal_hit_rate=best / tokens,
        runs=[r.summary() for r in runs], cache_aware_over_round_robin=ratios,
    ))


if __name__ == "__main__":
    main()

"""Replicas of ``deepinfer serve`` on different hosts (network namespaces on one bridge, ``tests/helpers/hosts.py``),
each listening on every interface, behind ``sglang-router`` and ``vllm-router`` (``cache_aware``) on a third host;
this test process is a client on the bridge.

- The prefix-cache hit rate over the replicas is what it is on one host: every prompt after its group's first
  hits the group's whole shared prefix (the workload of ``benchmarks/replica_routing.py``).
- A replica whose cable is cut is dropped by the router (its health checks fail) and the requests it would have
  served are retried on the other (the router's own retries): every request is served, none hangs. With the
  cable back, the replica serves again, never restarted.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from benchmarks.common import load_script
from tests.helpers.hosts import Hosts, namespaces_unavailable
from tests.helpers.multi_host_servers import HostServer, routed, start_all
from tests.helpers.routers import sglang_router_command, vllm_router_command

pytestmark = [pytest.mark.slow, pytest.mark.skipif(namespaces_unavailable() is not None,
                                                   reason=namespaces_unavailable() or "")]

bench = load_script("replica_routing")
MODEL = bench.MODEL
QUICK = ["--speculative", "none", "--max-num-seqs", "4"]
#: three prefix groups over two replicas, as tests/serving/test_serve_replicas.py sends them on one host
GROUPS, PER_GROUP, PREFIX_WORDS = 3, 4, 160
#: the routers notice a replica gone within about a second (health checks) and retry what it failed
ROUTER_FLAGS = ["--health-check-interval-secs", "1", "--health-check-timeout-secs", "1", "--health-failure-threshold", "1",
                "--retry-max-retries", "5", "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "1000",
                "--request-timeout-secs", "6", "--worker-startup-timeout-secs", "120"]
#: seconds any one request may take through the router while a replica's link is down (retries included)
REQUEST_BOUND_S = 45.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[Hosts, list[HostServer]]]:
    log_dir = tmp_path_factory.mktemp("multi-host-replicas")
    with Hosts(3) as hosts:
        replicas = [HostServer(hosts[i], QUICK, log_dir, bind="0.0.0.0") for i in range(2)]
        start_all(replicas)
        yield hosts, replicas


def _router(kind: str, replicas: list[HostServer], policy: str = "cache_aware") -> list[str]:
    start = vllm_router_command() if kind == "vllm" else sglang_router_command()
    return [*start, "--worker-urls", *(r.url for r in replicas), "--policy", policy, *ROUTER_FLAGS]


def _metric(server: HostServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return float(re.search(rf"^deepinfer:{name}\S* (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_cache_aware_across_hosts_hits_as_on_one_host(cluster, kind, tmp_path):
    hosts, replicas = cluster
    items = bench.make_workload(GROUPS, PER_GROUP, PREFIX_WORDS)
    block = httpx.get(replicas[0].url + "/server_info", timeout=30).json()["engine_config"]["block_size"]
    tokens, ideal = bench.ideal_hits(replicas[0].url, items, block)
    with routed(hosts[2], _router(kind, replicas), tmp_path / "router.log") as url:
        for r in replicas:
            httpx.post(r.url + "/flush_cache", timeout=60).raise_for_status()
        before = [bench.counters(r.url) for r in replicas]
        asyncio.run(bench.drive(url, items, 1, 4))
        after = [bench.counters(r.url) for r in replicas]
    queries = sum(a["prefix_cache_queries"] - b["prefix_cache_queries"] for a, b in zip(after, before))
    hits = sum(a["prefix_cache_hits"] - b["prefix_cache_hits"] for a, b in zip(after, before))
    assert queries == tokens
    assert hits == ideal, (hits, ideal)  # every prompt after its group's first hit the group's whole shared prefix


def _complete(url: str, i: int) -> tuple[int, float, str]:
    t0 = time.monotonic()
    try:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": f"Request {i}: def read_file(path):",
                                                      "max_tokens": 4, "temperature": 0.0, "ignore_eos": True},
                       timeout=REQUEST_BOUND_S + 15)
        return r.status_code, time.monotonic() - t0, r.text[:300]
    except httpx.HTTPError as exc:
        return -1, time.monotonic() - t0, f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_replica_whose_link_goes_down_is_dropped_and_its_requests_retried(cluster, kind, tmp_path):
    hosts, replicas = cluster
    lost, kept = replicas
    with routed(hosts[2], _router(kind, replicas, "round_robin"), tmp_path / "router.log") as url:
        # both replicas serve (round robin: the cut replica would take every other request)
        before = [_metric(r, "generation_tokens_total") for r in replicas]
        with ThreadPoolExecutor(4) as pool:
            assert all(code == 200 for code, _, _ in pool.map(lambda i: _complete(url, i), range(4)))
        assert all(_metric(r, "generation_tokens_total") > b for r, b in zip(replicas, before))
        lost.host.link_down()
        try:
            kept_before = _metric(kept, "generation_tokens_total")
            with ThreadPoolExecutor(6) as pool:
                results = list(pool.map(lambda i: _complete(url, 100 + i), range(12)))
            assert all(code == 200 for code, _, _ in results), results
            assert max(took for _, took, _ in results) < REQUEST_BOUND_S, results
            assert _metric(kept, "generation_tokens_total") - kept_before >= 12 * 4  # every one served by the kept replica
        finally:
            lost.host.link_up()
        # the cable back: the replica (never restarted) answers again, directly and through the router
        assert httpx.get(lost.url + "/health", timeout=30).status_code == 200
        assert lost.proc.poll() is None
        deadline = time.monotonic() + 30
        lost_before = _metric(lost, "generation_tokens_total")
        while _metric(lost, "generation_tokens_total") == lost_before:
            assert time.monotonic() < deadline, "the router never sent the replica a request again"
            code, _, text = _complete(url, 999)
            assert code == 200, text

"""Prefill and decode on different hosts (network namespaces on one bridge, ``tests/helpers/hosts.py``), as they
are deployed: the prefill servers on host A (EP 1), the decode servers on host B (the Mooncake one at EP 2), a
colocated server and the routers (``vllm-router``, ``sglang-router``, their PD modes) on host C; this test
process is a client on the bridge. Nothing crosses a loopback between hosts.

- Through either router, greedy outputs equal the colocated server's; the KV state moves over Mooncake (TCP)
  from A's address, or through ``--kv-connector store`` on a directory both hosts see (it stands in for 3FS).
- A's link down while states wait to be read: the affected requests fail (or recompute, under
  ``--kv-load-failure-policy recompute``) within the decode server's ``--kv-transfer-timeout``, the decode
  host keeps serving, its load returns to 0 and its cache to where it started; A's link back up, new requests
  succeed with no restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers.disaggregation import BODY, PROMPTS, metric, prefill_then_decode
from tests.helpers.hosts import Hosts, namespaces_unavailable
from tests.helpers.multi_host_servers import BOOTSTRAP_PORT, SERVE_PORT, HostServer, routed, start_all
from tests.helpers.routers import sglang_router_command, vllm_router_command

pytestmark = [pytest.mark.slow, pytest.mark.skipif(namespaces_unavailable() is not None,
                                                   reason=namespaces_unavailable() or "")]

#: small and quick: no draft model, few sequences at once
QUICK = ["--speculative", "none", "--max-num-seqs", "4"]
#: seconds the decode servers give a transfer (and the prefill servers a published state): small, so faults end soon
TRANSFER_TIMEOUT_S = 3
#: how long a failed transfer may take past the timeout (the engine's step, the HTTP round trips, a busy machine)
SLACK_S = 20.0
#: the store pair's ports (the Mooncake pair is on SERVE_PORT, its bootstrap port BOOTSTRAP_PORT)
STORE_PORT, STORE_BOOTSTRAP_PORT = SERVE_PORT + 1, BOOTSTRAP_PORT + 1
#: the ports of the prefill server listening on every interface (``--host 0.0.0.0``)
ANY_PORT, ANY_BOOTSTRAP_PORT = SERVE_PORT + 2, BOOTSTRAP_PORT + 2


class Cluster:
    """The hosts and servers every test of this module shares."""

    def __init__(self, hosts: Hosts, store: Path, log_dir: Path) -> None:
        self.hosts, self.store, self.log_dir = hosts, store, log_dir
        a, b, c = hosts
        timeout = ["--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S)]
        shared = ["--kv-connector", "store", "--kv-store", str(store)]
        self.prefill = HostServer(a, ["--disaggregation-mode", "prefill", "--kv-connector", "mooncake",
                                      "--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT), *timeout, *QUICK], log_dir)
        self.decode = HostServer(b, ["--disaggregation-mode", "decode", "--kv-connector", "mooncake", "--ep", "2", *timeout, *QUICK],
                                 log_dir)
        # the store pair listens on every interface; its decode server recomputes what it cannot fetch
        self.store_prefill = HostServer(a, ["--disaggregation-mode", "prefill", *shared, "--disaggregation-bootstrap-port",
                                            str(STORE_BOOTSTRAP_PORT), *timeout, *QUICK], log_dir, port=STORE_PORT, bind="0.0.0.0")
        self.store_decode = HostServer(b, ["--disaggregation-mode", "decode", *shared, "--kv-load-failure-policy", "recompute",
                                           *timeout, *QUICK], log_dir, port=STORE_PORT, bind="0.0.0.0")
        # as most deployments start it: listening on every interface, its advertised address its own to choose
        self.prefill_any = HostServer(a, ["--disaggregation-mode", "prefill", "--kv-connector", "mooncake",
                                          "--disaggregation-bootstrap-port", str(ANY_BOOTSTRAP_PORT), *timeout, *QUICK], log_dir,
                                      port=ANY_PORT, bind="0.0.0.0")
        self.colocated = HostServer(c, QUICK, log_dir)
        self.servers = [self.prefill, self.decode, self.store_prefill, self.store_decode, self.prefill_any, self.colocated]
        self._expected: dict[str, str] = {}

    def expected(self, prompt: str) -> str:
        """The colocated server's greedy text for ``prompt``."""
        if prompt not in self._expected:
            r = httpx.post(self.colocated.url + "/v1/completions", json={**BODY, "prompt": prompt}, timeout=120)
            assert r.status_code == 200, r.text
            self._expected[prompt] = r.json()["choices"][0]["text"]
        return self._expected[prompt]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    log_dir = tmp_path_factory.mktemp("multi-host-pd")
    with Hosts(3) as hosts:
        c = Cluster(hosts, tmp_path_factory.mktemp("shared-kv-store"), log_dir)
        start_all(c.servers)
        yield c


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _load(server: HostServer) -> list[dict]:
    return httpx.get(server.url + "/get_load", timeout=30).json()


def _assert_idle_and_free(server: HostServer, timeout_s: float = 30.0) -> None:
    """The server answers, runs nothing and holds no cache block (a prefill server's held states expire first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        idle = _load(server) == [{"num_tokens": 0, "num_reqs": 0, "num_waiting_reqs": 0}]
        free = metric(server.url, "kv_cache_usage_perc") == 0
        if idle and free:
            return
        assert time.monotonic() < deadline, (_load(server), metric(server.url, "kv_cache_usage_perc"), server.log_tail())
        time.sleep(0.2)


def _pd_router(kind: str, prefill: HostServer, bootstrap_port: int, decode: HostServer) -> list[str]:
    if kind == "vllm":
        return [*vllm_router_command(), "--vllm-pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url]
    return [*sglang_router_command(), "--pd-disaggregation", "--prefill", prefill.url, str(bootstrap_port), "--decode", decode.url]


# ----- across hosts, through the routers -----


def test_the_prefill_server_offers_its_hosts_address(cluster):
    """The Mooncake session a decode server reads from is host A's address, reachable from B, never loopback."""
    r = httpx.post(cluster.prefill.url + "/v1/completions", json={**BODY, "prompt": PROMPTS[0], "max_tokens": 1,
                                                                  "kv_transfer_params": {"do_remote_decode": True}}, timeout=120)
    assert r.status_code == 200, r.text
    session = r.json()["kv_transfer_params"]["location"]["session"]
    assert session.rsplit(":", 1)[0] == cluster.hosts[0].address, session
    # read it from B (else it waits out the timeout, holding its blocks)
    got = httpx.post(cluster.decode.url + "/v1/completions", json={**BODY, "prompt": PROMPTS[0],
                                                                    "kv_transfer_params": r.json()["kv_transfer_params"]}, timeout=120)
    assert _text(got) == cluster.expected(PROMPTS[0])


def test_a_prefill_server_on_every_interface_offers_a_reachable_address(cluster):
    """``--host 0.0.0.0`` and no ``--advertise-host``: the Mooncake session offered is the address of A's interface
    that routes off the host (never 127.0.0.1, which B would reach as itself), and B reads the state from there."""
    params = _publish(cluster.prefill_any, PROMPTS[0])
    session = params["location"]["session"]
    try:
        assert session.rsplit(":", 1)[0] == cluster.hosts[0].address, session
    finally:  # read it from B either way (a state nobody reads waits out the timeout, holding its blocks)
        got, _ = _decode(cluster.decode, PROMPTS[0], params)
    assert _text(got) == cluster.expected(PROMPTS[0])


@pytest.mark.parametrize("connector", ["mooncake", "store"])
@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_pd_across_hosts_behind_a_router_gives_the_colocated_outputs(cluster, kind, connector, tmp_path):
    prefill, decode, boot = ((cluster.prefill, cluster.decode, BOOTSTRAP_PORT) if connector == "mooncake"
                             else (cluster.store_prefill, cluster.store_decode, STORE_BOOTSTRAP_PORT))
    computed = metric(decode.url, "prefill_tokens_computed_total")
    moved = metric(decode.url, "kv_transfers_total")
    with routed(cluster.hosts[2], _pd_router(kind, prefill, boot, decode), tmp_path / "router.log") as url:
        for prompt in PROMPTS:
            assert _text(httpx.post(url + "/v1/completions", json={**BODY, "prompt": prompt}, timeout=120)) == cluster.expected(prompt)
    assert metric(decode.url, "kv_transfers_total") >= moved + len(PROMPTS)  # the states moved between the hosts
    assert metric(decode.url, "prefill_tokens_computed_total") == computed  # and the decode host computed no prompt
    assert metric(decode.url, "kv_transfers_recomputed_total") == 0
    _assert_idle_and_free(decode)


# ----- link faults -----


def _publish(prefill: HostServer, prompt: str) -> dict:
    r = httpx.post(prefill.url + "/v1/completions", json={**BODY, "prompt": prompt, "max_tokens": 1,
                                                          "kv_transfer_params": {"do_remote_decode": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _decode(decode: HostServer, prompt: str, params: dict | None = None, **fields) -> tuple[httpx.Response, float]:
    """A decode request (with ``params``, or SGLang's bootstrap ``fields``); its response and how long it took."""
    body = {**BODY, "prompt": prompt, **({"kv_transfer_params": params} if params is not None else {}), **fields}
    t0 = time.monotonic()
    r = httpx.post(decode.url + "/v1/completions", json=body, timeout=120)
    return r, time.monotonic() - t0


def _long_prompt(i: int) -> str:
    return f"# part {i}\n" + "import numpy as np\n" * 10


def test_prefill_link_down_mid_transfer_fails_its_requests_in_bounded_time(cluster):
    """States published on A, A's cable cut before B read them (a burst, the cut once the first read landed):
    every request is served whole or fails with the transfer's one line within the timeout; B serves on, idle and
    free after; A's cable back, new requests succeed (no restart) and A frees the states nobody read."""
    a = cluster.hosts[0]
    prefill, decode = cluster.prefill, cluster.decode
    start_usage = metric(decode.url, "kv_cache_usage_perc")
    prompts = [_long_prompt(i) for i in range(4)]  # at most --max-num-seqs held at once
    params = [_publish(prefill, p) for p in prompts]
    store_params = _publish(cluster.store_prefill, PROMPTS[0])  # while A's link is up
    failures = metric(decode.url, "kv_transfer_failures_total")
    transfers = metric(decode.url, "kv_transfers_total")
    try:
        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            first = pool.submit(_decode, decode, prompts[0], params[0])
            first.result()
            a.link_down()
            pending = [first, *(pool.submit(_decode, decode, p, q) for p, q in zip(prompts[1:], params[1:]))]
            # meanwhile the decode host serves a request of the store pair (its state never crosses A's link)
            local = pool.submit(_decode, cluster.store_decode, PROMPTS[0], store_params)
            replies = [f.result() for f in pending]
            assert _text(local.result()[0]) == cluster.expected(PROMPTS[0])
        served = [r for r, _ in replies if r.status_code == 200]
        assert served and replies[0][0].status_code == 200
        for r, took in replies[1:]:
            assert r.status_code == 500, r.text
            message = r.json()["error"]["message"]
            assert "KV transfer" in message and "\n" not in message, message
            assert took < TRANSFER_TIMEOUT_S + SLACK_S, (took, message)
        for r in served:
            assert r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
        assert metric(decode.url, "kv_transfer_failures_total") == failures + len(replies) - len(served)
        assert metric(decode.url, "kv_transfers_total") == transfers + len(served)
        _assert_idle_and_free(decode)
        assert metric(decode.url, "kv_cache_usage_perc") == start_usage
    finally:
        a.link_up()
    # the link is back: the same servers serve again, and A released every state nobody read
    assert _text(prefill_then_decode(prefill.url, decode.url, PROMPTS[1])) == cluster.expected(PROMPTS[1])
    _assert_idle_and_free(prefill)
    _assert_idle_and_free(decode)


def test_prefill_link_down_under_recompute_and_the_bootstrap_room(cluster):
    """SGLang's way: a decode request names A's bootstrap port, which cannot be reached with A's cable cut: under
    ``--kv-load-failure-policy recompute`` the decode host computes the prompt (the colocated output), within
    the bounded wait; the failing policy fails it alike, in bounded time; no block is left on B."""
    a = cluster.hosts[0]
    computed = metric(cluster.store_decode.url, "prefill_tokens_computed_total")
    a.link_down()
    try:
        with ThreadPoolExecutor(2) as pool:
            kept = pool.submit(_decode, cluster.store_decode, PROMPTS[1], None, bootstrap_host=a.address,
                               bootstrap_port=STORE_BOOTSTRAP_PORT, bootstrap_room=7001)
            lost = pool.submit(_decode, cluster.decode, PROMPTS[1], None, bootstrap_host=a.address,
                               bootstrap_port=BOOTSTRAP_PORT, bootstrap_room=7002)
            (kept, kept_s), (lost, lost_s) = kept.result(), lost.result()
        assert _text(kept) == cluster.expected(PROMPTS[1])
        assert metric(cluster.store_decode.url, "prefill_tokens_computed_total") > computed  # B computed the prompt
        assert lost.status_code == 500 and "bootstrap port" in lost.json()["error"]["message"], lost.text
        assert max(kept_s, lost_s) < 5 + 2 + SLACK_S, (kept_s, lost_s)  # connect bound + one poll + slack
        _assert_idle_and_free(cluster.store_decode)
        _assert_idle_and_free(cluster.decode)
    finally:
        a.link_up()

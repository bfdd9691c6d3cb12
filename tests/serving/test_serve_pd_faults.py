"""Faults of disaggregated serving over Mooncake's transfer engine (TCP here), with real server processes: a prefill
server killed before or while its state is pulled, or frozen, fails those requests alone, with one line naming the
transfer, and the decode server goes on with its cache free; a state the decode side read is freed on the prefill
side at once, one nobody pulls after the timeout; a transfer whose size or checksum was tampered with is refused,
never decoded from."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.helpers.servers import ServerProcess, free_port
from tests.helpers.disaggregation import BODY, PROMPTS, metric, prefill_then_decode

pytestmark = pytest.mark.slow

DECODE = ["--disaggregation-mode", "decode", "--kv-connector", "mooncake"]
#: Mooncake gives up on a transfer that makes no progress after this many seconds (its default: 30)
TRANSFER_TIMEOUT_S = 5
#: seconds a failed pull may take: a dead peer fails it at once, a silent one after the transfer timeout
PULL_BOUND_S = 60.0


def prefill_args(*extra: str) -> list[str]:
    """A mooncake prefill server's flags, on a bootstrap port of its own (several run at once)."""
    return ["--disaggregation-mode", "prefill", "--kv-connector", "mooncake", "--disaggregation-bootstrap-port", str(free_port()), *extra]


@contextmanager
def started(log_dir: Path, *arg_lists: list[str]) -> Iterator[list[ServerProcess]]:
    """Servers started side by side (their loading overlaps); every one stopped at the end, on failure too."""
    servers = []
    for k, args in enumerate(arg_lists):
        (log_dir / f"server{k}").mkdir(parents=True, exist_ok=True)
        servers.append(ServerProcess(args, env={"MC_TRANSFER_TIMEOUT": str(TRANSFER_TIMEOUT_S)}, log_dir=log_dir / f"server{k}"))
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(ServerProcess.start, servers))
        yield servers
    finally:
        for server in servers:
            server.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A prefill server (the default timeout) and the decode server every test of this module shares."""
    with started(tmp_path_factory.mktemp("pair"), prefill_args(), DECODE) as (prefill, decode):
        yield prefill, decode


def prefill_only(url: str, prompt: str) -> dict:
    """The prefill server's ``kv_transfer_params`` for ``prompt`` (the router's first request)."""
    r = httpx.post(url + "/v1/completions", json={**BODY, "prompt": prompt, "max_tokens": 1,
                                                  "kv_transfer_params": {"do_remote_decode": True}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def decode_with(url: str, prompt: str, params: dict) -> httpx.Response:
    """The router's second request: the decode server generates from the prefill server's state."""
    return httpx.post(url + "/v1/completions", json={**BODY, "prompt": prompt, "kv_transfer_params": params}, timeout=120)


def transfer_failure(r: httpx.Response) -> str:
    """The one-line error of a request whose KV transfer failed (asserted to be one)."""
    assert r.status_code == 500, r.text
    body = r.json()
    assert "choices" not in body, "a failed transfer must not be decoded from"
    message = body["error"]["message"]
    assert "KV transfer" in message and "prefill server" in message and "\n" not in message, message
    return message


def transfer_counts(url: str) -> tuple[float, float, float]:
    """The decode server's (transfers, failed transfers, generated tokens)."""
    return metric(url, "kv_transfers_total"), metric(url, "kv_transfer_failures_total"), metric(url, "generation_tokens_total")


def assert_idle_and_free(server: ServerProcess) -> None:
    """The server is healthy, runs nothing and holds no cache block."""
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200, server.log_tail()
    assert httpx.get(server.url + "/get_load", timeout=30).json() == [{"num_tokens": 0, "num_reqs": 0, "num_waiting_reqs": 0}]
    assert metric(server.url, "kv_cache_usage_perc") == 0
    assert metric(server.url, "num_requests_running") == 0


def wait_formetric(url: str, name: str, at_least: float, timeout_s: float = 60.0) -> None:
    """Until the server's counter ``name`` reaches ``at_least``."""
    deadline = time.monotonic() + timeout_s
    while metric(url, name) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}"
        time.sleep(0.02)


def wait_until_free(server: ServerProcess, timeout_s: float = 30.0) -> None:
    """Until the server holds no cache block (a prefill server holds a published state's blocks until it is read)."""
    deadline = time.monotonic() + timeout_s
    while metric(server.url, "kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "the server still holds cache blocks"
        time.sleep(0.05)


def long_prompt(i: int) -> str:
    """About 900 tokens (a few hundred KB of state), different from its first token on."""
    return f"# part {i}\n" + "import numpy as np\n" * 110


def test_prefill_server_killed_before_or_while_the_pull(pair, tmp_path):
    """SIGKILL of a prefill server's group between its answer and the pull, and during a burst of pulls."""
    prefill, decode = pair
    expected = prefill_then_decode(prefill.url, decode.url, PROMPTS[1])
    assert expected.status_code == 200, expected.text
    with started(tmp_path, prefill_args(), prefill_args()) as (doomed, doomed_too):
        # killed after it answered, before the decode server pulls
        ok = prefill_then_decode(doomed.url, decode.url, PROMPTS[0])
        assert ok.status_code == 200, ok.text
        transfers, failures, generated = transfer_counts(decode.url)
        t0 = time.monotonic()
        lost = prefill_then_decode(doomed.url, decode.url, PROMPTS[1], before_decode=doomed.kill)
        took = time.monotonic() - t0
        assert "is the prefill server alive?" in transfer_failure(lost)
        assert took < PULL_BOUND_S
        assert transfer_counts(decode.url) == (transfers, failures + 1, generated)
        assert_idle_and_free(decode)
        # the decode server goes on with another prefill server, and its outputs are what they were
        again = prefill_then_decode(prefill.url, decode.url, PROMPTS[1])
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
        # a state once read is freed on the prefill side at once (well before the minute's timeout), not expired
        wait_until_free(prefill)
        assert metric(prefill.url, "kv_transfers_expired_total") == 0

        # killed while a burst of decode requests pulls long prompts' states, once the first pull landed;
        # the rest of the burst comes after the kill: every request is served whole or fails with the
        # transfer's error, and the counters add up
        prompts = [long_prompt(i) for i in range(8)]
        params = [prefill_only(doomed_too.url, p) for p in prompts]
        transfers, failures, _ = transfer_counts(decode.url)
        with ThreadPoolExecutor(len(prompts)) as pool:
            pending = [pool.submit(decode_with, decode.url, p, q) for p, q in zip(prompts[:4], params)]
            wait_formetric(decode.url, "kv_transfers_total", transfers + 1)
            doomed_too.kill()
            pending += [pool.submit(decode_with, decode.url, p, q) for p, q in zip(prompts[4:], params[4:])]
            replies = [f.result() for f in pending]
    served = [r for r in replies if r.status_code == 200]
    assert 1 <= len(served) <= 4, [r.text for r in replies]
    for r in served:
        assert r.json()["usage"]["completion_tokens"] == BODY["max_tokens"]
    for r in replies:
        if r.status_code != 200:
            transfer_failure(r)
    now = transfer_counts(decode.url)
    assert now[:2] == (transfers + len(served), failures + len(replies) - len(served))
    assert_idle_and_free(decode)


def test_a_frozen_prefill_server_fails_the_pull_in_bounded_time(pair, tmp_path):
    """A prefill server that stops answering (SIGSTOP) mid-conversation: Mooncake's transfer timeout ends the pull,
    and meanwhile the decode server keeps generating for another prefill server."""
    prefill, decode = pair
    with started(tmp_path, prefill_args()) as (frozen,):
        warm = prefill_then_decode(frozen.url, decode.url, PROMPTS[0])  # the transfer engines know each other
        assert warm.status_code == 200, warm.text
        params = prefill_only(frozen.url, PROMPTS[1])
        transfers, failures, _ = transfer_counts(decode.url)
        os.killpg(frozen.pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(1) as pool:
                t0 = time.monotonic()
                stuck = pool.submit(decode_with, decode.url, PROMPTS[1], params)
                meanwhile = prefill_then_decode(prefill.url, decode.url, PROMPTS[0])
                assert meanwhile.status_code == 200 and meanwhile.json()["choices"][0]["text"] == warm.json()["choices"][0]["text"]
                message = transfer_failure(stuck.result())
                took = time.monotonic() - t0
        finally:
            frozen.kill()
    assert "is the prefill server alive?" in message and took < PULL_BOUND_S, (message, took)
    assert transfer_counts(decode.url)[:2] == (transfers + 1, failures + 1)
    assert_idle_and_free(decode)


def test_a_state_nobody_pulls_is_released_after_the_timeout(pair, tmp_path):
    _, decode = pair
    with started(tmp_path, prefill_args("--kv-transfer-timeout", "3")) as (prefill,):
        assert metric(prefill.url, "kv_transfers_expired_total") == 0
        params = prefill_only(prefill.url, PROMPTS[1])
        assert metric(prefill.url, "kv_cache_usage_perc") > 0, "the published state is held in the prefill server's pools"
        wait_formetric(prefill.url, "kv_transfers_expired_total", 1)
        assert_idle_and_free(prefill)
        # its record is no longer registered with the transfer engine: Mooncake refuses the read itself
        message = transfer_failure(decode_with(decode.url, PROMPTS[1], params))
        assert re.search(r"reading \d+ bytes from \S+ failed", message) and "checksum" not in message, message
        assert metric(prefill.url, "kv_transfers_expired_total") == 1
    assert_idle_and_free(decode)


@pytest.mark.parametrize("tamper, said", [
    (lambda p: {**p, "checksum": "0" * 32}, "checksum"),
    (lambda p: {**p, "nbytes": p["nbytes"] - 1}, "checksum"),
    (lambda p: {**p, "nbytes": p["nbytes"] + 1}, "bytes from"),
    (lambda p: {**p, "nbytes": -1}, "nbytes -1"),
    (lambda p: {**p, "location": {**p["location"], "address": p["location"]["address"] + 8}}, "checksum|bytes from"),
], ids=["checksum", "short", "long", "negative", "shifted"])
def test_a_tampered_transfer_is_refused_never_decoded(pair, tamper, said):
    prefill, decode = pair
    params = prefill_only(prefill.url, PROMPTS[0])
    before = transfer_counts(decode.url)
    message = transfer_failure(decode_with(decode.url, PROMPTS[0], tamper(params)))
    assert any(s in message for s in said.split("|")), message
    assert transfer_counts(decode.url) == (before[0], before[1] + 1, before[2])
    # the decode server goes on, its cache free
    fine = prefill_then_decode(prefill.url, decode.url, PROMPTS[0])
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == BODY["max_tokens"], fine.text
    assert_idle_and_free(decode)

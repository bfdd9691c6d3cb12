"""A decode server's fetch that does not end (its prefill host unreachable: no answer, no refusal) fails its
request within the decode server's own transfer timeout, whatever the connector still waits for; fetches that
end in time are untouched. The Mooncake connector's reads are bounded alike (``MC_TRANSFER_TIMEOUT``)."""

from __future__ import annotations

import os
import threading
import time

from deepinfer_interfaces.kv_connector import KVConnector

from deepinfer.kv_transfer import handoff
from deepinfer.kv_transfer.handoffs import Handoffs

TIMEOUT_S = 0.3


class _Silent(KVConnector):
    """A connector whose fetches of ``location["hang"]`` wait until released (a peer behind a cut cable)."""

    name = "silent"

    def __init__(self) -> None:
        super().__init__()
        self.cable = threading.Event()

    def publish(self, transfer_id, payload):
        return {}

    def fetch(self, location, nbytes):
        if location.get("hang"):
            self.cable.wait(30)
        return b"x" * nbytes

    def release(self, transfer_id):
        pass


def _params(**location) -> dict:
    return {"connector": "silent", "location": location, "nbytes": 4, "checksum": handoff.checksum(b"xxxx")}


def _until_done(handoffs: Handoffs, n: int, bound_s: float) -> list:
    out, deadline = [], time.monotonic() + bound_s
    while len(out) < n:
        assert time.monotonic() < deadline, out
        out += handoffs.done()
        time.sleep(0.01)
    return out


def test_a_fetch_that_does_not_end_fails_its_request_within_the_timeout(monkeypatch):
    connector = _Silent()
    handoffs = Handoffs(connector, TIMEOUT_S)
    monkeypatch.setattr(handoff, "decode", lambda payload, meta: ("state", payload))
    try:
        t0 = time.monotonic()
        handoffs.start_fetch("stuck", _params(hang=True))
        handoffs.start_fetch("fine", _params())
        results = {rid: (state, why) for rid, state, why in _until_done(handoffs, 2, 5.0)}
        took = time.monotonic() - t0
        assert results["fine"][1] is None
        state, why = results["stuck"]
        assert state is None and "did not end within 0.3 s (--kv-transfer-timeout)" in why and "\n" not in why, why
        assert TIMEOUT_S <= took < TIMEOUT_S + 2.0
        assert handoffs.stats.kv_transfer_failures == 1 and handoffs.stats.kv_transfers == 1
        assert handoffs.fetches == {}
        connector.cable.set()  # the connector gives up (or gets through) later: nothing is reported twice
        time.sleep(0.05)
        assert handoffs.done() == []
    finally:
        connector.cable.set()
        handoffs.close()


def test_the_mooncake_connector_bounds_its_reads_by_the_transfer_timeout(monkeypatch):
    from deepinfer.kv_transfer.connectors import mooncake

    class _Engine:
        def initialize(self, *args):
            return 0

        def get_rpc_port(self):
            return 1

    monkeypatch.setattr(mooncake, "_import_engine", lambda: _Engine)
    for given, env, expected in [(3, None, "3"), (0.5, None, "1"), (120, None, "30"), (3, "7", "7"), (None, None, None)]:
        if env is None:
            monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
        else:
            monkeypatch.setenv("MC_TRANSFER_TIMEOUT", env)
        mooncake.MooncakeConnector({} if given is None else {"timeout_s": given})
        assert os.environ.get("MC_TRANSFER_TIMEOUT") == expected, (given, env)

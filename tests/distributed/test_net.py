"""``deepinfer.net``: the addresses a rank or server offers its peers, here and inside a test host (a network
namespace with one interface, ``eth0``, and its own loopback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepinfer import net
from deepinfer.errors import ConfigError
from tests.helpers.hosts import Hosts, namespaces_unavailable

ROOT_PY = sys.executable


def test_loopback_and_resolve():
    assert net.is_loopback("127.0.0.1") and net.is_loopback("localhost") and net.is_loopback("::1")
    assert not net.is_loopback("198.18.20.10")
    assert net.resolve("[::1]") == "::1" and net.resolve("127.0.0.1") == "127.0.0.1"


def test_local_addresses_hold_loopback_and_route_source_is_one_of_them():
    found = net.local_addresses()
    assert "127.0.0.1" in found.get("lo", []) and net.interface_of("127.0.0.1") == "lo"
    assert net.route_source("127.0.0.1") == "127.0.0.1"
    assert net.interface_of("192.0.2.77") is None and net.interface_of("not an address") is None


def test_advertise_host_must_be_an_address_of_this_machine():
    assert net.advertised_host("127.0.0.1", "0.0.0.0") == "127.0.0.1"
    with pytest.raises(ConfigError, match="--advertise-host 192.0.2.77 is not an address of this machine") as caught:
        net.advertised_host("192.0.2.77", "0.0.0.0")
    assert "\n" not in str(caught.value)


def test_bind_host_and_loopback_rules():
    assert net.advertised_host(None, "127.0.0.1") == "127.0.0.1"  # one machine: loopback to a loopback peer is fine
    assert net.advertised_host(None, "127.0.0.1", peer="127.0.0.1") == "127.0.0.1"
    with pytest.raises(ConfigError, match="--advertise-host"):
        net.advertised_host(None, "127.0.0.1", peer="198.18.20.10")  # never loopback to a remote peer


def test_collective_interfaces_leave_a_local_group_and_the_users_choice_alone():
    env: dict[str, str] = {}
    assert net.collective_interfaces("127.0.0.1", "nccl", env) == {} and env == {}
    env = {"GLOO_SOCKET_IFNAME": "mine"}
    net.collective_interfaces(net.route_source("127.0.0.1"), "gloo", env)
    assert env["GLOO_SOCKET_IFNAME"] == "mine"


_PROBE = """
import json
from deepinfer import net
from deepinfer.errors import ConfigError
peer = {peer!r}
out = {{"addresses": net.local_addresses(), "route": net.route_source(peer), "iface": net.interface_of(net.route_source(peer)),
        "any": net.advertised_host(None, "0.0.0.0"), "to_peer": net.advertised_host(None, "::", peer=peer),
        "given": net.advertised_host({me!r}, "0.0.0.0")}}
env = {{}}
out["env"] = net.collective_interfaces(peer, "nccl", env)
try:
    net.advertised_host("127.0.0.1", "0.0.0.0", peer=peer) and net.advertised_host(None, "127.0.0.1", peer=peer)
except ConfigError as exc:
    out["refused"] = str(exc)
try:
    net.advertised_host({client!r}, "0.0.0.0")
except ConfigError as exc:
    out["not_mine"] = str(exc)
print(json.dumps(out))
"""


@pytest.mark.skipif(namespaces_unavailable() is not None, reason=str(namespaces_unavailable()))
def test_inside_a_host_the_routed_interface_is_offered_never_loopback():
    with Hosts(2) as hosts:
        me, peer = hosts[0].address, hosts[1].address
        done = hosts[0].run([ROOT_PY, "-c", _PROBE.format(peer=peer, me=me, client=hosts.client)], timeout=60)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["addresses"]["eth0"][0] == me and "127.0.0.1" in out["addresses"]["lo"]
    assert out["route"] == me and out["iface"] == "eth0"
    assert out["any"] == me and out["to_peer"] == me and out["given"] == me  # 0.0.0.0: the interface, not loopback
    assert out["env"] == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert out["refused"].startswith("--advertise-host 127.0.0.1 is loopback, which the peer")
    assert out["not_mine"].startswith(f"--advertise-host {hosts.client} is not an address of this machine")


def test_serve_refuses_an_advertise_host_not_of_this_machine_at_once():
    from tests.helpers.servers import ROOT, free_port, serve_command, server_env

    done = subprocess.run(serve_command(free_port(), ["--disaggregation-mode", "prefill", "--advertise-host", "192.0.2.77"]),
                          env=server_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    assert lines[-1].startswith("deepinfer: error: --advertise-host 192.0.2.77 is not an address of this machine"), lines
    assert not any("loading" in l for l in lines)  # refused before the model loads

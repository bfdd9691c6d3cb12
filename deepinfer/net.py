"""The addresses a rank or a server offers its peers, chosen in one place.

A process that listens on every interface (``--host 0.0.0.0``) or meets its
peers through a launcher must still tell them one address to reach it by. The
hostname is a poor answer: in a container or on a machine whose name maps to
``127.0.0.1`` it resolves to loopback, which a peer on another machine reaches
as *itself*. The answer here, in order:

1. ``--advertise-host`` when given: it must be an address of this machine
   (a one-line ``ConfigError`` naming the flag otherwise);
2. the bind host, when it is one specific non-loopback address;
3. the address of the interface the kernel routes to the peer (or, with no peer
   known, to the default route); loopback only when the peer is loopback too.

``collective_interfaces`` applies the same rule to collective libraries
(gloo, NCCL, HCCL), which pick their interface from the hostname unless told.
Linux and IPv4 first; IPv6 addresses are understood where given.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from .errors import ConfigError

#: Linux's ioctl number for an interface's IPv4 address (``<linux/sockios.h>``)
SIOCGIFADDR = 0x8915
#: an address used only to ask the kernel which interface holds the default route when ``/proc/net/route``
#: cannot tell (no packet is sent)
_DEFAULT_ROUTE_PROBE = "192.0.2.1"  # TEST-NET-1 (RFC 5737)
#: the environment variables naming the interface each collective library opens its sockets on
SOCKET_IFNAME_ENV = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME", "hccl": "HCCL_SOCKET_IFNAME"}
#: any-address spellings of a bind host (listen on every interface)
_ANY = ("", "0.0.0.0", "::", "*")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is, or resolves to, a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(resolve(host)).is_loopback
    except (ValueError, OSError):
        return False


def resolve(host: str) -> str:
    """``host`` as an address (a name is resolved, IPv4 first); raises ``OSError`` when it does not resolve."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def route_source(peer: str) -> str:
    """The local address the kernel would send from to reach ``peer`` (a UDP connect: no packet is sent).
    Raises ``OSError`` when there is no route to it."""
    address = resolve(peer)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return str(s.getsockname()[0])


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # no IPv4 address (or the interface went away)
    return socket.inet_ntoa(packed[20:24])


def _ipv6_addresses() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    try:
        lines = open("/proc/net/if_inet6").read().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if len(fields) >= 6:
            out.setdefault(fields[5], []).append(str(ipaddress.ip_address(bytes.fromhex(fields[0]))))
    return out


def local_addresses() -> dict[str, list[str]]:
    """This machine's interface addresses (this network namespace's): interface name -> its addresses, IPv4
    first (only interfaces that have one)."""
    v6 = _ipv6_addresses()
    out: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        found = [a for a in [_ipv4_of(name)] if a] + v6.get(name, [])
        if found:
            out[name] = found
    return out


def interface_of(address: str) -> str | None:
    """The name of the interface holding ``address`` (None: no interface of this machine has it)."""
    try:
        wanted = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return None
    for name, addresses in local_addresses().items():
        if any(ipaddress.ip_address(a) == wanted for a in addresses):
            return name
    return None


def advertised_host(advertise_host: str | None, bind_host: str | None, peer: str | None = None) -> str:
    """The address to give a peer to reach this process by (the rule in this module's docstring).

    ``advertise_host``: ``--advertise-host`` (None when not given); ``bind_host``: where this process listens
    (``0.0.0.0`` and ``::`` mean every interface); ``peer``: the address of the peer it is for, when known.
    """
    peer_address = None
    if peer:
        try:
            peer_address = resolve(peer)
        except OSError:
            peer_address = None
    remote_peer = peer_address is not None and not ipaddress.ip_address(peer_address).is_loopback
    if advertise_host:
        try:
            address = resolve(advertise_host)
        except OSError:
            raise ConfigError(f"--advertise-host {advertise_host} does not resolve; give an address of this machine") from None
        if interface_of(address) is None:
            raise ConfigError(f"--advertise-host {advertise_host} is not an address of this machine "
                              f"(its interfaces have {_listing()}); give one of them")
        if remote_peer and ipaddress.ip_address(address).is_loopback:
            raise ConfigError(f"--advertise-host {advertise_host} is loopback, which the peer at {peer} cannot reach; "
                              f"give the address of the interface that reaches it")
        return address
    if bind_host not in (None, *_ANY):
        if not is_loopback(bind_host):
            return resolve(bind_host)
        if not remote_peer:
            return resolve(bind_host)  # loopback to a peer on this machine (the default, single-host setup)
        raise ConfigError(f"this process listens on {bind_host} (loopback), which the peer at {peer} cannot reach; "
                          f"listen with --host 0.0.0.0 (or an address of this machine) and set --advertise-host")
    try:
        source = route_source(peer_address) if peer_address is not None else _default_route_source()
    except OSError:
        source = None
    if source is not None and (not ipaddress.ip_address(source).is_loopback or (peer_address is not None and not remote_peer)):
        return source
    for addresses in local_addresses().values():  # no route: the first non-loopback address there is
        for a in addresses:
            ip = ipaddress.ip_address(a)
            if not ip.is_loopback and not ip.is_link_local:
                return a
    if remote_peer:
        raise ConfigError(f"no interface of this machine routes to {peer}; set --advertise-host to an address the peer can reach")
    return "127.0.0.1"


def _default_route_source() -> str:
    """The address of the interface holding the IPv4 default route (``/proc/net/route``), else the kernel's
    source towards an address no local route covers in particular."""
    try:
        for line in open("/proc/net/route").read().splitlines()[1:]:
            fields = line.split()
            if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
                address = _ipv4_of(fields[0])
                if address is not None:
                    return address
    except OSError:
        pass
    return route_source(_DEFAULT_ROUTE_PROBE)


def _listing() -> str:
    return ", ".join(f"{name} {' '.join(a)}" for name, a in local_addresses().items()) or "none"


def collective_interfaces(peer: str, dist_backend: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """Name the interface that routes to ``peer`` (the rendezvous host: ``MASTER_ADDR``) for gloo (the control
    group always uses it) and for ``dist_backend``'s library, in ``env`` (default ``os.environ``), unless the
    user set them already. A loopback peer changes nothing (every rank is on this machine). Returns what it set.

    Collective libraries otherwise pick the address the hostname resolves to, which is loopback on many
    machines and containers: each rank then offers the others ``127.0.0.1`` and the group never meets."""
    env = os.environ if env is None else env
    if is_loopback(peer):
        return {}
    try:
        name = interface_of(route_source(peer))
    except OSError:
        raise ConfigError(f"no interface of this machine routes to the rendezvous host {peer} (MASTER_ADDR); "
                          f"check torchrun's --master-addr / --rdzv-endpoint") from None
    if name is None:
        return {}
    changed = {}
    for lib in dict.fromkeys(("gloo", dist_backend)):
        var = SOCKET_IFNAME_ENV.get(lib)
        if var is not None and not env.get(var):
            env[var] = changed[var] = name
    return changed


def host_answers(address: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether the machine at ``address`` answers at all: a TCP connection to ``port`` accepted or refused (a
    refusal is the machine's own answer); False when nothing comes back within ``timeout_s`` (a link or the
    machine is down)."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def answer_probes(host: str) -> int:
    """Listen on ``host`` (a free port) and answer every connection by closing it, on a daemon thread, for the
    life of the process: the port ``host_answers`` probes this machine at. Returns the port."""
    import threading

    server = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True, name="deepinfer-probe-answer").start()
    return server.getsockname()[1]

"""A routable address of this host, found without sending anything: torch-free, for the launcher and the trainers.

Why not `gethostbyname(gethostname())`: on Debian-style hosts that is 127.0.1.1 (from /etc/hosts), which only this
host reaches, so a weight-broadcast rendezvous or a registry address built from it fails from any other node.
"""

from __future__ import annotations

import os
import socket

__all__ = [
    "ADDRESS_ENV",
    "WILDCARDS",
    "advertised",
    "host_address",
    "interface_of",
    "pin_gloo_interface",
    "rendezvous_host",
]

ADDRESS_ENV = "AREAL_TRAINER_ADDRESS"  # override of the address this host advertises (e.g. TrainerInfo.host)
WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})  # bind hosts that mean "every interface"


def host_address() -> str:
    """An address of this host that processes on other hosts can reach: `AREAL_TRAINER_ADDRESS` when set, else
    the IPv4 address of the interface that carries the default route (Linux), else a non-loopback address the
    host name resolves to, else the address of the first interface that is not loopback (a cluster network
    without a default route, on a host whose name resolves to 127.0.1.1), else 127.0.0.1.

    `gethostbyname(gethostname())` alone is often 127.0.1.1 (Debian's /etc/hosts), which only this host reaches.
    Nothing is sent anywhere to find out."""
    override = os.environ.get(ADDRESS_ENV, "").strip()
    if override:
        return override
    addr = _default_route_address()
    if addr:
        return addr
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        infos = []
    for info in infos:
        ip = str(info[4][0])
        if not ip.startswith("127."):
            return ip
    for _, ip in _interface_addresses():
        return ip
    return "127.0.0.1"


def pin_gloo_interface() -> str | None:
    """Set GLOO_SOCKET_IFNAME to the interface of `host_address()` when gloo's own choice would be unreachable from
    other hosts; returns the interface set (None: left as it was).

    gloo binds the address the host name resolves to. On a Debian-style host that is 127.0.1.1, and a group with a
    member on another host fails ("Connection refused, remote=[127.0.1.1]"): the trainers' world across hosts,
    and the weight-update group between trainer rank 0 and servers on other hosts. So when the name resolves only
    to loopback and the host has a routable address, gloo is pinned to that address's interface (which also
    serves a group on this one host). A variable the user set is kept, and a host whose name resolves to a
    routable address is left to gloo."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        infos = []
    if any(not str(info[4][0]).startswith("127.") for info in infos):
        return None
    address = host_address()
    iface = interface_of(address) if not address.startswith("127.") else None
    if iface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    return iface


def interface_of(address: str) -> str | None:
    """The name of this host's interface that holds IPv4 `address` (None: none does, or not Linux). For
    GLOO_SOCKET_IFNAME: gloo otherwise binds the address the host name resolves to, which on a Debian-style host
    is 127.0.1.1, and ranks on other hosts cannot connect to it."""
    for name, ip in _interface_addresses(include_loopback=True):
        if ip == address:
            return name
    return None


def _interface_addresses(include_loopback: bool = False) -> list[tuple[str, str]]:
    """(interface, IPv4 address) of every interface that has one, in index order (Linux; [] elsewhere)."""
    try:
        import fcntl
        import struct

        names = [name for _, name in socket.if_nameindex()]
    except (OSError, ImportError, AttributeError):
        return []
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            ip = socket.inet_ntoa(packed[20:24])
            if include_loopback or not ip.startswith("127."):
                out.append((name, ip))
    return out


def advertised(bind_host: str) -> str:
    """What to tell other processes to dial for something listening on `bind_host`: the host itself when it is a
    specific address (127.0.0.1 stays loopback: a single-host run), `host_address()` for a wildcard. A wildcard
    handed out as it is ("0.0.0.0") makes every other host dial itself."""
    return host_address() if bind_host.strip() in WILDCARDS else bind_host


def _default_route_address() -> str | None:
    """IPv4 address of the default route's interface, from /proc/net/route and SIOCGIFADDR; None elsewhere."""
    try:
        with open("/proc/net/route") as f:
            rows = [line.split() for line in f.readlines()[1:]]
    except OSError:
        return None
    ifaces = [r[0] for r in rows if len(r) > 3 and r[1] == "00000000" and int(r[3], 16) & 0x2]  # RTF_GATEWAY
    for iface in ifaces:
        try:
            import fcntl
            import struct

            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))  # SIOCGIFADDR
            return socket.inet_ntoa(packed[20:24])
        except (OSError, ImportError):
            continue
    return None


def rendezvous_host() -> str:
    """The host part of a torchrun c10d rendezvous endpoint this host serves: `host_address()` when torch's
    agent recognises it as this machine (it hosts the store only for an endpoint among the addresses the host
    name resolves to, or the host name itself: torch/distributed/elastic/rendezvous/utils.py), else the host name,
    which other hosts resolve through their own DNS (an IP that only this host reaches, 127.0.1.1, is never
    advertised)."""
    addr = host_address()
    name = socket.gethostname()
    try:
        own = {str(info[4][0]) for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        own = set()
    return addr if addr in own else name

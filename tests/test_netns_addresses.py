"""Every address the project advertises for another host to dial is a routable one, checked where it is hardest:
on namespace hosts without a default route whose /etc/hosts maps their own name to 127.0.1.1 (Debian's default),
so that `gethostbyname(gethostname())` is loopback there while the other hosts resolve the name to the host's
address. And no module of the package uses that idiom at all (it is loopback on such hosts).

The multi-host runs (test_netns_multinode.py, test_netns_faults.py, test_netns_slurm.py) check what actually
listens and what is registered; this module checks the address functions those runs rely on, in one process per
host, in seconds.
"""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest

from areal_async.testing import hosts as nshosts

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "areal_async")
WHY = nshosts.skip_reason()
needs_hosts = pytest.mark.skipif(WHY is not None, reason=str(WHY))

PROBE = textwrap.dedent(
    """
    import json, socket, sys
    from areal_async.net.address import advertised, host_address, interface_of, rendezvous_host
    from areal_async.net.rank_registry import reachable_address, route_address
    from areal_async.train.worker import advertised_address
    peer = sys.argv[1]
    print(json.dumps({
        "resolved_own_name": socket.gethostbyname(socket.gethostname()),
        "host_address": host_address(),
        "advertised_wildcard": advertised("0.0.0.0"),
        "advertised_loopback": advertised("127.0.0.1"),
        "interface": interface_of(host_address()),
        "rendezvous_host": rendezvous_host(),
        "route_to_peer": route_address(peer),
        "reachable": reachable_address("tcp://0.0.0.0:5000", f"tcp://{peer}:6000"),
        "worker_advertises": advertised_address("0.0.0.0"),
    }))
    """
)


@pytest.fixture(scope="module")
def debian_hosts():
    with nshosts.Hosts(2, gateway=False, loopback_name=True) as hs:
        yield hs


@needs_hosts
def test_addresses_are_routable_where_the_host_name_is_loopback(debian_hosts):
    a, b = debian_hosts.hosts
    p = a.run([sys.executable, "-c", PROBE, b.address], capture_output=True, text=True, check=True)
    got = json.loads(p.stdout)
    assert got["resolved_own_name"] == "127.0.1.1"  # the trap is set: the idiom gives loopback here
    for key in ("host_address", "advertised_wildcard", "route_to_peer", "worker_advertises"):
        assert got[key] == a.address, (key, got)
    assert got["reachable"] == f"tcp://{a.address}:5000"
    assert got["advertised_loopback"] == "127.0.0.1"  # a single-host listener stays on loopback
    assert got["interface"] == "eth0"
    # the rendezvous endpoint is the host name here (torch hosts the store for its own name), which the other
    # hosts resolve to this host's routable address
    assert got["rendezvous_host"] == a.name
    seen = b.run([sys.executable, "-c", f"import socket; print(socket.gethostbyname({a.name!r}))"], capture_output=True)
    assert seen.stdout.decode().strip() == a.address


def test_no_module_resolves_its_own_host_name_for_an_address():
    """`gethostbyname(gethostname())` is 127.0.1.1 on Debian-style hosts: net/address.py's host_address() is the
    one way to find this host's address."""
    idiom = re.compile(r"gethostbyname\(\s*(socket\.)?gethostname\(\)\s*\)")
    found = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path) as f:
                    for n, line in enumerate(f, 1):
                        code = line.split("#", 1)[0]
                        if idiom.search(code) and '"""' not in line and "`" not in line:
                            found.append(f"{os.path.relpath(path, PACKAGE)}:{n}: {line.strip()}")
    assert not found, found

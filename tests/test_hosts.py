"""The network-namespace hosts of areal_async/testing/hosts.py are separate hosts: each has its own host name that
the others resolve, its own address, a loopback no other host reaches, and a link that can be cut; and they leave
nothing behind: not after close, not when the test fails inside the with block, not when their creator is killed
(the next creator removes its leftovers by name)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from areal_async.testing import hosts as nshosts

WHY = nshosts.skip_reason()
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))

ECHO = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5000))
    s.listen()
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        c.sendall(socket.gethostname().encode())
        c.close()
    """
)
DIAL = "import socket, sys; print(socket.create_connection((sys.argv[1], 5000), timeout=float(sys.argv[2])).recv(99))"


def dial(host: nshosts.Host, target: str, timeout_s: float = 3.0) -> subprocess.CompletedProcess:
    return host.run([sys.executable, "-c", DIAL, target, str(timeout_s)], capture_output=True, text=True)


def start_echo(host: nshosts.Host, bind: str) -> subprocess.Popen:
    p = host.popen([sys.executable, "-c", ECHO, bind], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_hosts_are_separate_hosts_that_reach_each_other_by_name():
    with nshosts.Hosts(2) as hs:
        a, b = hs[0], hs[1]
        names = a.run(["python3", "-c", "import socket; print(socket.gethostname())"], capture_output=True, text=True)
        assert names.stdout.strip() == a.name
        found = a.run(
            [sys.executable, "-c", "from areal_async.net.address import host_address; print(host_address())"],
            capture_output=True,
            text=True,
        )
        assert found.stdout.strip() == a.address  # the routable address, not 127.0.0.1 (no default route here)
        start_echo(b, "0.0.0.0")
        by_name = dial(a, b.name)
        assert by_name.returncode == 0 and b.name in by_name.stdout, by_name.stderr
        # b's loopback is b's own: from a, 127.0.0.1 is a's loopback, where nothing listens
        assert dial(a, "127.0.0.1").returncode != 0
        start_echo(a, "127.0.0.1")  # a server that binds loopback on a is not reachable from b
        assert dial(b, a.name, 1).returncode != 0
        assert dial(a, "127.0.0.1").returncode == 0


def test_a_cut_link_drops_packets_until_it_is_back():
    with nshosts.Hosts(2) as hs:
        start_echo(hs[1], "0.0.0.0")
        hs[1].link_down()
        t0 = time.monotonic()
        cut = dial(hs[0], hs[1].name, 1.5)
        assert cut.returncode != 0 and "timed out" in cut.stderr, cut.stderr  # silence, not a refused connection
        assert time.monotonic() - t0 >= 1.4
        hs[1].link_up()
        deadline = time.monotonic() + 10
        while dial(hs[0], hs[1].name, 1).returncode != 0:
            assert time.monotonic() < deadline, "the host did not come back"
            time.sleep(0.2)


def test_close_kills_every_process_and_removes_everything_even_on_failure():
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="a failing test"):
        with nshosts.Hosts(2) as hs:
            start_echo(hs[0], "0.0.0.0")
            hs[1].popen(["sleep", "600"])
            time.sleep(0.2)
            pids = hs[0].pids() + hs[1].pids()
            assert len(pids) >= 2
            raise RuntimeError("a failing test")
    assert nshosts.namespaces_of(os.getpid()) == []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert f"ar{os.getpid()}k" not in links
    assert not [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]


def test_hosts_of_a_killed_creator_are_removed_by_the_next_one():
    """A creator SIGKILLed with its hosts up (and a process on one of them): the next `Hosts` removes all of it."""
    code = "from areal_async.testing.hosts import Hosts; import sys, time; h = Hosts(2); "
    code += "h[0].popen(['sleep', '600']); print(h[0].netns, flush=True); time.sleep(600)"
    creator = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        netns = creator.stdout.readline().strip()
        assert netns in nshosts.namespaces_of(creator.pid)
        # `ip netns exec` enters the namespace after Popen returns: wait for the sleep to be seen inside it
        deadline = time.monotonic() + 20
        orphan: list[int] = []
        while not orphan and time.monotonic() < deadline:
            out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
            orphan = [int(x) for x in out.split()]
            time.sleep(0.05)
        assert orphan
    finally:
        os.kill(creator.pid, signal.SIGKILL)
        creator.wait(10)
    # (another process's Hosts may have removed them first: any creator removes the sets of dead creators)
    removed = nshosts.remove_leftovers()
    assert netns in removed or not os.path.exists(f"/run/netns/{netns}"), removed
    assert nshosts.namespaces_of(creator.pid) == [] and nshosts.links_of(creator.pid) == []
    assert not os.path.exists(f"/etc/netns/{netns}")
    for pid in orphan:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_unavailable_names_the_reason_without_root():
    code = "import os; from areal_async.testing.hosts import unavailable; os.setuid(65534); print(unavailable())"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "needs root (ip netns add)", p.stderr

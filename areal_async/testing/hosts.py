"""Separate hosts on one machine, for tests: each host a Linux network namespace with its own interface, address,
loopback, host name and /etc/hosts, all of them joined by one bridge. A process started on a host sees only that
host's network: 127.0.0.1 there is its own loopback, which no other host reaches, so an address that is loopback
where it should be routable fails as it does on a real cluster. The hosts share the filesystem (what a cluster with
a shared filesystem gives; a test that needs a path to be private must say so itself).

Why namespaces and not containers: `ip netns` needs only root and the kernel, starts in milliseconds, and leaves
every process visible to this machine's /proc (the suite's leak check sees them). Names carry the creating
process's pid and a set number (`areal-<pid>-<k>-h<i>`, links `ar<pid>k<k>b`, `ar<pid>k<k>v<i>`), so
`remove_leftovers()` removes what a killed earlier run left behind, and only that: a set whose creator is still
alive belongs to a concurrent session.

`unavailable()` says why no hosts can be made here (not root, no `ip`, a kernel without namespaces); tests skip on
it. Nothing happens at import time.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "REQUIRE_ENV",
    "Host",
    "Hosts",
    "NETNS_PREFIX",
    "links_of",
    "namespaces_of",
    "remove_leftovers",
    "remove_of",
    "skip_reason",
    "unavailable",
]

REQUIRE_ENV = "AREAL_REQUIRE_NETNS"  # "1" (CI, as root): hosts that cannot be built are an error, not a skip

NETNS_PREFIX = "areal-"  # namespaces areal-<pid>-<k>-h<i>; links ar<pid>k<k>b (bridge), ar<pid>k<k>v<i> (veths)
_NETNS_RE = re.compile(r"^areal-(\d+)-(\d)-h(\d+)$")
_LINK_RE = re.compile(r"^ar(\d+)k(\d)(b|[vp]\d+)$")
_ETC_NETNS = "/etc/netns"  # /etc/netns/<ns>/hosts: a host's /etc/hosts (where `ip netns exec` also looks)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


def unavailable() -> str | None:
    """Why network-namespace hosts cannot be built here, or None when they can (a namespace is made and removed
    to find out: a kernel or sandbox may refuse it even to root)."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} (iproute2, util-linux)"
    probe = f"{NETNS_PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    link = f"ar{os.getpid()}x"
    made = _ip("link", "add", link, "type", "bridge", check=False)
    if made.returncode != 0:
        return f"cannot create a bridge: {made.stderr.strip()}"
    _ip("link", "del", link, check=False)
    return None


def skip_reason() -> str | None:
    """For a test module: why its tests skip (None: hosts can be built). Raises RuntimeError instead when
    AREAL_REQUIRE_NETNS=1, where the hosts must be buildable (.ci/run sets it: CI runs as root)."""
    why = unavailable()
    if why and os.environ.get(REQUIRE_ENV) == "1":
        raise RuntimeError(f"{REQUIRE_ENV}=1 but network-namespace hosts cannot be built: {why}")
    return None if why is None else f"no network-namespace hosts here: {why}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owned(m: re.Match | None, pid: int | None, k: int | None) -> bool:
    return bool(m) and (pid is None or int(m.group(1)) == pid) and (k is None or int(m.group(2)) == k)


def namespaces_of(pid: int | None = None, k: int | None = None) -> list[str]:
    """The host namespaces that process `pid` (default: any) created, as its set `k` (default: any), and that
    still exist."""
    p = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in p.stdout.splitlines() if line.strip()]
    return [n for n in names if _owned(_NETNS_RE.match(n), pid, k)]


def links_of(pid: int | None = None, k: int | None = None) -> list[str]:
    """The bridges and veths of hosts that process `pid` (default: any) made, as its set `k` (default: any)."""
    p = _ip("-o", "link", "show", check=False)
    out = []
    for line in p.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@", 1)[0]
        if _owned(_LINK_RE.match(name), pid, k):
            out.append(name)
    return out


def _kill_namespace(netns: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process in `netns` and wait until none is left; the pids killed."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        p = _ip("netns", "pids", netns, check=False)
        pids = [int(x) for x in p.stdout.split() if x.isdigit()]
        if not pids or time.monotonic() > deadline:
            return killed
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
        time.sleep(0.05)


def _delete(netns_names: Sequence[str], links: Sequence[str]) -> None:
    for ns in netns_names:
        _kill_namespace(ns)
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(os.path.join(_ETC_NETNS, ns), ignore_errors=True)
    for link in links:
        _ip("link", "del", link, check=False)


def remove_leftovers() -> list[str]:
    """Remove the hosts (namespaces, their processes, bridges, veths, /etc/netns entries) of creators that are no
    longer alive: what a killed earlier run left. Returns what it removed."""
    dead_ns = [n for n in namespaces_of() if not _alive(int(_NETNS_RE.match(n).group(1)))]
    dead_links = [n for n in links_of() if not _alive(int(_LINK_RE.match(n).group(1)))]
    stale_etc = []
    if os.path.isdir(_ETC_NETNS):
        stale_etc = [n for n in os.listdir(_ETC_NETNS) if (m := _NETNS_RE.match(n)) and not _alive(int(m.group(1)))]
    _delete(dead_ns, dead_links)
    for n in stale_etc:
        shutil.rmtree(os.path.join(_ETC_NETNS, n), ignore_errors=True)
    return dead_ns + dead_links


def remove_of(pid: int) -> list[str]:
    """Remove every set of hosts process `pid` made (a session's end-of-run check: sets its tests did not close);
    returns what it removed."""
    found = namespaces_of(pid) + links_of(pid)
    _delete(namespaces_of(pid), links_of(pid))
    return found


@dataclass(frozen=True)
class Host:
    """One host: `name` is its host name (resolvable on every host of the set), `address` its only address."""

    name: str
    netns: str
    address: str
    link: str  # this host's end on the bridge, in the root namespace: `link_down()` takes it down
    peers: Mapping[str, str] = field(default_factory=dict, compare=False)  # every host's name -> address

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """`cmd` as run on this host: in its network namespace, with its own host name (a UTS namespace) and
        /etc/hosts (bind-mounted in a mount namespace of its own). Not `ip netns exec`: that also mounts a fresh
        /sys, which hides /sys/fs/cgroup, and slurmd needs it."""
        shell = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
        hosts_file = os.path.join(_ETC_NETNS, self.netns, "hosts")
        enter = ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount", "--uts", "--"]
        return [*enter, "sh", "-c", shell, self.name, hosts_file, *cmd]

    def popen(self, cmd: Sequence[str], **kw) -> subprocess.Popen:
        """Start `cmd` on this host (keywords as for subprocess.Popen)."""
        return subprocess.Popen(self.argv(cmd), **kw)

    def run(self, cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run `cmd` on this host to the end (keywords as for subprocess.run)."""
        kw.setdefault("timeout", 60)
        return subprocess.run(self.argv(cmd), **kw)

    def pids(self) -> list[int]:
        """Every process on this host."""
        p = _ip("netns", "pids", self.netns, check=False)
        return [int(x) for x in p.stdout.split() if x.isdigit()]

    def kill_all(self) -> list[int]:
        """SIGKILL every process on this host, as a host that loses power does; the pids it killed."""
        return _kill_namespace(self.netns)

    def link_down(self) -> None:
        """Cut this host off the network (its bridge port down): packets to and from it vanish, no connection is
        reset, as when a cable or a switch port fails."""
        _ip("link", "set", self.link, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.link, "up")


_SETS: set[int] = set()  # set numbers this process holds open


class Hosts:
    """`n` hosts on one bridge (`hosts[i]` is named `<name_prefix><i>-<pid>-<k>`, at 10.A.B.(i+2)/24); at most
    ten sets open in one process at a time. With `loopback_name`, each host's /etc/hosts maps its own name to
    127.0.1.1, as Debian's installer writes it: the host then resolves its own name to loopback while the others
    resolve it to its address (what breaks `gethostbyname(gethostname())` on real clusters). With `gateway`, this (root)
    namespace joins the bridge too, at 10.A.B.1 (`gateway_address`), so the test process can reach the hosts as a
    further host would; without, the hosts reach only each other. `close()` (or the with block) kills every
    process on the hosts and removes all of it; it is safe to call twice."""

    def __init__(self, n: int, *, gateway: bool = True, name_prefix: str = "h", loopback_name: bool = False) -> None:
        if not 1 <= n <= 50:
            raise ValueError(f"1..50 hosts, not {n}")
        why = unavailable()
        if why:
            raise RuntimeError(f"cannot build network-namespace hosts: {why}")
        free = [k for k in range(10) if k not in _SETS]
        if not free:
            raise RuntimeError("ten sets of hosts are open in this process already")
        remove_leftovers()
        pid, k = os.getpid(), free[0]
        _SETS.add(k)
        self._pid, self._k = pid, k
        self._tag = f"ar{pid}k{k}"
        self.bridge = f"{self._tag}b"
        key = pid * 10 + k
        subnet = f"10.{100 + (key >> 8) % 150}.{key & 255}"
        self.gateway_address = f"{subnet}.1" if gateway else None
        names = [f"{name_prefix}{i}-{pid}-{k}" for i in range(n)]
        peers = {name: f"{subnet}.{i + 2}" for i, name in enumerate(names)}
        self.hosts: list[Host] = []
        self._closed = False
        self._loopback_name = loopback_name
        try:
            self._build(names, peers)
        except BaseException:
            self.close()
            raise

    def _build(self, names: list[str], peers: dict[str, str]) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        if self.gateway_address:
            _ip("addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, name in enumerate(names):
            netns, link, peer = f"{NETNS_PREFIX}{self._pid}-{self._k}-h{i}", f"{self._tag}v{i}", f"{self._tag}p{i}"
            etc = os.path.join(_ETC_NETNS, netns)
            os.makedirs(etc, exist_ok=True)
            own = f"127.0.1.1 {name}\n" if self._loopback_name else ""
            others = "".join(f"{a} {n}\n" for n, a in peers.items() if n != name or not self._loopback_name)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{own}{others}")
            _ip("netns", "add", netns)
            host = Host(name=name, netns=netns, address=peers[name], link=link, peers=dict(peers))
            self.hosts.append(host)
            _ip("link", "add", link, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", netns)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
            _ip("-n", netns, "link", "set", peer, "name", "eth0")
            _ip("-n", netns, "addr", "add", f"{peers[name]}/24", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process on the hosts, then remove namespaces, links and /etc/netns entries."""
        if self._closed:
            return
        self._closed = True
        try:
            _delete(namespaces_of(self._pid, self._k), links_of(self._pid, self._k))
        finally:
            _SETS.discard(self._k)

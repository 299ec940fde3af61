"""A Ray cluster of several nodes on one machine, for tests: the head in this (root) network namespace on the hosts'
bridge (the gateway address), one worker node on each network-namespace host (areal_async/testing/hosts.py) joined
with `ray start --address=HEAD:PORT`, each under its own address. The head offers no CPUs, so every bundle a run
asks for lands on a namespace host: a process there is on another host as far as the network goes (the hosts share
the filesystem, as nodes with a shared home directory do).

Node deaths are found fast here: the head's GCS checks each raylet every `health_check_s` and gives a node up after
`health_check_failures` missed checks (Ray's defaults, 3 s and 5, suit real clusters). `kill_node(i)` SIGKILLs every
process of host i (a node that loses power); `start_node(i)` brings a worker back there. `close()` kills the worker
nodes and the head by pid, never by name (`ray stop` would stop every Ray process on the machine, another session's
included), and removes the head's temporary directory. Nothing happens at import time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

from areal_async.launch.processes import descendants, kill_left
from areal_async.testing.hosts import Hosts

__all__ = ["RayOnHosts"]


def _ray_cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


class RayOnHosts:
    """A head beside `hosts` (which must have a gateway) and a worker node of `cpus` CPUs on each host."""

    def __init__(
        self,
        hosts: Hosts,
        root: str,
        *,
        cpus: int = 2,
        health_check_s: float = 0.5,
        health_check_failures: int = 3,
        startup_timeout_s: float = 90.0,
    ) -> None:
        if hosts.gateway_address is None:
            raise ValueError("the hosts need a gateway: the head runs on it")
        self.hosts, self.root, self.cpus = hosts, root, cpus
        self.temp_dir = f"/tmp/arr{os.getpid()}"  # short: Ray's socket paths must fit in 107 bytes
        self.env = {
            **os.environ,
            "RAY_health_check_period_ms": str(int(health_check_s * 1000)),
            "RAY_health_check_timeout_ms": str(int(health_check_s * 1000)),
            "RAY_health_check_failure_threshold": str(health_check_failures),
            "RAY_USAGE_STATS_ENABLED": "0",
            # no token authentication, whatever ~/.ray/auth_token says (a head finds that file and then refuses
            # the drivers, which send no token unless told to)
            "RAY_AUTH_MODE": "disabled",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.head: subprocess.Popen | None = None
        self.workers: dict[int, subprocess.Popen] = {}
        self._offsets: dict[int, int] = {}  # where the current `ray start` of host i begins in its log
        self.address = ""
        self._closed = False
        os.makedirs(root, exist_ok=True)
        try:
            for attempt in range(3):  # Ray gives a node 30 s to register, which a loaded 2-core machine can miss
                try:
                    self._start_head(startup_timeout_s)
                    break
                except RuntimeError:
                    self._stop_head()
                    if attempt == 2:
                        raise
            for i in range(len(hosts)):
                self.start_node(i)
            self.wait_nodes(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _log(self, name: str):
        return open(os.path.join(self.root, f"{name}.log"), "ab")

    def _start_head(self, timeout_s: float) -> None:
        gw = self.hosts.gateway_address
        path = os.path.join(self.root, "head.log")
        if os.path.exists(path):
            os.remove(path)
        with self._log("head") as out:
            self.head = subprocess.Popen(
                [
                    _ray_cli(),
                    "start",
                    "--head",
                    "--block",
                    f"--node-ip-address={gw}",
                    "--port=0",
                    "--num-cpus=0",
                    "--num-gpus=0",
                    "--include-dashboard=false",
                    f"--temp-dir={self.temp_dir}",
                    "--disable-usage-stats",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while not self.address:
            with open(path, errors="replace") as f:
                m = re.search(rf"--address='({re.escape(gw)}:\d+)'", f.read())
            if m:
                self.address = m.group(1)
            elif self.head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not start:\n{open(path, errors='replace').read()[-3000:]}")
            else:
                time.sleep(0.2)

    def start_node(self, i: int) -> None:
        """A worker node on host i (again, after `kill_node`); `wait_nodes` waits until it has joined."""
        h = self.hosts[i]
        with self._log(f"node{i}") as out:
            self._offsets[i] = out.tell()
            self.workers[i] = h.popen(
                [
                    _ray_cli(),
                    "start",
                    "--block",
                    f"--address={self.address}",
                    f"--node-ip-address={h.address}",
                    f"--num-cpus={self.cpus}",
                    "--num-gpus=0",
                    "--disable-usage-stats",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )

    def kill_node(self, i: int) -> list[int]:
        """SIGKILL every process on host i: its raylet, its actors and what they started."""
        self.workers.pop(i, None)
        return self.hosts[i].kill_all()

    def query(self, code: str, timeout_s: float = 60.0) -> object:
        """Run `code` (which sets `out`) in a short driver connected to the cluster; `out` as JSON."""
        prog = (
            "import json, ray\n"
            f"ray.init(address={self.address!r}, logging_level='ERROR', log_to_driver=False)\n"
            f"{code}\n"
            "print('RESULT ' + json.dumps(out))\n"
        )
        p = subprocess.run(
            [sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout_s, env=self.env
        )
        m = re.search(r"^RESULT (.*)$", p.stdout, re.M)
        if m is None:
            raise RuntimeError(f"query failed: {p.stderr[-2000:]}")
        return json.loads(m.group(1))

    def alive_nodes(self) -> list[str]:
        """The addresses of the nodes Ray lists alive."""
        return list(self.query("out = [n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]"))

    def _joined(self, i: int) -> bool:
        """Whether the current `ray start` on host i says its node registered with the head."""
        with open(os.path.join(self.root, f"node{i}.log"), "rb") as f:
            f.seek(self._offsets.get(i, 0))
            return b"Ray runtime started" in f.read()

    def wait_nodes(self, timeout_s: float = 90.0) -> None:
        """Until every started worker node has joined (`ray start` prints so once the head lists it); one whose
        `ray start` gave up (Ray gives a node 30 s to register, which a loaded 2-core machine can miss) starts
        again."""
        deadline = time.monotonic() + timeout_s
        while not all(self._joined(i) for i in self.workers):
            for i, proc in list(self.workers.items()):
                if proc.poll() is not None and not self._joined(i):
                    self.start_node(i)
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray worker nodes not joined after {timeout_s:.0f}s: {self.alive_nodes()}")
            time.sleep(0.2)

    def resources(self) -> tuple[dict[str, float], dict[str, float]]:
        """(total, available) resources of the cluster: equal when no actor or placement group holds any."""
        out = self.query("out = [ray.cluster_resources(), ray.available_resources()]")
        assert isinstance(out, list)
        return out[0], out[1]

    def close(self) -> None:
        """Kill the worker nodes (every process on the hosts) and the head with what it started."""
        if self._closed:
            return
        self._closed = True
        for i in list(self.workers):
            self.kill_node(i)
        self._stop_head()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _stop_head(self) -> None:
        if self.head is not None:
            below = descendants(self.head.pid)  # the GCS, the raylet and its workers, ...: nothing to save
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.head.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.head.wait(timeout=10)
            kill_left(below)
            self.head = None

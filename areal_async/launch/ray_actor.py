"""What runs on each node of a Ray cluster for launcher=ray: `NodeProcesses`, made a Ray actor by
launch/ray_cluster.py, one per placement-group bundle (a server, or one torchrun agent of the trainer job).

The actor is a launcher's hands on a node it cannot otherwise reach: it starts the very processes the local
launcher starts (launch/processes.py `Processes`: the same command lines, logs in `run_dir/logs/`, each child in a
session of its own that the kernel SIGTERMs when the actor dies), reports each child's exit with its log tail
(`wait`), and stops them. It runs nothing of the run itself: the controller stays the one asyncio process, and the
servers and trainer ranks talk to it over HTTP and msgspec RPC as under every other launcher.

An async actor (Ray runs its methods on one event loop): `wait` polls without blocking `stop` or `shutdown`, and the
children are forked from that loop's thread, which lives as long as the actor, so their PR_SET_PDEATHSIG (which the
kernel ties to the forking thread) fires when the actor's process dies, not when some pool thread retires. Plain
Python otherwise: tests drive it without Ray. No torch here.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from areal_async.launch.processes import Child, Processes, _url_from_log, free_port, tail
from areal_async.launch.sglang_server import sglang_server_cmd
from areal_async.net.address import WILDCARDS, host_address

__all__ = ["NodeProcesses"]


def _node_ip() -> str:
    """This node's address as the Ray cluster knows it (the one its raylet advertises), else a routable one."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # not inside Ray (tests), or Ray cannot tell
        return host_address()


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return ""


class NodeProcesses:
    """The run's processes on one node. `env` is added to this process's environment, which every child inherits
    (the node's own environment, as Ray's workers have it, plus what the launcher passes on)."""

    def __init__(self, run_dir: str, env: dict[str, str]) -> None:
        os.environ.update(env)
        self.procs = Processes(run_dir)

    def node(self) -> dict[str, Any]:
        """Where this actor runs: address, host name, Ray node id, pid (also the launcher's liveness probe)."""
        return {"ip": _node_ip(), "hostname": socket.gethostname(), "node_id": _node_id(), "pid": os.getpid()}

    def free_port(self) -> int:
        """A free port on this node (the c10d store of the trainer job's first agent)."""
        return free_port("0.0.0.0")

    def _child(self, pid: int) -> Child | None:
        return next((c for c in self.procs.children if c.proc.pid == pid), None)

    async def start_server(self, backend: str, kwargs: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Start a server as the local launcher does (`Processes.start_embedded_server` or `start_sglang_server`
        with these keywords) and return its pid, log and URL as other hosts reach it: a wildcard bind address
        becomes this node's address. An embedded server on port 0 names its port in its ready line: this waits for
        it (`timeout_s`), and fails with the log tail if the server exits first."""
        if backend == "embedded":
            child = self.procs.start_embedded_server(**kwargs)
        else:  # SGLang's command as the local launcher builds it, from GPU 0 of those Ray gave this actor
            kw = dict(kwargs)
            index, model, host = kw.pop("index"), kw.pop("model"), kw.pop("host")
            port = kw.pop("port") or free_port(host)  # SGLang needs its port on the command line
            cmd = sglang_server_cmd(model, host=host, port=str(port), base_gpu_id=0, **kw)
            child = self.procs.spawn(f"server{index}", cmd, role="server", url=f"http://{host}:{port}")
        deadline = time.monotonic() + timeout_s
        while not (child.url or _url_from_log(self.procs, child.name)):
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.describe_exit()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{child.name} printed no ready line within {timeout_s:.0f}s:\n{tail(child.log_path)}"
                )
            await asyncio.sleep(0.2)
        url = urlsplit(child.url or "")
        host = url.hostname or ""
        if host in WILDCARDS or host == "":
            host = _node_ip()
        host = f"[{host}]" if ":" in host else host
        return {"pid": child.proc.pid, "log_path": child.log_path, "url": f"http://{host}:{url.port}"}

    def start_trainer(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Start one torchrun agent as the local launcher does (`Processes.start_trainers` with these keywords)."""
        child = self.procs.start_trainers(**kwargs)
        return {"pid": child.proc.pid, "log_path": child.log_path}

    async def wait(self, pid: int, poll_s: float = 0.25) -> dict[str, Any]:
        """Return once child `pid` has exited: its exit code and log tail, and whether it was asked to stop."""
        child = self._child(pid)
        if child is None:
            return {"exit_code": None, "log_tail": "<not started here>", "expected": True}
        while child.proc.poll() is None:
            await asyncio.sleep(poll_s)
        return {"exit_code": child.proc.poll(), "log_tail": tail(child.log_path), "expected": child.expected_exit}

    async def stop(self, pid: int, grace_s: float) -> None:
        """Stop child `pid` on purpose (SIGTERM, SIGKILL after `grace_s`; torchrun's workers too)."""
        child = self._child(pid)
        if child is not None:
            child.expected_exit = True
            await asyncio.to_thread(self.procs.stop, child, grace_s)

    async def shutdown(self, grace_s: float, trainers_first_s: float = 0.0) -> None:
        """Stop every child. A trainer agent whose ranks took the run's shutdown RPC exits by itself: it gets
        `trainers_first_s` to do so before any signal (torchrun stopped by one prints a traceback into its log)."""
        for child in self.procs.children:
            child.expected_exit = True
        if trainers_first_s > 0:
            await asyncio.to_thread(self.procs.wait_exited, "trainer", trainers_first_s)
        await asyncio.to_thread(self.procs.shutdown, grace_s)

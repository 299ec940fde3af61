"""Child processes on this host: inference servers and torchrun trainers, their logs, health and teardown.

Each child runs in its own session (process group) with its log in `<run_dir>/logs/`, and on Linux asks the kernel to
SIGTERM it if its parent dies (PR_SET_PDEATHSIG), so neither Ctrl-C, an exception nor a killed controller leaves
orphans. `exited()` names every child that ended without being asked to (once each), which is what a cluster's
watch turns into events; `watch()` is the short form for scripts and tests: it raises `ChildFailed` with the child's
log tail. No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Literal

import aiohttp

from areal_async.host.torch_threads import thread_env
from areal_async.launch.sglang_server import sglang_server_cmd
from areal_async.launch.vllm_server import vllm_server_cmd

__all__ = ["sglang_server_cmd", "thread_env"]  # where launchers imported them from before
from areal_async.protocol.ready_line import READY_PREFIX

log = logging.getLogger(__name__)

Role = Literal["server", "trainer", "other"]


class ChildFailed(RuntimeError):
    """A child process died or never became healthy; the message carries the tail of its log."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: str
    role: Role = "other"
    url: str | None = None  # servers: the base URL they serve
    expected_exit: bool = False  # set by shutdown(): an exit from now on is no failure
    reported: bool = False  # its unexpected exit was handed out by exited()
    log_offset: int = 0  # where this process's part of its (appended-to) log starts

    def describe_exit(self) -> str:
        return f"{self.name} exited with code {self.proc.poll()}; log tail ({self.log_path}):\n{tail(self.log_path)}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def _url_from_log(procs: Processes, name: str) -> str:
    """The URL a child started on port 0 printed in its ready line (protocol/ready_line.py); "" until then.
    Found, it becomes the child's `url`."""
    child = next((c for c in procs.children if c.name == name), None)
    if child is None:
        return ""
    if child.url:
        return child.url
    try:
        with open(child.log_path, "rb") as f:
            f.seek(child.log_offset)  # a restarted server appends to the log of the one before
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(READY_PREFIX):
            child.url = line[len(READY_PREFIX) :].strip()
            return child.url
    return ""


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below `pid`, read from /proc. torchrun starts each worker in a session of
    its own, so signalling the agent's process group misses them: teardown kills these by pid (the start time
    tells a worker from a later process that reused its pid)."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry))
            starts[int(entry)] = fields[19]
    out, todo = [], list(parents.get(pid, []))
    while todo:
        p = todo.pop()
        out.append((p, starts[p]))
        todo.extend(parents.get(p, []))
    return out


def kill_left(procs: list[tuple[int, str]], timeout_s: float = 10.0) -> None:
    """SIGKILL those of `procs` (from `descendants`) still alive, and wait until they are gone."""

    def live(p: int, start: str) -> bool:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return False
        return fields[19] == start and fields[0] not in ("Z", "X")

    left = [(p, st) for p, st in procs if live(p, st)]
    for p, _ in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [(p, st) for p, st in left if live(p, st)]


def _child_setup(nice: int = 0) -> None:  # runs in the child between fork and exec
    if nice:
        os.nice(nice)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def interrupt_on_sigterm() -> None:
    """SIGTERM (scancel, a time limit, `kill`) stops this process the way Ctrl-C does, so its teardown runs: it
    raises SIGINT, which asyncio.run turns into cancelling the main task (or KeyboardInterrupt outside a loop)."""

    def handler(signum: int, frame: object) -> None:
        if callable(signal.getsignal(signal.SIGINT)):
            signal.raise_signal(signal.SIGINT)
        else:  # SIGINT ignored (a background job): interrupt directly
            raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
        signal.signal(signal.SIGTERM, handler)


# ---- commands (shared by the launchers: a Slurm step runs the same command under srun) ----------------------------


def embedded_server_cmd(
    model: str,
    *,
    host: str,
    port: str,
    device: str,
    max_total_tokens: int,
    max_running_requests: int,
    api_key: str | None,
    weight_version: int = 0,
    prefix_cache: bool = True,
    dtype: str = "auto",
) -> list[str]:
    """`port` is a string so that a launcher can pass a placeholder the step fills in (launch/step.py); `dtype`
    is `model.dtype` (the server's weights and KV cache)."""
    cmd = [
        sys.executable,
        "-m",
        "areal_async.serve",
        "--model",
        model,
        "--host",
        host,
        "--port",
        port,
        "--device",
        device,
        "--dtype",
        dtype,
        "--max-total-tokens",
        str(max_total_tokens),
        "--max-running-requests",
        str(max_running_requests),
        "--weight-version",
        str(weight_version),
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    if not prefix_cache:
        cmd.append("--disable-radix-cache")
    return cmd


def trainer_cmd(
    *,
    model: str,
    nproc: int,
    config_json: str,
    seed: int,
    run_dir: str,
    resume: str | None = None,
    torchrun_args: list[str] | None = None,
    rpc_host: str | None = None,
) -> list[str]:
    """One torchrun agent: `torchrun_args` carries the rendezvous (empty: --standalone)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += torchrun_args if torchrun_args else ["--standalone"]
    cmd += [
        "-m",
        "areal_async.train.worker",
        "--model",
        model,
        "--run-dir",
        run_dir,
        "--config-json",
        config_json,
        "--seed",
        str(seed),
    ]
    if resume:
        cmd += ["--resume", resume]
    if rpc_host:
        cmd += ["--rpc-host", rpc_host]
    return cmd


def c10d_args(*, nnodes: int, endpoint: str, run_id: str, timeout_s: float) -> list[str]:
    """torchrun's elastic (c10d) rendezvous of `nnodes` agents: the agent on the endpoint's host serves the store,
    the others connect; they give up after `timeout_s` if not all of them arrive."""
    return [
        "--nnodes",
        str(nnodes),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        f"join_timeout={int(max(1, timeout_s))}",
        "--max-restarts",
        "0",
    ]


class Processes:
    """The children of one run on this host."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.log_dir = os.path.join(run_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.children: list[Child] = []

    def spawn(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str] | None = None,
        *,
        role: Role = "other",
        url: str | None = None,
        unset: frozenset[str] = frozenset(),
        nice: int = 0,
    ) -> Child:
        """Start `cmd` with this environment plus `env`, minus the variables named in `unset`, at CPU priority
        `nice` (added to ours)."""
        log_path = os.path.join(self.log_dir, f"{name}.log")
        out = open(log_path, "ab")
        offset = out.tell()
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        inherited = {k: v for k, v in os.environ.items() if k not in unset}
        full_env = {**inherited, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                start_new_session=True,
                preexec_fn=functools.partial(_child_setup, nice),
            )
        finally:
            out.close()
        child = Child(name, proc, log_path, role=role, url=url, log_offset=offset)
        self.children.append(child)
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return child

    # ---- servers ------------------------------------------------------------------------------------------------

    def start_embedded_server(
        self,
        index: int,
        model: str,
        *,
        host: str,
        port: int,
        device: str,
        max_total_tokens: int,
        max_running_requests: int,
        api_key: str | None,
        torch_threads: int,
        weight_version: int = 0,
        prefix_cache: bool = True,
        cuda_visible_devices: str | None = None,
        dtype: str = "auto",
    ) -> Child:
        """Port 0: the server binds a free port itself and prints it in its ready line (server/cli.py); its `url` is
        filled in from its log by `wait_healthy` (no port picked here and bound there later, which another
        process could take in between)."""
        cmd = embedded_server_cmd(
            model,
            host=host,
            port=str(port),
            device=device,
            max_total_tokens=max_total_tokens,
            max_running_requests=max_running_requests,
            api_key=api_key,
            weight_version=weight_version,
            prefix_cache=prefix_cache,
            dtype=dtype,
        )
        env = thread_env(torch_threads)
        if cuda_visible_devices is not None:  # launch/placement.py: this server's GPU
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        return self.spawn(f"server{index}", cmd, env, role="server", url=f"http://{host}:{port}" if port else None)

    def start_sglang_server(
        self,
        index: int,
        model: str,
        *,
        host: str,
        port: int,
        api_key: str | None,
        extra_args: list[str],
        base_gpu_id: int = 0,
        gpus_per_server: int = 1,
        dtype: str = "auto",
        lora_args: list[str] | None = None,
        python: str | None = None,
        device: str = "auto",
        radix_cache: bool = True,
        threads: int = 1,
        max_total_tokens: int | None = None,
    ) -> Child:
        port = port or free_port(host)  # SGLang needs its port on the command line
        cmd = sglang_server_cmd(
            model,
            host=host,
            port=str(port),
            api_key=api_key,
            extra_args=extra_args,
            base_gpu_id=base_gpu_id + index * gpus_per_server,
            tp_size=gpus_per_server,
            dtype=dtype,
            lora_args=lora_args,
            python=python,
            device=device,
            radix_cache=radix_cache,
            threads=threads,
            max_total_tokens=max_total_tokens,
        )
        return self.spawn(f"server{index}", cmd, role="server", url=f"http://{host}:{port}")

    def start_vllm_server(
        self,
        index: int,
        model: str,
        *,
        host: str,
        port: int,
        api_key: str | None,
        extra_args: list[str],
        python: str | None = None,
        tp_size: int = 1,
        dtype: str = "auto",
        prefix_cache: bool = True,
        lora_rank: int | None = None,
    ) -> Child:
        port = port or free_port(host)  # vLLM needs its port on the command line
        cmd = vllm_server_cmd(
            model, host=host, port=str(port), api_key=api_key, extra_args=extra_args, python=python, tp_size=tp_size,
            dtype=dtype, prefix_cache=prefix_cache, lora_rank=lora_rank,
        )  # fmt: skip
        return self.spawn(f"server{index}", cmd, role="server", url=f"http://{host}:{port}")

    async def wait_healthy(
        self, servers: list[Child] | list[str], timeout_s: float, api_key: str | None = None, *, only: bool = False
    ) -> None:
        """Poll GET /health of every server (children, or plain URLs of servers started elsewhere) until each
        answers 200. Fails fast, with the log tail, as soon as ANY child of this set exits: a trainer that dies
        while the servers load must not leave the launch waiting for them. With `only` (a server restarted while
        the run goes on), only the given children count, and other children's exits stay for the watch."""
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        pending: list[tuple[str, str]] = [(s.name, s.url or "") if isinstance(s, Child) else (s, s) for s in servers]
        mine = [s for s in servers if isinstance(s, Child)]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while pending:
                for child in [c for c in mine if c.proc.poll() is not None] if only else self.exited():
                    child.reported = True
                    raise ChildFailed(child.describe_exit())
                pending = [(name, url or _url_from_log(self, name)) for name, url in pending]
                for name, url in list(pending):
                    if not url:  # a server on port 0 that has not printed its ready line yet
                        continue
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        async with session.get(url + "/health", headers=headers) as r:
                            if r.status == 200:
                                pending.remove((name, url))
                                log.info("%s healthy at %s", name, url)
                if pending:
                    if time.monotonic() > deadline:
                        name, url = pending[0]
                        child = next((c for c in self.children if c.name == name), None)
                        where = (
                            f"; log tail ({child.log_path}):\n{tail(child.log_path)}"
                            if child is not None
                            else f" (no answer from {url}/health)"
                        )
                        raise ChildFailed(f"{name} not healthy after {timeout_s:.0f}s{where}")
                    await asyncio.sleep(0.2)

    # ---- trainers -----------------------------------------------------------------------------------------------

    def start_trainers(
        self,
        *,
        model: str,
        nproc: int,
        config_json: str,
        seed: int,
        secret_hex: str,
        torch_threads: int,
        resume: str | None = None,
        torchrun_args: list[str] | None = None,
        cuda_visible_devices: str | None = None,
        name: str = "trainer",
        rpc_host: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Child:
        """One torchrun agent of `nproc` ranks (standalone, or one node of a job `torchrun_args` describes); each
        rank reads its TrainConfig (temperature included) from `config_json` and announces itself: a rank file
        `<run_dir>/trainer/rank<r>.json`, or a report to the controller's registry when `env` names one
        (net/rank_registry.py)."""
        cmd = trainer_cmd(
            model=model,
            nproc=nproc,
            config_json=config_json,
            seed=seed,
            run_dir=self.run_dir,
            resume=resume,
            torchrun_args=torchrun_args,
            rpc_host=rpc_host,
        )
        full_env = {**thread_env(torch_threads), "AREAL_RPC_SECRET": secret_hex, **(env or {})}
        if cuda_visible_devices is not None:
            full_env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        return self.spawn(name, cmd, full_env, role="trainer")

    # ---- health and teardown ------------------------------------------------------------------------------------

    def exited(self) -> list[Child]:
        """Children that ended without being asked to and were not named before (each is named once)."""
        out = []
        for child in self.children:
            if not child.reported and not child.expected_exit and child.proc.poll() is not None:
                child.reported = True
                out.append(child)
        return out

    async def watch(self, interval_s: float = 0.5) -> None:
        """Return never; raise ChildFailed when any child exits unexpectedly."""
        while True:
            for child in self.exited():
                raise ChildFailed(child.describe_exit())
            await asyncio.sleep(interval_s)

    def stop(self, child: Child, grace_s: float = 10.0) -> None:
        """Stop one child on purpose (a hung server, a trainer job being replaced): SIGTERM its process group, then
        SIGKILL after `grace_s` (0: at once; a SIGSTOPped process only obeys SIGKILL), and forget it. Its exit is
        never reported by `exited()`. Blocking: call it off the event loop."""
        child.expected_exit = True
        below = descendants(child.proc.pid) if child.proc.poll() is None else []
        if child.proc.poll() is None and grace_s > 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=10)
        kill_left(below)  # torchrun's workers, in sessions of their own
        if child in self.children:
            self.children.remove(child)  # its pid may be reused: shutdown must not signal that group later

    def wait_exited(self, role: Role, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for every child of `role` to exit by itself; True when none is left running. Used
        after the trainer ranks took the shutdown RPC: torchrun then exits cleanly once its workers have, while a
        signal makes it print a SignalException traceback. Blocking: call it off the event loop."""
        deadline = time.monotonic() + timeout_s
        for child in [c for c in self.children if c.role == role]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return all(c.proc.poll() is not None for c in self.children if c.role == role)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child's process group, wait up to grace_s, then SIGKILL what is left, torchrun's workers
        (in sessions of their own) included: a worker busy with a long call, or stopped, would outlive the run."""
        below = [d for c in self.children if c.proc.poll() is None for d in descendants(c.proc.pid)]
        for child in self.children:
            child.expected_exit = True
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            # the group may hold grandchildren (torchrun's workers) even when the leader is gone
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=5)
        kill_left(below)

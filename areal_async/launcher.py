"""Start inference servers and torchrun trainers as child processes, wait for health, tear everything down.

Each child runs in its own session (process group) with its log in `<run_dir>/logs/`, and on Linux asks the kernel
to SIGTERM it if the launcher dies (PR_SET_PDEATHSIG), so neither Ctrl-C, an exception nor a killed controller
leaves orphans. `watch()` raises as soon as a child exits unexpectedly, with the tail of its log, so the run ends
cleanly instead of waiting on a dead peer. No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp

log = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A child process died or never became healthy; the message carries the tail of its log."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: str
    expected_exit: bool = False


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


def _child_setup() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Launcher:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.log_dir = os.path.join(run_dir, "logs")
        os.makedirs(self.log_dir, exist_ok=True)
        self.children: list[Child] = []

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Child:
        log_path = os.path.join(self.log_dir, f"{name}.log")
        out = open(log_path, "ab")
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env,
                                start_new_session=True, preexec_fn=_child_setup)
        out.close()
        child = Child(name, proc, log_path)
        self.children.append(child)
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return child

    # ---- servers ------------------------------------------------------------------------------------------------

    def start_embedded_server(self, index: int, model: str, *, host: str, port: int, device: str,
                              max_total_tokens: int, max_running_requests: int, api_key: str | None,
                              torch_threads: int, weight_version: int = 0, prefix_cache: bool = True
                              ) -> tuple[Child, str]:
        port = port or free_port(host)
        cmd = [sys.executable, "-m", "areal_async.serve", "--model", model, "--host", host, "--port", str(port),
               "--device", device, "--max-total-tokens", str(max_total_tokens),
               "--max-running-requests", str(max_running_requests), "--weight-version", str(weight_version)]
        if api_key:
            cmd += ["--api-key", api_key]
        if not prefix_cache:
            cmd.append("--disable-radix-cache")
        env = _thread_env(torch_threads)
        return self.spawn(f"server{index}", cmd, env), f"http://{host}:{port}"

    def start_sglang_server(self, index: int, model: str, *, host: str, port: int, api_key: str | None,
                            extra_args: list[str], base_gpu_id: int = 0, gpus_per_server: int = 1
                            ) -> tuple[Child, str]:
        port = port or free_port(host)
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", host, "--port",
               str(port), *extra_args]
        if "--base-gpu-id" not in extra_args:
            cmd += ["--base-gpu-id", str(base_gpu_id + index * gpus_per_server)]
        if api_key:
            cmd += ["--api-key", api_key]
        return self.spawn(f"server{index}", cmd), f"http://{host}:{port}"

    async def wait_healthy(self, children_urls: list[tuple[Child, str]], timeout_s: float,
                           api_key: str | None = None) -> None:
        """Poll GET /health on every server until 200; fail fast if a server process exits."""
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        pending = list(children_urls)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while pending:
                for child, url in list(pending):
                    self._check_alive(child)
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        async with session.get(url + "/health", headers=headers) as r:
                            if r.status == 200:
                                pending.remove((child, url))
                                log.info("%s healthy at %s", child.name, url)
                if pending:
                    if time.monotonic() > deadline:
                        child = pending[0][0]
                        raise ChildFailed(f"{child.name} not healthy after {timeout_s:.0f}s; log tail "
                                          f"({child.log_path}):\n{tail(child.log_path)}")
                    await asyncio.sleep(0.2)

    # ---- trainers -----------------------------------------------------------------------------------------------

    def start_trainers(self, *, model: str, nproc: int, config_json: str, seed: int, secret_hex: str,
                       torch_threads: int, resume: str | None = None, torchrun_args: list[str] | None = None,
                       cuda_visible_devices: str | None = None) -> Child:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        cmd += torchrun_args if torchrun_args else ["--standalone"]
        cmd += ["-m", "areal_async.train.worker", "--model", model, "--run-dir", self.run_dir,
                "--config-json", config_json, "--seed", str(seed)]
        if resume:
            cmd += ["--resume", resume]
        env = {**_thread_env(torch_threads), "AREAL_RPC_SECRET": secret_hex}
        if cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        return self.spawn("trainer", cmd, env)

    # ---- health and teardown ------------------------------------------------------------------------------------

    def _check_alive(self, child: Child) -> None:
        code = child.proc.poll()
        if code is not None and not child.expected_exit:
            raise ChildFailed(f"{child.name} exited with code {code}; log tail ({child.log_path}):\n"
                              f"{tail(child.log_path)}")

    async def watch(self, interval_s: float = 0.5) -> None:
        """Return never; raise ChildFailed when any child exits unexpectedly."""
        while True:
            for child in self.children:
                self._check_alive(child)
            await asyncio.sleep(interval_s)

    def shutdown(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child's process group, wait up to grace_s, then SIGKILL what is left."""
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


def _thread_env(n: int) -> dict[str, str]:
    n = max(1, n)
    return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n), "AREAL_TORCH_THREADS": str(n),
            "TOKENIZERS_PARALLELISM": "false"}

"""Launchers for one host: `LocalLauncher` (embedded or SGLang servers and a torchrun job as children of this
process) and `ExternalLauncher` (servers already running, given as URLs, and the torchrun job here; its ranks may
span nodes through `train.torchrun_args`). See launch/api.py for the protocol."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlsplit

import msgspec

from areal_async.launch.api import (ClusterEvent, EventHandler, ProcessExited, ServerHandle, ServerJoined,
                                    TrainerHandle)
from areal_async.launch.processes import Child, Processes, tail

if TYPE_CHECKING:
    from areal_async.config import RunConfig

log = logging.getLogger(__name__)


class LocalCluster:
    """Children of this process, watched by polling. Launched servers and the trainer job can be restarted while
    the run goes on (the recovery policy, launch/recovery.py, does so): `restart_server`, `stop_server`,
    `restart_trainers`. A restarted server is announced by `watch` as `ServerJoined`."""

    def __init__(self, processes: Processes, servers: list[ServerHandle], trainers: TrainerHandle,
                 poll_s: float = 0.5, *, cfg: "RunConfig | None" = None, model_path: str | None = None,
                 start_server: Callable[[int, int], Child] | None = None) -> None:
        self.processes = processes
        self.servers = servers
        self.trainers = trainers
        self.poll_s = poll_s
        self._cfg = cfg
        self._model_path = model_path
        self._start_server = start_server  # (index, port) -> child; None: the servers are not ours (external)
        self._joined: list[ServerJoined] = []
        self._fresh_port: set[str] = set()  # servers whose old port failed them: the next start takes a free one
        self._closed = False

    async def watch(self, on_event: EventHandler) -> None:
        while True:
            for child in self.processes.exited():
                await on_event(_exit_event(child))
            while self._joined:
                await on_event(self._joined.pop(0))
            await asyncio.sleep(self.poll_s)

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self.processes.shutdown)

    # ---- restarting (the recovery policy's side of the cluster) -------------------------------------------------

    def _child(self, name: str) -> Child | None:
        return next((c for c in reversed(self.processes.children) if c.name == name), None)

    @property
    def can_restart_servers(self) -> bool:
        return self._start_server is not None

    def server_alive(self, name: str) -> bool:
        child = self._child(name)
        return child is not None and child.proc.poll() is None

    def trainer_pid(self) -> int | None:
        child = self._child("trainer")
        return child.proc.pid if child is not None else None

    async def stop_server(self, name: str) -> None:
        """Kill a launched server (SIGKILL: a hung one may be SIGSTOPped); its exit is not reported as an event."""
        child = self._child(name)
        if child is not None:
            await asyncio.to_thread(self.processes.stop, child, 0)

    async def restart_server(self, name: str) -> ServerHandle:
        """Start server `name` again (its old process is stopped first if it still runs), on its old port when it
        can, and return once it answers /health; `ServerJoined` follows from `watch`. Raises `ChildFailed` (with
        the log tail) when the new process dies or stays unhealthy for `server.startup_timeout_s`."""
        if self._start_server is None or self._cfg is None:
            raise NotImplementedError(f"{name} was not started by this cluster: it cannot be restarted")
        index = next((i for i, s in enumerate(self.servers) if s.name == name), None)
        if index is None:
            raise KeyError(f"unknown server {name!r}")
        old = self._child(name)
        if old is not None:
            await asyncio.to_thread(self.processes.stop, old, 0)
        port = 0 if name in self._fresh_port else (urlsplit(self.servers[index].url).port or 0)
        child = self._start_server(int(name.removeprefix("server")), port)
        try:
            await self.processes.wait_healthy([child], self._cfg.server.startup_timeout_s, self._cfg.server.api_key,
                                              only=True)
        except BaseException:
            self._fresh_port.add(name)  # its port may be taken now
            await asyncio.to_thread(self.processes.stop, child, 0)
            raise
        self._fresh_port.discard(name)
        handle = ServerHandle(name, child.url or "")
        self.servers[index] = handle
        self._joined.append(ServerJoined(name, handle.url))
        return handle

    async def restart_trainers(self, resume: str | None) -> TrainerHandle:
        """Replace the trainer job: the old one is stopped (SIGTERM, then SIGKILL), its rank files removed, and a new
        torchrun job starts from the trainer checkpoint `resume` (None: the base model). Returns how to reach it
        (a new RPC secret); the ranks may still be loading."""
        if self._cfg is None or self._model_path is None:
            raise NotImplementedError("this cluster cannot restart its trainers")
        old = self._child("trainer")
        if old is not None:
            await asyncio.to_thread(self.processes.stop, old, 10.0)
        rank_dir = os.path.join(self._cfg.run_dir, "trainer")
        if os.path.isdir(rank_dir):
            for entry in os.listdir(rank_dir):
                if entry.endswith(".json"):
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(rank_dir, entry))
        self.trainers = _start_trainers(self.processes, self._cfg, self._model_path, resume,
                                        self.trainers.master_address)
        return self.trainers


def _exit_event(child: Child) -> ClusterEvent:
    return ProcessExited(role=child.role, name=child.name, exit_code=child.proc.poll(), log_path=child.log_path,
                         log_tail=tail(child.log_path), url=child.url, pid=child.proc.pid)


class LocalLauncher:
    """`server.backend` embedded or sglang: `server.num_servers` servers and one torchrun job, all on this host."""

    async def launch(self, cfg: "RunConfig", *, model_path: str, trainer_resume: str | None = None) -> LocalCluster:
        procs = Processes(cfg.run_dir)
        try:
            trainers = _start_trainers(procs, cfg, model_path, trainer_resume, cfg.server.host)
            servers = self._start_servers(procs, cfg, model_path)
            # the trainers load while the servers do; wait_healthy fails fast if any child dies meanwhile
            await procs.wait_healthy(servers, cfg.server.startup_timeout_s, cfg.server.api_key)
        except BaseException:
            await asyncio.to_thread(procs.shutdown)
            raise
        return LocalCluster(procs, [ServerHandle(c.name, c.url or "") for c in servers], trainers, cfg=cfg,
                            model_path=model_path, start_server=functools.partial(_start_server, procs, cfg,
                                                                                  model_path))

    @staticmethod
    def _start_servers(procs: Processes, cfg: "RunConfig", model_path: str) -> list[Child]:
        srv = cfg.server
        return [_start_server(procs, cfg, model_path, i, srv.port + i if srv.port else 0)
                for i in range(srv.num_servers)]


def _start_server(procs: Processes, cfg: "RunConfig", model_path: str, index: int, port: int) -> Child:
    """Server `index` as `server.backend` asks (at launch, and again when the recovery policy restarts it)."""
    srv = cfg.server
    if srv.backend == "embedded":
        return procs.start_embedded_server(
            index, model_path, host=srv.host, port=port, device=srv.device,
            max_total_tokens=srv.max_total_tokens, max_running_requests=srv.max_running_requests,
            api_key=srv.api_key, torch_threads=srv.torch_threads, prefix_cache=srv.prefix_cache)
    return procs.start_sglang_server(
        index, model_path, host=srv.host, port=port, api_key=srv.api_key, extra_args=srv.extra_args,
        base_gpu_id=srv.base_gpu_id, gpus_per_server=srv.gpus_per_server)


class ExternalLauncher:
    """`server.backend=external`: the servers at `server.urls` must answer /health within
    `server.startup_timeout_s`; the trainers are a torchrun job started here."""

    async def launch(self, cfg: "RunConfig", *, model_path: str, trainer_resume: str | None = None) -> LocalCluster:
        procs = Processes(cfg.run_dir)
        try:
            trainers = _start_trainers(procs, cfg, model_path, trainer_resume, _my_address())
            await procs.wait_healthy(list(cfg.server.urls), cfg.server.startup_timeout_s, cfg.server.api_key)
        except BaseException:
            await asyncio.to_thread(procs.shutdown)
            raise
        servers = [ServerHandle(f"server{i}", url.rstrip("/")) for i, url in enumerate(cfg.server.urls)]
        return LocalCluster(procs, servers, trainers, cfg=cfg, model_path=model_path)


def _start_trainers(procs: Processes, cfg: "RunConfig", model_path: str, resume: str | None,
                    master_address: str) -> TrainerHandle:
    secret = os.urandom(32)
    t = cfg.train
    procs.start_trainers(model=model_path, nproc=t.nproc, config_json=msgspec.json.encode(t).decode(), seed=cfg.seed,
                         secret_hex=secret.hex(), torch_threads=t.torch_threads, resume=resume,
                         torchrun_args=t.torchrun_args, cuda_visible_devices=t.cuda_visible_devices)
    return TrainerHandle(world_size=t.nproc, rendezvous_dir=cfg.run_dir, secret=secret,
                         master_address=master_address)


def _my_address() -> str:
    """An address of this host that external servers can reach (for the broadcast rendezvous)."""
    return socket.gethostbyname(socket.gethostname())


def launcher_for(cfg: "RunConfig") -> LocalLauncher | ExternalLauncher:
    """The launcher `server.backend` asks for (a Slurm launcher will be chosen here too)."""
    return ExternalLauncher() if cfg.server.backend == "external" else LocalLauncher()

"""Launchers for one host: `LocalLauncher` (embedded or SGLang servers and a torchrun job as children of this
process) and `ExternalLauncher` (servers already running, given as URLs, and the torchrun job here; its ranks may
span nodes through `train.torchrun_args`). See launch/api.py for the protocol."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import TYPE_CHECKING

import msgspec

from areal_async.launch.api import ClusterEvent, EventHandler, ProcessExited, ServerHandle, TrainerHandle
from areal_async.launch.processes import Child, Processes, tail

if TYPE_CHECKING:
    from areal_async.config import RunConfig

log = logging.getLogger(__name__)


class LocalCluster:
    """Children of this process, watched by polling."""

    def __init__(self, processes: Processes, servers: list[ServerHandle], trainers: TrainerHandle,
                 poll_s: float = 0.5) -> None:
        self.processes = processes
        self.servers = servers
        self.trainers = trainers
        self.poll_s = poll_s
        self._closed = False

    async def watch(self, on_event: EventHandler) -> None:
        while True:
            for child in self.processes.exited():
                await on_event(_exit_event(child))
            await asyncio.sleep(self.poll_s)

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self.processes.shutdown)


def _exit_event(child: Child) -> ClusterEvent:
    return ProcessExited(role=child.role, name=child.name, exit_code=child.proc.poll(), log_path=child.log_path,
                         log_tail=tail(child.log_path), url=child.url)


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
        return LocalCluster(procs, [ServerHandle(c.name, c.url or "") for c in servers], trainers)

    @staticmethod
    def _start_servers(procs: Processes, cfg: "RunConfig", model_path: str) -> list[Child]:
        srv = cfg.server
        out = []
        for i in range(srv.num_servers):
            port = srv.port + i if srv.port else 0
            if srv.backend == "embedded":
                out.append(procs.start_embedded_server(
                    i, model_path, host=srv.host, port=port, device=srv.device,
                    max_total_tokens=srv.max_total_tokens, max_running_requests=srv.max_running_requests,
                    api_key=srv.api_key, torch_threads=srv.torch_threads, prefix_cache=srv.prefix_cache))
            else:
                out.append(procs.start_sglang_server(
                    i, model_path, host=srv.host, port=port, api_key=srv.api_key, extra_args=srv.extra_args,
                    base_gpu_id=srv.base_gpu_id, gpus_per_server=srv.gpus_per_server))
        return out


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
        return LocalCluster(procs, servers, trainers)


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

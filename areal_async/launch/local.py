"""Launchers for one host: `LocalLauncher` (embedded or SGLang servers and a torchrun job as children of this
process) and `ExternalLauncher` (servers already running, given as URLs, and the torchrun job here). See
launch/api.py for the protocol; `launcher_for` picks one (or the Slurm launcher, launch/slurm.py).

A trainer job of `train.nnodes` > 1 is that many torchrun agents joined by c10d rendezvous; here they all run on
this host (a real multi-node job, on one machine), or only the first `train.rdzv.local_agents` of them, the others
started by hand elsewhere with the command the launcher logs. Ranks report their addresses to the run's registry
(net/rank_registry.py) unless `train.rdzv.discovery=files`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import shlex
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import msgspec

from areal_async.config import ConfigError
from areal_async.launch.api import ClusterEvent, EventHandler, ProcessExited, ServerHandle, ServerJoined, TrainerHandle
from areal_async.launch.membership import JoinFile, join_file
from areal_async.launch.placement import Placement, plan_placement
from areal_async.launch.processes import Child, Processes, c10d_args, free_port, tail, trainer_cmd
from areal_async.launch.sglang_server import sglang_options
from areal_async.launch.shrink import Shrink, TrainerLayout
from areal_async.launch.slurm import SlurmLauncher
from areal_async.net.address import advertised, host_address, rendezvous_host
from areal_async.net.rank_registry import Registry, rank_files_dir, read_secret

if TYPE_CHECKING:
    from areal_async.config import RunConfig, TrainConfig
    from areal_async.launch.api import Launcher

log = logging.getLogger(__name__)


class LocalCluster:
    """Children of this process, watched by polling. Launched servers and the trainer job can be restarted while
    the run goes on (the recovery policy, launch/recovery.py, does so): `restart_server`, `stop_server`,
    `restart_trainers`. A restarted server is announced by `watch` as `ServerJoined` under its old name."""

    def __init__(
        self,
        processes: Processes,
        servers: list[ServerHandle],
        trainers: TrainerHandle,
        poll_s: float = 0.5,
        registry: Registry | None = None,
        join: JoinFile | None = None,
        *,
        cfg: RunConfig | None = None,
        model_path: str | None = None,
        start_server: Callable[[int, int], Child] | None = None,
    ) -> None:
        self.processes = processes
        self.servers = servers
        self.trainers = trainers
        self.poll_s = poll_s
        self.registry = registry  # where the trainer ranks reported (train.rdzv.discovery=registry)
        self.join = join  # run_dir/servers.txt: servers joining and leaving (launch/membership.py)
        self._cfg = cfg
        self._model_path = model_path
        self._start_server = start_server  # (index, port) -> child; None: the servers are not ours (external)
        self._joined: list[ServerJoined] = []  # restarted servers, announced by the watch
        self._fresh_port: set[str] = set()  # servers whose old port failed them: the next start takes a free one
        self._closed = False
        self.last_shrink: Shrink | None = None  # what the last restart_trainers shrank, for the record

    async def watch(self, on_event: EventHandler) -> None:
        while True:
            for child in self.processes.exited():
                await on_event(_exit_event(child))
            while self._joined:
                await on_event(self._joined.pop(0))
            if self.join is not None:
                for event in await self.join.poll():
                    await on_event(event)
            await asyncio.sleep(self.poll_s)

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self.processes.shutdown)
            if self.registry is not None:
                await self.registry.close()

    # ---- restarting (the recovery policy's side of the cluster) -------------------------------------------------

    def _child(self, name: str) -> Child | None:
        return next((c for c in reversed(self.processes.children) if c.name == name), None)

    @property
    def can_restart_servers(self) -> bool:
        return self._start_server is not None

    @property
    def can_restart_trainers(self) -> bool:
        """Whether `restart_trainers` will try: this cluster started every agent of the trainer job, or it started
        some and the job may shrink to them (recovery.shrink_trainers, launch/shrink.py)."""
        if self._cfg is None or self._model_path is None:
            return False
        t = self._cfg.train
        return agents_here(t) >= t.nnodes or self._cfg.recovery.shrink_trainers

    def trainer_layout(self) -> TrainerLayout:
        """The agents' hosts: this one for each agent started here, then those started by hand (where their ranks
        reported from, once they have)."""
        assert self._cfg is not None
        t = self._cfg.train
        here = agents_here(t)
        away = self._hosts_by_hand()[: t.nnodes - here]
        away += [f"agent {k} (by hand)" for k in range(here + len(away), t.nnodes)]
        return TrainerLayout((socket.gethostname(),) * here + tuple(away), t.nproc)

    def why_trainers_cannot_restart(self) -> str:
        """Why not, and what the operator does instead (when `can_restart_trainers` is false)."""
        if self._cfg is None or self._model_path is None:
            return "this cluster cannot restart its trainers"
        return self._agents_by_hand()

    def server_alive(self, name: str) -> bool:
        child = self._child(name)
        return child is not None and child.proc.poll() is None

    def trainer_pids(self) -> set[int]:
        """The processes of the current trainer job (its torchrun agents)."""
        return {c.proc.pid for c in self.processes.children if c.role == "trainer" and not c.expected_exit}

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
            await self.processes.wait_healthy(
                [child], self._cfg.server.startup_timeout_s, self._cfg.server.api_key, only=True
            )
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
        job starts from the trainer checkpoint `resume` (None: the base model), with a new RPC secret and registry.
        Returns how to reach it (the ranks may still be loading). Agents started by hand elsewhere
        (train.rdzv.local_agents) cannot be restarted from here: NotImplementedError, naming the hosts their ranks
        reported from and what the operator runs to resume."""
        if not self.can_restart_trainers:
            raise NotImplementedError(self.why_trainers_cannot_restart())
        assert self._cfg is not None and self._model_path is not None
        self.last_shrink = None
        t = self._cfg.train
        here = agents_here(t)
        if here < t.nnodes:  # agents started by hand: the job shrinks to the agents here (can_restart_trainers)
            before = self.trainer_layout()
            why = "its agent was started by hand (train.rdzv.local_agents): this run cannot start it again"
            rdzv = msgspec.structs.replace(t.rdzv, local_agents=None)
            self._cfg = msgspec.structs.replace(self._cfg, train=msgspec.structs.replace(t, nnodes=here, rdzv=rdzv))
            self.last_shrink = Shrink(before, self.trainer_layout(), {h: why for h in before.nodes[here:]})
            log.warning("%s; stop any agent still running there by hand", self.last_shrink.describe())
        for old in [c for c in self.processes.children if c.role == "trainer"]:
            await asyncio.to_thread(self.processes.stop, old, 10.0)
        if self.registry is not None:
            await self.registry.close()
            self.registry = None
        rank_dir = rank_files_dir(self._cfg.run_dir)
        if os.path.isdir(rank_dir):
            for entry in os.listdir(rank_dir):
                if entry.endswith(".json"):
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(rank_dir, entry))
        self.trainers, self.registry = await _start_trainers(
            self.processes, self._cfg, self._model_path, resume, self.trainers.master_address
        )
        return self.trainers

    def _agents_by_hand(self) -> str:
        """Why the trainer job cannot be restarted from here (agents started by hand elsewhere), naming the hosts
        their ranks reported from and what the operator does to go on."""
        assert self._cfg is not None
        t, away = self._cfg.train, self._hosts_by_hand()
        where = f" on {', '.join(away)}" if away else " on the other node(s)"
        return (
            f"agents started by hand (train.rdzv.local_agents={t.rdzv.local_agents} of train.nnodes={t.nnodes}), and "
            "recovery.shrink_trainers=false keeps the job from shrinking to the agents here: run "
            f"the same command again, then start the agent{where} with the command it logs (stop any agent still "
            "running there first)"
        )

    def _hosts_by_hand(self) -> list[str]:
        """The hosts the ranks of agents started by hand reported from, as `node (address)`."""
        here = socket.gethostname()
        ranks = [r for r in (self.registry.entries.values() if self.registry else []) if r.kind == "rank"]
        return sorted(
            {
                f"{r.node} ({r.address.removeprefix('tcp://').rpartition(':')[0].strip('[]')})"
                for r in ranks
                if r.node != here
            }
        )


def _exit_event(child: Child) -> ClusterEvent:
    return ProcessExited(
        role=child.role,
        name=child.name,
        exit_code=child.proc.poll(),
        log_path=child.log_path,
        log_tail=tail(child.log_path),
        url=child.url,
        pid=child.proc.pid,
    )


class LocalLauncher:
    """`server.backend` embedded or sglang: `server.num_servers` servers and one torchrun job, all on this host."""

    async def launch(self, cfg: RunConfig, *, model_path: str, trainer_resume: str | None = None) -> LocalCluster:
        procs = Processes(cfg.run_dir)
        registry = None
        try:
            # servers reach trainer rank 0 (the broadcast store) where they could reach each other: loopback for
            # servers on loopback, else this host's routable address (never "0.0.0.0", which each host dials itself)
            master = advertised(cfg.server.host)
            trainers, registry = await _start_trainers(procs, cfg, model_path, trainer_resume, master)
            servers = self._start_servers(procs, cfg, model_path)
            # the trainers load while the servers do; wait_healthy fails fast if any child dies meanwhile
            await procs.wait_healthy(servers, cfg.server.startup_timeout_s, cfg.server.api_key)
        except BaseException:
            await _stop(procs, registry)
            raise
        handles = [ServerHandle(c.name, c.url or "") for c in servers]
        return LocalCluster(
            procs,
            handles,
            trainers,
            registry=registry,
            join=joins(cfg, handles),
            cfg=cfg,
            model_path=model_path,
            start_server=functools.partial(_start_server, procs, cfg, model_path),
        )

    @staticmethod
    def _start_servers(procs: Processes, cfg: RunConfig, model_path: str) -> list[Child]:
        srv = cfg.server
        place = plan_placement(cfg)  # each server's GPU (launch/placement.py)
        return [
            _start_server(procs, cfg, model_path, i, srv.port + i if srv.port else 0, place)
            for i in range(srv.num_servers)
        ]


def _start_server(
    procs: Processes, cfg: RunConfig, model_path: str, index: int, port: int, place: Placement | None = None
) -> Child:
    """Server `index` as `server.backend` asks (at launch, and again when the recovery policy restarts it, on the
    same GPU: the placement is a function of the config and the host's GPUs)."""
    srv = cfg.server
    place = place or plan_placement(cfg)
    if srv.backend == "embedded":
        return procs.start_embedded_server(
            index,
            model_path,
            host=srv.host,
            port=port,
            device=place.server_devices[index],
            max_total_tokens=srv.max_total_tokens,
            max_running_requests=srv.max_running_requests,
            api_key=srv.api_key,
            torch_threads=srv.torch_threads,
            prefix_cache=srv.prefix_cache,
            cuda_visible_devices=place.server_visible[index],
            dtype=cfg.model.dtype,
        )
    if srv.backend == "vllm":
        lora = cfg.train.lora
        return procs.start_vllm_server(
            index, model_path, host=srv.host, port=port, api_key=srv.api_key, extra_args=list(srv.extra_args),
            python=srv.python, tp_size=srv.gpus_per_server, dtype=cfg.model.dtype, prefix_cache=srv.prefix_cache,
            lora_rank=lora.rank if lora.enabled else None,
        )  # fmt: skip
    return procs.start_sglang_server(
        index,
        model_path,
        host=srv.host,
        port=port,
        base_gpu_id=srv.base_gpu_id,
        gpus_per_server=srv.gpus_per_server,
        **sglang_options(cfg),
    )


class ExternalLauncher:
    """`server.backend=external`: the servers at `server.urls` must answer /health within
    `server.startup_timeout_s`; the trainers are a torchrun job started here."""

    async def launch(self, cfg: RunConfig, *, model_path: str, trainer_resume: str | None = None) -> LocalCluster:
        procs = Processes(cfg.run_dir)
        registry = None
        try:
            # the external servers reach trainer rank 0 (the broadcast store) at this host's routable address,
            # not at gethostbyname(gethostname()), which is often 127.0.1.1 (net/address.py)
            trainers, registry = await _start_trainers(procs, cfg, model_path, trainer_resume, host_address())
            await procs.wait_healthy(list(cfg.server.urls), cfg.server.startup_timeout_s, cfg.server.api_key)
        except BaseException:
            await _stop(procs, registry)
            raise
        servers = [ServerHandle(f"server{i}", url.rstrip("/")) for i, url in enumerate(cfg.server.urls)]
        return LocalCluster(
            procs, servers, trainers, registry=registry, join=joins(cfg, servers), cfg=cfg, model_path=model_path
        )


def joins(cfg: RunConfig, launched: list[ServerHandle]) -> JoinFile:
    """The watcher of run_dir/servers.txt (servers added to and taken out of a running job)."""
    return JoinFile(
        join_file(cfg.run_dir),
        api_key=cfg.server.api_key,
        startup_timeout_s=cfg.server.startup_timeout_s,
        exclude=[s.url for s in launched],
    )


async def _stop(procs: Processes, registry: Registry | None) -> None:
    await asyncio.to_thread(procs.shutdown)
    if registry is not None:
        await registry.close()


def agents_here(t: TrainConfig) -> int:
    """How many of the trainer job's torchrun agents this host starts: every one, or the node ranks below
    train.rdzv.local_agents (the others are started by hand elsewhere)."""
    return t.rdzv.local_agents or t.nnodes


def run_secret(cfg: RunConfig) -> bytes:
    """The RPC secret of a run: fresh, unless agents are started by hand elsewhere (train.rdzv.local_agents):
    they need it too, so it comes from AREAL_RPC_SECRET in this environment and theirs."""
    t = cfg.train
    if t.nnodes > 1 and agents_here(t) < t.nnodes:
        try:
            return read_secret()
        except ValueError as e:
            raise ConfigError(
                f"train.rdzv.local_agents: agents started by hand need the run's RPC secret: {e}; "
                f"export the same AREAL_RPC_SECRET here and on their nodes"
            ) from None
    return os.urandom(32)


async def _start_trainers(
    procs: Processes, cfg: RunConfig, model_path: str, resume: str | None, master_address: str
) -> tuple[TrainerHandle, Registry | None]:
    """One torchrun agent (train.nnodes=1), or the agents of a c10d job of train.nnodes nodes started here (all of
    them, or node ranks below train.rdzv.local_agents; the command for the others is logged)."""
    t = cfg.train
    gpus = plan_placement(cfg).trainer_visible  # per agent here: its GPUs (launch/placement.py)
    secret = run_secret(cfg)
    here = agents_here(t)
    remote = here < t.nnodes  # ranks elsewhere must reach the registry and the rendezvous
    registry = None
    env: dict[str, str] = {}
    if t.rdzv.discovery == "registry":
        registry = Registry(secret, cfg.run_dir)
        await registry.start("0.0.0.0" if remote else "127.0.0.1", host_address() if remote else None)
        env = registry.env()
    common = dict(
        model=model_path, nproc=t.nproc, config_json=msgspec.json.encode(t).decode(), seed=cfg.seed, resume=resume
    )
    try:
        if t.nnodes == 1:
            procs.start_trainers(
                **common,
                secret_hex=secret.hex(),
                torch_threads=t.torch_threads,
                torchrun_args=t.torchrun_args,
                cuda_visible_devices=gpus[0],
                env=env,
            )
        else:
            endpoint = t.rdzv.endpoint or f"{rendezvous_host() if remote else '127.0.0.1'}:{free_port()}"
            rdzv = c10d_args(
                nnodes=t.nnodes, endpoint=endpoint, run_id=secrets.token_hex(4), timeout_s=t.rdzv.timeout_s
            )
            for node in range(here):
                procs.start_trainers(
                    **common,
                    secret_hex=secret.hex(),
                    torch_threads=t.torch_threads,
                    torchrun_args=rdzv,
                    cuda_visible_devices=gpus[node],
                    name=f"trainer{node}",
                    env=env,
                )
            if remote:
                cmd = trainer_cmd(**common, run_dir=cfg.run_dir, torchrun_args=rdzv, rpc_host="0.0.0.0")
                log.warning(
                    "train.nnodes=%d, %d agent(s) started here; start the other %d, one per node, with "
                    "AREAL_RPC_SECRET exported as here and:\n  %s %s",
                    t.nnodes,
                    here,
                    t.nnodes - here,
                    " ".join(f"{k}={v}" for k, v in env.items()),
                    shlex.join(cmd),
                )
    except BaseException:
        if registry is not None:
            await registry.close()
        raise
    return TrainerHandle(
        world_size=t.nnodes * t.nproc, rendezvous_dir=cfg.run_dir, secret=secret, master_address=master_address
    ), registry


def launcher_for(cfg: RunConfig) -> Launcher:
    """The launcher `launcher` and `server.backend` ask for."""
    if cfg.launcher == "slurm":
        return SlurmLauncher()
    if cfg.launcher == "ray":  # imported here: it is the only launcher with an optional dependency (ray, lazily)
        from areal_async.launch.ray_launcher import RayLauncher

        return RayLauncher()
    return ExternalLauncher() if cfg.server.backend == "external" else LocalLauncher()

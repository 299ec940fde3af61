"""`launcher=slurm` inside an allocation: servers and trainers as `srun` job steps of the job this controller runs in.

    sbatch run.sbatch                    # the batch host (the job's first node) runs the controller; see sbatch.py
    salloc -N 2 ... python -m areal_async.run launcher=slurm ...   # or from an interactive allocation

Outside an allocation, `python -m areal_async.run launcher=slurm` submits a batch job that runs this same command
(launch/sbatch.py says why a batch job rather than an allocation held from the login node).

What runs where (`place`, launch/node_assignment.py): the trainer step takes the first `train.nnodes` nodes, one
torchrun agent per node (c10d rendezvous on the first of them; `train.nproc` ranks each); server i runs on node
i // servers_per_node as its own one-task step. Every step asks for exactly its CPUs (`--exact`, `slurm.cpus_per_*`)
and GPUs (`--gres`), and shares the job's memory (`--mem=0`), so steps on one node run side by side and Slurm gives
each its own GPUs (CUDA_VISIBLE_DEVICES per step: an SGLang step always starts at GPU 0 of what it was given). All of
it is checked against the allocation before the first srun, with errors naming the key to change.

Finding the processes: no filesystem is assumed to be shared. Server steps start through launch/step.py, which
reports its node's address and port to the controller's registry (net/rank_registry.py) and then becomes the server;
trainer ranks report there too (train.rdzv.discovery=registry). One log per step, `run_dir/logs/<name>.log`: srun
writes its tasks' output (and its own errors) to the controller's side, so logs need no shared filesystem either.

Bounded waits: a step Slurm does not create within `slurm.node_timeout_s` (its node busy, down or not answering)
fails the launch with srun's own words ("Requested nodes are busy"); servers get `server.startup_timeout_s` to
answer /health; torchrun's rendezvous gives up after `train.rdzv.timeout_s`. Every failure carries the step's log
tail. Teardown (normal exit, error, Ctrl-C, SIGTERM) scancels every step this controller created, waits for Slurm
to report them gone, and kills what is left of the srun processes; the allocation itself belongs to whoever made it
(the batch job ends when the controller does). No torch here.

The allocation itself and the Slurm client commands are in launch/slurm_allocation.py; their names, and those of
launch/node_assignment.py, are re-exported here (`__all__`), where launch/sbatch.py and the tests import them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from areal_async.launch.api import EventHandler, ProcessExited, ServerHandle, TrainerHandle
from areal_async.launch.membership import JoinFile, join_file
from areal_async.launch.node_assignment import NodeAssignment, check_allocation, job_nodes, place
from areal_async.launch.processes import (
    Child,
    ChildFailed,
    Processes,
    c10d_args,
    embedded_server_cmd,
    free_port,
    sglang_server_cmd,
    tail,
    thread_env,
    trainer_cmd,
)
from areal_async.launch.slurm_allocation import (
    Allocation,
    NodeHealth,
    SlurmError,
    describe_steps,
    expand_counts,
    in_allocation,
    list_steps,
    lost_nodes,
    node_health,
    node_lost_message,
    slurm_cmd,
    steps_or_none,
)
from areal_async.net.rank_registry import Registry, rank_file, route_address

if TYPE_CHECKING:
    from areal_async.config import RunConfig

# re-exported from launch/slurm_allocation.py and launch/node_assignment.py: launch/sbatch.py and the tests import them
# from here
__all__ = [
    "Allocation",
    "NodeAssignment",
    "NodeLost",
    "SlurmCluster",
    "SlurmError",
    "SlurmLauncher",
    "check_allocation",
    "describe_steps",
    "expand_counts",
    "in_allocation",
    "job_nodes",
    "list_steps",
    "place",
    "rdzv_port",
    "slurm_cmd",
    "srun_cmd",
    "SRUN_UNSET",
]

log = logging.getLogger(__name__)


# ---- steps --------------------------------------------------------------------------------------------------------


# What a batch job or salloc exports about its own request (or a site's defaults, such as DefMemPerCPU) and srun would
# read as options of our steps; some combinations are fatal to srun ("SLURM_MEM_PER_CPU, SLURM_MEM_PER_GPU, and
# SLURM_MEM_PER_NODE are mutually exclusive"). Every step gives its own, so srun runs without them.
SRUN_UNSET = frozenset(
    {
        "SLURM_CPUS_PER_TASK",
        "SLURM_TRES_PER_TASK",
        "SLURM_CPUS_PER_GPU",
        "SLURM_MEM_PER_CPU",
        "SLURM_MEM_PER_GPU",
        "SLURM_MEM_PER_NODE",
        "SLURM_NTASKS",
        "SLURM_NPROCS",
        "SLURM_NTASKS_PER_CORE",
        "SLURM_NTASKS_PER_GPU",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_NTASKS_PER_SOCKET",
        "SLURM_GPUS",
        "SLURM_GPUS_PER_NODE",
        "SLURM_GPUS_PER_TASK",
        "SLURM_GRES",
        "SLURM_DISTRIBUTION",
        "SLURM_EXCLUSIVE",
        "SLURM_OVERLAP",
        "SLURM_NNODES",
        "SLURM_JOB_NUM_NODES",
    }
)


def srun_cmd(
    job_id: str,
    step_name: str,
    nodes: list[str],
    *,
    cpus_per_task: int,
    gpus_per_node: int,
    extra: list[str],
    label: bool = False,
) -> list[str]:
    """One task per node with exactly these CPUs and GPUs; the step dies whole when one task fails."""
    cmd = [
        "srun",
        f"--jobid={job_id}",
        f"--job-name={step_name}",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        f"--nodelist={','.join(nodes)}",
        f"--cpus-per-task={cpus_per_task}",
        "--exact",
        "--mem=0",
        "--kill-on-bad-exit=1",
        "--input=none",
    ]
    if gpus_per_node:
        cmd.append(f"--gres=gpu:{gpus_per_node}")
    if label:
        cmd.append("--label")
    return cmd + list(extra)


def rdzv_port(job_id: str, controller_node: str | None, first_trainer: str) -> int:
    """A port for the c10d store on the first trainer node: a free one when that is this node, else one derived
    from the job id (two jobs sharing a node then pick different ports)."""
    if controller_node == first_trainer:
        return free_port("0.0.0.0")
    return 29500 + int(re.sub(r"\D", "", job_id) or 0) % 20000


class NodeLost(NotImplementedError):
    """A node of the trainer step went away (power, network, a reboot): Slurm keeps listing that node's part of the
    step, holding its CPUs, and no scancel ends it, so no new trainer step fits in this allocation. The run stops
    with its last checkpoint (run_rollback.py treats a restart that cannot be done as final); resubmitting it once
    the node is back, or on other nodes, resumes it. The message names the node."""


class SlurmCluster:
    """srun children of this controller, one per step; watched by polling like LocalCluster. A failed trainer step
    is replaced in place (`restart_trainers`, on the same nodes), unless one of its nodes went away (`NodeLost`)."""

    def __init__(
        self,
        alloc: Allocation,
        processes: Processes,
        registry: Registry,
        tag: str,
        servers: list[ServerHandle],
        world_size: int,
        secret: bytes,
        rank_dir: str,
        fallback_master: str,
        poll_s: float = 0.5,
    ) -> None:
        self.alloc = alloc
        self.processes = processes
        self.registry = registry
        self.tag = tag
        self.servers = servers
        self._trainers = (world_size, secret, rank_dir, fallback_master)
        self.poll_s = poll_s
        self.join: JoinFile | None = None  # run_dir/servers.txt (launch/membership.py), set once the servers are up
        self._closed = False
        self.start_trainers: Callable[[str | None, int], Child] | None = None  # (resume, generation): set by launch
        self.trainer_nodes: list[str] = []
        self.node_timeout_s = 120.0
        self.nodes_at_start: dict[str, NodeHealth] = {}  # the trainer nodes as they were when the run launched
        self._generation = 0  # trainer steps started so far, minus one

    @property
    def trainers(self) -> TrainerHandle:
        """Rank 0's reported address is where servers reach it for a weight broadcast (known once it reports)."""
        world_size, secret, rank_dir, master = self._trainers
        rank0 = self.registry.entries.get("rank0")
        if rank0 is not None:
            master = rank0.address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        return TrainerHandle(world_size=world_size, rendezvous_dir=rank_dir, secret=secret, master_address=master)

    def step_name(self, name: str) -> str:
        return f"areal.{self.tag}.{name}"

    # ---- replacing the trainer step (the recovery policy's side, launch/recovery.py) ----------------------------

    def trainer_pids(self) -> set[int]:
        """The srun process of the current trainer step."""
        return {c.proc.pid for c in self.processes.children if c.role == "trainer" and not c.expected_exit}

    def lost_trainer_nodes(self) -> dict[str, str]:
        """Trainer nodes that went away since the launch (node -> why; see slurm_allocation.lost_nodes)."""
        return lost_nodes(self.nodes_at_start, node_health(self.trainer_nodes))

    async def restart_trainers(self, resume: str | None) -> TrainerHandle:
        """Replace the trainer step: cancel the old one and wait until Slurm no longer lists it (its CPUs are then
        free again), forget its ranks, and start a new step on the same nodes from the trainer checkpoint `resume`
        (None: the base model) with a fresh rendezvous. Raises `NodeLost` naming the node when a trainer node went
        away (its part of the old step cannot end), `ChildFailed` when the new step is not created in
        `slurm.node_timeout_s`."""
        if self.start_trainers is None:
            raise NotImplementedError("this cluster cannot restart its trainers")
        step = self.step_name("trainer")
        for old in self.processes.children:
            if old.role == "trainer":
                old.expected_exit = True  # its srun ends on the scancel below: no event for that
        deadline = time.monotonic() + self.node_timeout_s
        cancelled = False
        while True:
            listed = await asyncio.to_thread(steps_or_none, self.alloc.job_id)
            sid = None if listed is None else listed.get(step)
            if listed is not None and sid is None:
                break
            if sid is not None and not cancelled:
                await self._scancel([], [sid])
                cancelled = True
            lost = await asyncio.to_thread(self.lost_trainer_nodes) if sid is not None else {}
            if lost or time.monotonic() > deadline:
                raise NodeLost(node_lost_message(sid or step, lost, self.trainer_nodes, self.node_timeout_s))
            await asyncio.sleep(1.0)
        for old in [c for c in self.processes.children if c.role == "trainer"]:
            await asyncio.to_thread(self.processes.stop, old, 5.0)
        for name in [n for n, reg in self.registry.entries.items() if reg.kind == "rank"]:
            self.registry.entries.pop(name)
            with contextlib.suppress(OSError):
                os.remove(rank_file(self.registry.rank_dir, int(name.removeprefix("rank"))))
        self._generation += 1
        child = self.start_trainers(resume, self._generation)
        await SlurmLauncher._wait_created(self, [child], self.node_timeout_s, only=True)
        return self.trainers

    async def watch(self, on_event: EventHandler) -> None:
        while True:
            for child in self.processes.exited():  # an srun exits when its step ends
                await on_event(
                    ProcessExited(
                        role=child.role,
                        name=child.name,
                        exit_code=child.proc.poll(),
                        log_path=child.log_path,
                        log_tail=tail(child.log_path),
                        url=child.url,
                        pid=child.proc.pid,
                    )
                )
            if self.join is not None:
                for event in await self.join.poll():
                    await on_event(event)
            await asyncio.sleep(self.poll_s)

    def _our_steps(self) -> dict[str, str]:
        prefix = self.step_name("")
        return {name: sid for name, sid in list_steps(self.alloc.job_id).items() if name.startswith(prefix)}

    async def shutdown(self, grace_s: float = 15.0) -> None:
        """SIGTERM every step we created (scancel --signal=TERM: servers and trainers shut down cleanly) and every
        srun still waiting for its step to be created; give them `grace_s`, then cancel what is left (scancel:
        SIGKILL) and kill the srun processes; wait, bounded, until Slurm lists none of our steps."""
        if self._closed:
            return
        self._closed = True
        children = self.processes.children
        for child in children:
            child.expected_exit = True
        termed: set[str] = set()
        waiting_stopped: set[str] = set()
        deadline = time.monotonic() + grace_s
        while any(c.proc.poll() is None for c in children) and time.monotonic() < deadline:
            try:
                listed = await asyncio.to_thread(self._our_steps)
            except SlurmError as e:
                log.error("cannot list the steps: %s", e)
                break
            new = sorted(sid for sid in listed.values() if sid not in termed)
            if new:
                await self._scancel(["--signal=TERM"], new)
                termed.update(new)
            for c in children:  # not created yet: stop asking, so it never starts
                if c.proc.poll() is None and self.step_name(c.name) not in listed and c.name not in waiting_stopped:
                    waiting_stopped.add(c.name)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(c.proc.pid, signal.SIGTERM)
            await asyncio.sleep(0.3)
        with contextlib.suppress(SlurmError):
            await self._scancel([], sorted((await asyncio.to_thread(self._our_steps)).values()))
        await asyncio.to_thread(self.processes.shutdown, 5.0)
        deadline = time.monotonic() + grace_s
        left: dict[str, str] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(SlurmError):
                left = await asyncio.to_thread(self._our_steps)
                if not left:
                    break
            await asyncio.sleep(0.5)
        if left:
            log.error("steps still listed %.0fs after scancel: %s", grace_s, " ".join(sorted(left.values())))
        await self.registry.close()

    async def _scancel(self, flags: list[str], ids: list[str]) -> None:
        if not ids:
            return
        log.info("scancel %s%s", "".join(f + " " for f in flags), " ".join(ids))
        try:
            await asyncio.to_thread(slurm_cmd, ["scancel", *flags, *ids])
        except SlurmError as e:
            log.error("could not cancel the steps: %s", e)


class SlurmLauncher:
    """Start the run's steps in the allocation this process runs in (see the module docstring)."""

    async def launch(self, cfg: RunConfig, *, model_path: str, trainer_resume: str | None = None) -> SlurmCluster:
        alloc = await asyncio.to_thread(Allocation.current)
        assignment = place(cfg, alloc.nodes, alloc.controller_node)
        check_allocation(assignment, alloc)
        if os.environ.get("SLURM_STEP_ID"):
            log.warning(
                "the controller runs inside step %s.%s: the CPUs it holds are not free for the run's steps",
                alloc.job_id,
                os.environ["SLURM_STEP_ID"],
            )
        secret = os.urandom(32)
        registry = Registry(secret, cfg.run_dir)
        others = [n for n in assignment.nodes if n != alloc.controller_node]
        remote = bool(others or cfg.slurm.controller_address)
        advertise = cfg.slurm.controller_address or (route_address(_node_address(others[0])) if others else None)
        await registry.start("0.0.0.0" if remote else "127.0.0.1", advertise)
        procs = Processes(cfg.run_dir)
        tag = secrets.token_hex(3)
        cluster: SlurmCluster | None = None
        try:
            world = cfg.train.nnodes * cfg.train.nproc
            cluster = SlurmCluster(
                alloc, procs, registry, tag, [], world, secret, cfg.run_dir, _node_address(assignment.trainer_nodes[0])
            )
            trainer = self._start_trainers(
                cluster, cfg, assignment, model_path, trainer_resume, secret=secret, remote=remote
            )
            cluster.start_trainers = functools.partial(
                self._start_trainers, cluster, cfg, assignment, model_path, secret=secret, remote=remote
            )
            cluster.trainer_nodes = list(assignment.trainer_nodes)
            cluster.node_timeout_s = cfg.slurm.node_timeout_s
            cluster.nodes_at_start = await asyncio.to_thread(node_health, cluster.trainer_nodes)
            servers = self._start_servers(cluster, cfg, assignment, model_path, secret)
            await self._wait_created(cluster, [trainer, *servers], cfg.slurm.node_timeout_s)
            for child in servers:
                reg = await _wait_or_fail(
                    procs,
                    registry.wait_for(child.name),
                    cfg.slurm.node_timeout_s,
                    f"{child.name} did not report its address",
                    child,
                )
                child.url = "http://" + reg.address.removeprefix("tcp://")
            if cfg.server.backend == "external":
                await procs.wait_healthy(list(cfg.server.urls), cfg.server.startup_timeout_s, cfg.server.api_key)
                cluster.servers = [ServerHandle(f"server{i}", u.rstrip("/")) for i, u in enumerate(cfg.server.urls)]
            else:
                await procs.wait_healthy(servers, cfg.server.startup_timeout_s, cfg.server.api_key)
                cluster.servers = [ServerHandle(c.name, c.url or "") for c in servers]
            cluster.join = JoinFile(
                join_file(cfg.run_dir),
                api_key=cfg.server.api_key,
                startup_timeout_s=cfg.server.startup_timeout_s,
                exclude=[s.url for s in cluster.servers],
            )
        except BaseException:
            if cluster is not None:
                await cluster.shutdown()
            else:
                await registry.close()
            raise
        return cluster

    @staticmethod
    def _start_trainers(
        cluster: SlurmCluster,
        cfg: RunConfig,
        p: NodeAssignment,
        model_path: str,
        resume: str | None,
        generation: int = 0,
        *,
        secret: bytes,
        remote: bool,
    ) -> Child:
        t, alloc = cfg.train, cluster.alloc
        rdzv: list[str] = []
        if t.nnodes > 1:
            endpoint = t.rdzv.endpoint or (
                f"{p.trainer_nodes[0]}:{rdzv_port(alloc.job_id, alloc.controller_node, p.trainer_nodes[0])}"
            )
            run_id = f"{alloc.job_id}-{cluster.tag}-{generation}"
            rdzv = c10d_args(nnodes=t.nnodes, endpoint=endpoint, run_id=run_id, timeout_s=t.rdzv.timeout_s)
        cmd = trainer_cmd(
            model=model_path,
            nproc=t.nproc,
            config_json=msgspec.json.encode(t).decode(),
            seed=cfg.seed,
            run_dir=cfg.run_dir,
            resume=resume,
            torchrun_args=rdzv,
            rpc_host="0.0.0.0" if remote else "127.0.0.1",
        )
        env = {**thread_env(t.torch_threads), "AREAL_RPC_SECRET": secret.hex()}
        if t.rdzv.discovery == "registry":
            env.update(cluster.registry.env())
        srun = srun_cmd(
            alloc.job_id,
            cluster.step_name("trainer"),
            p.trainer_nodes,
            cpus_per_task=p.cpus_per_trainer_node,
            gpus_per_node=p.gpus_per_trainer_node,
            extra=cfg.slurm.srun_args,
            label=t.nnodes > 1,
        )
        return cluster.processes.spawn("trainer", srun + cmd, env, role="trainer", unset=SRUN_UNSET)

    @staticmethod
    def _start_servers(
        cluster: SlurmCluster, cfg: RunConfig, p: NodeAssignment, model_path: str, secret: bytes
    ) -> list[Child]:
        srv, out = cfg.server, []
        for i, node in enumerate(p.server_nodes):
            port = str(srv.port + i) if srv.port else "{port}"
            if srv.backend == "embedded":
                cmd = embedded_server_cmd(
                    model_path,
                    host=srv.host,
                    port=port,
                    device=srv.device,
                    max_total_tokens=srv.max_total_tokens,
                    max_running_requests=srv.max_running_requests,
                    api_key=srv.api_key,
                    prefix_cache=srv.prefix_cache,
                    dtype=cfg.model.dtype,
                )
            else:
                cmd = sglang_server_cmd(
                    model_path,
                    host=srv.host,
                    port=port,
                    api_key=srv.api_key,
                    extra_args=srv.extra_args,
                    base_gpu_id=0,
                    tp_size=srv.gpus_per_server,
                    dtype=cfg.model.dtype,
                )
            step = [
                sys.executable,
                "-m",
                "areal_async.launch.step",
                "--name",
                f"server{i}",
                "--host",
                srv.host,
                "--port",
                str(srv.port + i if srv.port else 0),
                "--",
            ]
            env = {**thread_env(srv.torch_threads), "AREAL_RPC_SECRET": secret.hex(), **cluster.registry.env()}
            srun = srun_cmd(
                cluster.alloc.job_id,
                cluster.step_name(f"server{i}"),
                [node],
                cpus_per_task=p.cpus_per_server,
                gpus_per_node=p.gpus_per_server,
                extra=cfg.slurm.srun_args,
            )
            out.append(cluster.processes.spawn(f"server{i}", srun + step + cmd, env, role="server", unset=SRUN_UNSET))
        return out

    @staticmethod
    async def _wait_created(
        cluster: SlurmCluster, children: list[Child], timeout_s: float, *, only: bool = False
    ) -> None:
        """Until Slurm lists a step for every child; a child that exits first, or a step not created in time (srun
        keeps retrying while the step's nodes are busy, down or unreachable), fails with srun's log. With `only` (a
        step replaced while the run goes on), other children's exits stay for the watch."""
        deadline = time.monotonic() + timeout_s
        pending = {cluster.step_name(c.name): c for c in children}
        while True:
            for child in [c for c in children if c.proc.poll() is not None] if only else cluster.processes.exited():
                child.reported = True
                raise ChildFailed(child.describe_exit())
            with contextlib.suppress(SlurmError):
                listed = await asyncio.to_thread(list_steps, cluster.alloc.job_id)
                for name in list(pending):
                    if name in listed:
                        log.info("%s runs as Slurm step %s", pending.pop(name).name, listed[name])
            if not pending:
                return
            if time.monotonic() > deadline:
                child = next(iter(pending.values()))
                why = await asyncio.to_thread(describe_steps, cluster.alloc)
                raise ChildFailed(
                    f"{child.name}: Slurm did not create its step within {timeout_s:.0f}s "
                    f"(slurm.node_timeout_s): its nodes are busy, down or not answering; {why}; "
                    f"srun's log ({child.log_path}):\n{tail(child.log_path)}"
                )
            await asyncio.sleep(0.5)


async def _wait_or_fail(procs: Processes, awaitable, timeout_s: float, what: str, child: Child):
    """`awaitable` within `timeout_s`, failing fast (with the log tail) when any child exits meanwhile."""
    task = asyncio.ensure_future(awaitable)
    deadline = time.monotonic() + timeout_s
    try:
        while not task.done():
            for c in procs.exited():
                raise ChildFailed(c.describe_exit())
            if time.monotonic() > deadline:
                raise ChildFailed(
                    f"{what} within {timeout_s:.0f}s; log tail ({child.log_path}):\n{tail(child.log_path)}"
                )
            await asyncio.wait({task}, timeout=0.2)
        return task.result()
    finally:
        task.cancel()


def _node_address(node: str) -> str:
    try:
        return socket.gethostbyname(node)
    except OSError:
        return node

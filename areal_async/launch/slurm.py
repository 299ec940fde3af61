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

Replacing steps mid-run (the recovery policy's side, launch/recovery.py): a failed trainer step is cancelled and
started again on the same nodes, or on the nodes left when one went away (`restart_trainers`); a dead or hung server
step is cancelled and started again on its node (`restart_server`), or, when that node went away, on another node of
the allocation with room for it (launch/node_assignment.py `node_for_server`). The command lines of the steps are
launch/slurm_steps.py's.

The allocation itself and the Slurm client commands are in launch/slurm_allocation.py; their names, and those of
launch/node_assignment.py, are re-exported here (`__all__`), where launch/sbatch.py and the tests import them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from areal_async.launch.api import EventHandler, ProcessExited, ServerHandle, ServerJoined, TrainerHandle
from areal_async.launch.membership import JoinFile, join_file
from areal_async.launch.node_assignment import NodeAssignment, check_allocation, job_nodes, node_for_server, place
from areal_async.launch.processes import Child, ChildFailed, Processes, tail
from areal_async.launch.shrink import Shrink, TrainerLayout, hosts_left, not_shrinking_why
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
from areal_async.launch.slurm_steps import (
    SRUN_UNSET,
    node_address,
    rdzv_port,
    srun_cmd,
    start_server_step,
    start_trainer_step,
    wait_or_fail,
)
from areal_async.net.rank_registry import Registry, rank_file, route_address

if TYPE_CHECKING:
    from areal_async.config import RunConfig

# re-exported from launch/slurm_allocation.py, launch/node_assignment.py and launch/slurm_steps.py: launch/sbatch.py
# and the tests import them from here
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

_RECANCEL_S = 10.0  # a step still listed after scancel is sent it again this often (see SlurmCluster._end_step)


class NodeLost(NotImplementedError):
    """A trainer node went away and the job cannot shrink to the nodes left (recovery.shrink_trainers=false, none
    left, or the lost node not known): no new step on the same nodes fits (Slurm keeps the node's part of the old
    one), so the run stops with its last checkpoint (session/rollback.py). The message names the node."""


class SlurmCluster:
    """srun children of this controller, one per step; watched by polling like LocalCluster. A failed trainer step
    is replaced (`restart_trainers`: on the same nodes, or on the nodes left when one went away); a dead or hung
    server step is replaced on its node, or on another with room when its node went away (`restart_server`,
    announced by `watch` as `ServerJoined` under its old name)."""

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
        self.start_trainers: Callable[..., Child] | None = None  # (resume, generation, nodes=, overlap=): by launch
        self.shrink_trainers = True  # recovery.shrink_trainers: a lost trainer node shrinks the job (launch/shrink.py)
        self.trainer_nproc = 1  # train.nproc
        self.last_shrink: Shrink | None = None  # what the last restart_trainers shrank, for the record
        self._overlap_trainers = False  # a trainer step was left on a lost node: later ones need srun --overlap
        self.start_server: Callable[[int, str], Child] | None = None  # (index, node); None: servers not ours
        self.room_for_server: Callable[[int, list[str], set[str]], str | None] | None = None  # (index, nodes, lost)
        self.trainer_nodes: list[str] = []
        self.server_nodes: list[str] = []  # the node each launched server's step runs on now
        self.node_timeout_s = 120.0
        self.startup_timeout_s = 120.0  # server.startup_timeout_s
        self.api_key: str | None = None  # server.api_key, for /health
        self.nodes_at_start: dict[str, NodeHealth] = {}  # the run's nodes as they were when it launched
        self._generation = 0  # trainer steps started so far, minus one
        self._joined: list[ServerJoined] = []  # restarted servers, announced by the watch
        self._where: dict[str, str] = {}  # server -> where its last restart put it, and why there
        self._step_gen: dict[str, int] = {}  # server -> how often its step was replaced
        self._cancelled: dict[str, float] = {}  # step id -> when it was last sent scancel (monotonic)
        self._abandoned: set[str] = set()  # step ids left behind on nodes that went away

    @property
    def trainers(self) -> TrainerHandle:
        """Rank 0's reported address is where servers reach it for a weight broadcast (known once it reports)."""
        world_size, secret, rank_dir, master = self._trainers
        rank0 = self.registry.entries.get("rank0")
        if rank0 is not None:
            master = rank0.address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        return TrainerHandle(world_size=world_size, rendezvous_dir=rank_dir, secret=secret, master_address=master)

    def step_name(self, name: str) -> str:
        """The Slurm step name of part `name` now: a replaced server's new step is `<name>.<k>`, so that it is never
        mistaken for an old one Slurm still lists (on a node that went away)."""
        k = self._step_gen.get(name, 0)
        return f"areal.{self.tag}.{name}{f'.{k}' if k else ''}"

    def _child(self, name: str) -> Child | None:
        return next((c for c in reversed(self.processes.children) if c.name == name), None)

    # ---- ending a step (both restarts) ---------------------------------------------------------------------------

    async def _end_step(self, name: str, nodes: list[str], flags: list[str]) -> tuple[str | None, dict[str, str]]:
        """Cancel step `name` (scancel `flags`) and wait until Slurm no longer lists it, so that its CPUs are free
        again. Returns (None, {}) once it is gone; (its id, {node: why}) when one of `nodes` went away meanwhile
        (Slurm keeps that node's part of the step, which no scancel ends); (its id, {}) when it is still listed
        after `slurm.node_timeout_s`."""
        step = self.step_name(name)
        deadline = time.monotonic() + self.node_timeout_s
        while True:
            listed = await asyncio.to_thread(steps_or_none, self.alloc.job_id)
            sid = None if listed is None else listed.get(step)
            if listed is not None and sid is None:
                return None, {}
            # again every _RECANCEL_S while it is listed: slurmctld flags a node that went away when a message to it
            # fails, not at once (measured on two nodes: one scancel, no flag within 60 s; two, flagged in 24 s)
            if sid is not None and time.monotonic() - self._cancelled.get(sid, -_RECANCEL_S) >= _RECANCEL_S:
                await self._scancel(flags, [sid])
                self._cancelled[sid] = time.monotonic()
            lost = await asyncio.to_thread(self._lost, nodes) if sid is not None else {}
            if lost or time.monotonic() > deadline:
                return sid or step, lost
            await asyncio.sleep(1.0)

    def _lost(self, nodes: list[str]) -> dict[str, str]:
        """Which of `nodes` went away since the launch (node -> why; see slurm_allocation.lost_nodes)."""
        return lost_nodes(self.nodes_at_start, node_health(nodes))

    # ---- replacing the trainer step (the recovery policy's side, launch/recovery.py) ----------------------------

    @property
    def can_restart_trainers(self) -> bool:
        """Whether a failed trainer step is replaced (it is when this cluster started it): a restart is tried, and
        may still end in `NodeLost`."""
        return self.start_trainers is not None

    def why_trainers_cannot_restart(self) -> str:
        return "this cluster did not start the trainer step, so it cannot start it again"

    def trainer_pids(self) -> set[int]:
        """The srun process of the current trainer step."""
        return {c.proc.pid for c in self.processes.children if c.role == "trainer" and not c.expected_exit}

    def lost_trainer_nodes(self) -> dict[str, str]:
        """Trainer nodes that went away since the launch (node -> why; see slurm_allocation.lost_nodes)."""
        return self._lost(self.trainer_nodes)

    def trainer_layout(self) -> TrainerLayout:
        return TrainerLayout(tuple(self.trainer_nodes), self.trainer_nproc)

    async def restart_trainers(self, resume: str | None) -> TrainerHandle:
        """Replace the trainer step: cancel the old one, wait until Slurm no longer lists it (its CPUs are then free
        again), forget its ranks, start a new step on the same nodes from trainer checkpoint `resume` (None: the base
        model). When a trainer node went away, the new step runs on the nodes left instead (launch/shrink.py;
        `last_shrink` says so), with srun --overlap: while Slurm lists the old step it counts its CPUs on the nodes
        left too (docs/cluster.md, measured). Raises `NodeLost` when it cannot shrink, `ChildFailed` when the new
        step is not created in `slurm.node_timeout_s`."""
        if self.start_trainers is None:
            raise NotImplementedError(self.why_trainers_cannot_restart())
        self.last_shrink = None
        for old in self.processes.children:
            if old.role == "trainer":
                old.expected_exit = True  # its srun ends on the scancel below: no event for that
        before = self.trainer_layout()
        sid, lost = await self._end_step("trainer", self.trainer_nodes, [])
        if sid is None:  # ended, yet a node that lost power takes its part of the step along
            lost = await asyncio.to_thread(self.lost_trainer_nodes)
        left = hosts_left(self.trainer_nodes, lost, enabled=self.shrink_trainers)
        if sid is not None and left is None:
            why = not_shrinking_why(self.trainer_nodes, lost, enabled=self.shrink_trainers)
            raise NodeLost(f"{node_lost_message(sid, lost, self.trainer_nodes, self.node_timeout_s)} ({why})")
        for old in [c for c in self.processes.children if c.role == "trainer"]:
            await asyncio.to_thread(self.processes.stop, old, 5.0)
        for name in [n for n, reg in self.registry.entries.items() if reg.kind == "rank"]:
            self.registry.entries.pop(name)
            with contextlib.suppress(OSError):
                os.remove(rank_file(self.registry.rank_dir, int(name.removeprefix("rank"))))
        if left is not None:
            if sid is not None:
                self._abandoned.add(sid)
                self._overlap_trainers = True
            self._step_gen["trainer"] = self._step_gen.get("trainer", 0) + 1  # never the old step's name
            self.trainer_nodes = left
            world_size, secret, rank_dir, master = self._trainers
            self._trainers = (len(left) * self.trainer_nproc, secret, rank_dir, master)
            self.last_shrink = Shrink(before, self.trainer_layout(), {n: lost[n] for n in before.nodes if n in lost})
            log.warning("%s", self.last_shrink.describe())
        self._generation += 1
        child = self.start_trainers(
            resume, self._generation, nodes=list(self.trainer_nodes), overlap=self._overlap_trainers
        )
        await _wait_created(self, [child], self.node_timeout_s, only=True)
        return self.trainers

    # ---- replacing a server step ---------------------------------------------------------------------------------

    @property
    def can_restart_servers(self) -> bool:
        return self.start_server is not None

    def server_alive(self, name: str) -> bool:
        """Its srun still runs (a hung server's does; a lost node's may, until Slurm gives up on the node)."""
        child = self._child(name)
        return child is not None and child.proc.poll() is None

    def server_where(self, name: str) -> str:
        """Where server `name`'s current step runs, and, after a move, which node went away: for the record."""
        return self._where.get(name, "")

    async def stop_server(self, name: str) -> None:
        """Kill a server step that is alive but unwell (scancel --signal=KILL: a hung one may be SIGSTOPped); its
        srun's exit is no event. `restart_server` then waits until Slurm no longer lists the step."""
        child = self._child(name)
        if child is not None:
            child.expected_exit = True
        with contextlib.suppress(SlurmError):
            sid = (await asyncio.to_thread(list_steps, self.alloc.job_id)).get(self.step_name(name))
            if sid is not None:
                await self._scancel(["--signal=KILL"], [sid])
                self._cancelled[sid] = time.monotonic()

    async def restart_server(self, name: str) -> ServerHandle:
        """Replace server `name`'s step: cancel the old one (if Slurm still lists it) and wait until it is gone,
        then start a new step on the same node, or, when that node went away (its slurmd silent or restarted),
        on another node of the allocation with room for it, and return once the new server answers /health
        (`ServerJoined` follows from `watch`; the recovery policy loads the current weights into it before it
        serves). Raises `ChildFailed`, naming the node, when the old step cannot end and no node has room, or
        when the new step is not created in `slurm.node_timeout_s` or not healthy in `server.startup_timeout_s`:
        the policy tries again within `recovery.max_server_restarts`."""
        if self.start_server is None:
            raise NotImplementedError(f"{name} was not started by this cluster: it cannot be restarted")
        index = next((i for i, s in enumerate(self.servers) if s.name == name), None)
        if index is None:
            raise KeyError(f"unknown server {name!r}")
        node = self.server_nodes[index]
        old = self._child(name)
        if old is not None:
            old.expected_exit = True  # its srun ends with its step: no event for that
        sid, lost = await self._end_step(name, [node], ["--signal=KILL"])
        if old is not None:
            await asyncio.to_thread(self.processes.stop, old, 0)
        if sid is None:  # the step ended; its node may still be gone (a node that lost power takes its steps along)
            lost = await asyncio.to_thread(self._lost, [node])
        moved = ""
        if sid is not None or lost:
            why = "; ".join(f"node {n} went away ({w})" for n, w in lost.items()) or (
                f"its step {sid} is still listed {self.node_timeout_s:.0f}s after scancel (slurm.node_timeout_s): "
                f"node {node} does not end it (slurmctld flags a silent node only at its next ping of it)"
            )
            rest = [n for n in self.nodes_at_start if n != node]  # the run's other nodes
            others = await asyncio.to_thread(self._lost, rest) if rest else {}
            target = (
                None
                if self.room_for_server is None
                else self.room_for_server(index, self.server_nodes, {node, *others})
            )
            if target is None:
                raise ChildFailed(
                    f"{name} cannot start again in job {self.alloc.job_id}: {why}, and no other node of the job has "
                    f"room for a server step (CPUs and GPUs beside the steps there); resubmit the run once the node "
                    f"is back, or leave it to the other servers"
                )
            if sid is not None:
                self._abandoned.add(sid)
            moved = f", moved from {node}: {why}"
            log.warning("%s moves from node %s to node %s: %s", name, node, target, why)
            node = target
        self.registry.entries.pop(name, None)
        self._step_gen[name] = self._step_gen.get(name, 0) + 1
        child = self.start_server(index, node)
        try:
            await _wait_created(self, [child], self.node_timeout_s, only=True)
            reg = await wait_or_fail(
                self.registry.wait_for(name),
                self.node_timeout_s,
                f"{name} did not report its address",
                child,
                exited=lambda: [child] if child.proc.poll() is not None else [],
            )
            child.url = "http://" + reg.address.removeprefix("tcp://")
            await self.processes.wait_healthy([child], self.startup_timeout_s, self.api_key, only=True)
        except BaseException:
            child.expected_exit = True
            with contextlib.suppress(SlurmError):
                sid = (await asyncio.to_thread(list_steps, self.alloc.job_id)).get(self.step_name(name))
                if sid is not None:
                    await self._scancel(["--signal=KILL"], [sid])
            await asyncio.to_thread(self.processes.stop, child, 0)
            raise
        self.server_nodes[index] = node
        handle = ServerHandle(name, child.url or "")
        self.servers[index] = handle
        self._where[name] = f"on node {node} (Slurm step {reg.slurm_step or '?'}){moved}"
        self._joined.append(ServerJoined(name, handle.url))
        return handle

    # ---- watching and teardown -----------------------------------------------------------------------------------

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
            while self._joined:
                await on_event(self._joined.pop(0))
            if self.join is not None:
                for event in await self.join.poll():
                    await on_event(event)
            await asyncio.sleep(self.poll_s)

    def _our_steps(self) -> dict[str, str]:
        """Our steps Slurm lists, less those left on nodes that went away (no scancel ends them: waiting on them
        would only hold up the teardown)."""
        prefix = self.step_name("")
        listed = list_steps(self.alloc.job_id).items()
        return {name: sid for name, sid in listed if name.startswith(prefix) and sid not in self._abandoned}

    async def shutdown(self, grace_s: float = 15.0) -> None:
        """SIGTERM every step we created (scancel --signal=TERM: servers and trainers shut down cleanly) and every
        srun still waiting for its step to be created; give them `grace_s`, then cancel what is left (scancel:
        SIGKILL) and kill the srun processes; wait, bounded, until Slurm lists none of our steps."""
        if self._closed:
            return
        self._closed = True
        await self._abandon_lost_servers()
        if self._abandoned:
            log.warning(
                "steps left on nodes that went away: %s (Slurm ends them once the node answers or is marked down)",
                " ".join(sorted(self._abandoned)),
            )
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

    async def _abandon_lost_servers(self) -> None:
        """Server steps still on a node that went away (not yet moved by the policy) are left to Slurm like the
        steps a restart left there, and their srun is stopped: no scancel ends them, so waiting on them would only
        hold up the teardown (measured: 35 s)."""
        gone = await asyncio.to_thread(self._lost, self.server_nodes) if self.server_nodes else {}
        if not gone:
            return
        with contextlib.suppress(SlurmError):
            listed = await asyncio.to_thread(list_steps, self.alloc.job_id)
            for server, node in zip(self.servers, self.server_nodes):
                sid = listed.get(self.step_name(server.name))
                child = self._child(server.name)
                if node in gone and sid is not None and child is not None:
                    self._abandoned.add(sid)
                    child.expected_exit = True
                    await asyncio.to_thread(self.processes.stop, child, 0)

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
        advertise = cfg.slurm.controller_address or (route_address(node_address(others[0])) if others else None)
        await registry.start("0.0.0.0" if remote else "127.0.0.1", advertise)
        procs = Processes(cfg.run_dir)
        tag = secrets.token_hex(3)
        cluster: SlurmCluster | None = None
        try:
            world = cfg.train.nnodes * cfg.train.nproc
            cluster = SlurmCluster(
                alloc, procs, registry, tag, [], world, secret, cfg.run_dir, node_address(assignment.trainer_nodes[0])
            )
            trainer = start_trainer_step(
                cluster, cfg, assignment, model_path, trainer_resume, secret=secret, remote=remote
            )
            cluster.start_trainers = functools.partial(
                start_trainer_step, cluster, cfg, assignment, model_path, secret=secret, remote=remote
            )
            cluster.trainer_nodes = list(assignment.trainer_nodes)
            cluster.shrink_trainers, cluster.trainer_nproc = cfg.recovery.shrink_trainers, cfg.train.nproc
            cluster.node_timeout_s = cfg.slurm.node_timeout_s
            cluster.startup_timeout_s, cluster.api_key = cfg.server.startup_timeout_s, cfg.server.api_key
            cluster.nodes_at_start = await asyncio.to_thread(node_health, assignment.nodes)
            servers = self._start_servers(cluster, cfg, assignment, model_path, secret)
            await _wait_created(cluster, [trainer, *servers], cfg.slurm.node_timeout_s)
            for child in servers:
                reg = await wait_or_fail(
                    registry.wait_for(child.name),
                    cfg.slurm.node_timeout_s,
                    f"{child.name} did not report its address",
                    child,
                    exited=procs.exited,
                )
                child.url = "http://" + reg.address.removeprefix("tcp://")
            if cfg.server.backend == "external":
                await procs.wait_healthy(list(cfg.server.urls), cfg.server.startup_timeout_s, cfg.server.api_key)
                cluster.servers = [ServerHandle(f"server{i}", u.rstrip("/")) for i, u in enumerate(cfg.server.urls)]
            else:
                await procs.wait_healthy(servers, cfg.server.startup_timeout_s, cfg.server.api_key)
                cluster.servers = [ServerHandle(c.name, c.url or "") for c in servers]
                cluster.server_nodes = list(assignment.server_nodes)
                cluster.start_server = functools.partial(
                    start_server_step, cluster, cfg, assignment, model_path, secret
                )
                cluster.room_for_server = functools.partial(
                    node_for_server,
                    assignment,
                    alloc,
                    gpus_per_node=cfg.slurm.gpus_per_node,
                    servers_apart=cfg.slurm.servers_apart,
                )
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
    def _start_servers(
        cluster: SlurmCluster, cfg: RunConfig, p: NodeAssignment, model_path: str, secret: bytes
    ) -> list[Child]:
        return [
            start_server_step(cluster, cfg, p, model_path, secret, i, node) for i, node in enumerate(p.server_nodes)
        ]


async def _wait_created(cluster: SlurmCluster, children: list[Child], timeout_s: float, *, only: bool = False) -> None:
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

"""The running side of launcher=ray: `RayCluster`, the `Cluster` (launch/api.py) of a run whose servers and torchrun
agents run on a Ray cluster's nodes, each started and watched by a `NodeProcesses` actor (launch/ray_actor.py)
placed in a placement-group bundle (launch/ray_placement.py).

    servers:  one placement group of num_servers bundles (SPREAD), an actor per bundle, a server per actor
    trainers: one placement group of train.nnodes bundles (STRICT_SPREAD), an actor per bundle, a torchrun agent
              per actor; the agents meet at a c10d store on the first one's node, the ranks report to the
              controller's registry (net/rank_registry.py), as under Slurm

Failures, through the same protocol as the other launchers (launch/recovery.py drives them):
- a process that exits is reported by its actor (`wait`) as `ProcessExited`, with its log tail; an actor that
  dies (its node lost, its worker killed) is reported the same way, naming the node and what Ray says of it;
- `restart_server` starts the server again through its actor, or, when the actor is gone, through a new actor in
  the same bundle: Ray moves a lost node's bundles to a node with room, so the server comes back elsewhere
  (`server_where` says where and why);
- `restart_trainers` starts the trainer job again from a checkpoint on the same bundles, or, when a trainer node
  was lost, in a new group: of the whole size when Ray finds another node within ray.regrow_timeout_s, else of the
  nodes left (recovery.shrink_trainers, launch/shrink.py), else `RayNodeLost` stops the run with its checkpoint.

Teardown (`shutdown`: the run's end, an error, Ctrl-C) stops every child through its actor, kills the actors,
removes the placement groups and disconnects from Ray (stopping a head started for the run). A controller killed
outright leaves the same to Ray: a driver's actors and placement groups end with it, and the children's
PR_SET_PDEATHSIG ends them with their actor. No torch here; Ray is imported by the launcher that makes this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from areal_async.launch.api import EventHandler, ProcessExited, ServerHandle, ServerJoined, TrainerHandle
from areal_async.launch.membership import JoinFile
from areal_async.launch.processes import ChildFailed
from areal_async.launch.ray_placement import RayNode
from areal_async.launch.shrink import Shrink, TrainerLayout
from areal_async.net.rank_registry import Registry, rank_file

__all__ = ["RayCluster", "RayNodeLost", "RayParts"]

log = logging.getLogger(__name__)


class RayNodeLost(NotImplementedError):
    """A trainer node was lost and the job can neither regrow nor shrink (recovery.shrink_trainers=false, no node
    left): the run stops with its last checkpoint (run_rollback.py). The message names the node."""


@dataclass
class _Proc:
    """A process one of our actors started: what the watch and the restarts need of it."""

    name: str
    role: str  # "server" | "trainer"
    node: RayNode
    pid: int
    log_path: str
    done: asyncio.Future  # the actor's `wait`: resolves when the process exits, fails when the actor dies
    url: str | None = None
    expected: bool = False  # asked to stop: its exit is no event
    reported: bool = False


@dataclass
class RayParts:
    """How the cluster makes what it restarts (set by launch/ray_launcher.py): Ray itself, behind functions."""

    new_group: Callable[[list[dict[str, float]], str], Any]  # (bundles, strategy) -> placement group
    ready: Callable[[Any, float], Any]  # (group, timeout_s) -> awaitable of bool
    remove_group: Callable[[Any], None]
    new_actor: Callable[[Any, int, dict[str, float]], Any]  # (group, bundle index, bundle) -> actor handle
    kill_actor: Callable[[Any], None]
    node_state: Callable[[str], str | None]  # node id -> None while alive, else why it is not (blocking)
    future: Callable[[Any], asyncio.Future]  # object ref -> asyncio future
    disconnect: Callable[[], None]  # blocking


class RayCluster:
    """See the module docstring. Made by `RayLauncher.launch`, which fills in the groups, actors and processes."""

    def __init__(self, cfg: Any, parts: RayParts, registry: Registry, secret: bytes, model_path: str) -> None:
        self.cfg = cfg
        self.parts = parts
        self.registry = registry
        self.secret = secret
        self.model_path = model_path
        self.poll_s = 0.5
        self.servers: list[ServerHandle] = []
        self.join: JoinFile | None = None
        self.server_group: Any = None
        self.server_actors: list[tuple[Any, RayNode]] = []
        self.trainer_group: Any = None
        self.trainer_actors: list[tuple[Any, RayNode]] = []
        self.trainer_bundle: dict[str, float] = {}
        self.server_bundle: dict[str, float] = {}
        self.procs: dict[str, _Proc] = {}
        self.last_shrink: Shrink | None = None
        self.start_trainer_job: Callable[..., Any] | None = None  # (resume, generation) -> awaitable, by the launcher
        self.start_server_on: Callable[..., Any] | None = None  # (index, actor, node, port) -> awaitable _Proc
        self._trainer_world = cfg.train.nnodes * cfg.train.nproc
        self._generation = 0
        self._joined: list[ServerJoined] = []
        self._where: dict[str, str] = {}
        self._fresh_port: set[str] = set()
        self._closed = False

    # ---- what the run reads -------------------------------------------------------------------------------------

    @property
    def trainers(self) -> TrainerHandle:
        """Rank 0's reported address is where servers reach it for a weight broadcast (known once it reports)."""
        master = self.trainer_actors[0][1].ip if self.trainer_actors else "127.0.0.1"
        rank0 = self.registry.entries.get("rank0")
        if rank0 is not None:
            master = rank0.address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
        return TrainerHandle(
            world_size=self._trainer_world, rendezvous_dir=self.cfg.run_dir, secret=self.secret, master_address=master
        )

    def trainer_layout(self) -> TrainerLayout:
        return TrainerLayout(tuple(n.hostname for _, n in self.trainer_actors), self.cfg.train.nproc)

    def trainer_pids(self) -> set[int]:
        """The current trainer job's agents (pids on their own nodes)."""
        return {p.pid for p in self.procs.values() if p.role == "trainer" and not p.expected}

    def server_alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and not p.done.done()

    def server_where(self, name: str) -> str:
        return self._where.get(name, "")

    @property
    def can_restart_servers(self) -> bool:
        return self.start_server_on is not None

    @property
    def can_restart_trainers(self) -> bool:
        return self.start_trainer_job is not None

    def why_trainers_cannot_restart(self) -> str:
        return "this cluster did not start the trainer job, so it cannot start it again"

    # ---- the watch ----------------------------------------------------------------------------------------------

    def add(self, proc: _Proc) -> None:
        self.procs[proc.name] = proc

    async def _exit_event(self, p: _Proc) -> ProcessExited:
        exc = p.done.exception()
        if exc is None:
            res = p.done.result()
            code, text = res.get("exit_code"), res.get("log_tail", "")
        else:
            state = await asyncio.to_thread(self.parts.node_state, p.node.node_id)
            node = f"node {p.node.describe()} {'is ' + state if state else 'is alive'}"
            code, text = None, f"the Ray actor that ran it is gone ({type(exc).__name__}: {str(exc)[:300]}); {node}"
        return ProcessExited(
            role="server" if p.role == "server" else "trainer",
            name=p.name,
            exit_code=code,
            log_path=f"{p.log_path} on {p.node.describe()}",
            log_tail=text,
            url=p.url,
            pid=p.pid,
        )

    async def watch(self, on_event: EventHandler) -> None:
        while True:
            for p in list(self.procs.values()):
                if p.done.done() and not p.reported and not p.expected:
                    p.reported = True
                    await on_event(await self._exit_event(p))
            while self._joined:
                await on_event(self._joined.pop(0))
            if self.join is not None:
                for event in await self.join.poll():
                    await on_event(event)
            await asyncio.sleep(self.poll_s)

    async def wait_healthy(self, procs: list[_Proc], timeout_s: float, *, only: bool = False) -> None:
        """Until every server in `procs` answers /health from here; fails fast, with the log tail, when any of our
        processes ends meanwhile (only those in `procs` with `only`: a restart mid-run leaves the rest to the watch)."""
        deadline = time.monotonic() + timeout_s
        api_key = self.cfg.server.api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        pending = [p for p in procs if p.role == "server"]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while pending:
                for p in procs if only else list(self.procs.values()):
                    if p.done.done() and not p.expected:
                        p.reported = True
                        raise ChildFailed((await self._exit_event(p)).describe())
                for p in list(pending):
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        async with http.get(f"{p.url}/health", headers=headers) as r:
                            if r.status == 200:
                                pending.remove(p)
                                log.info("%s healthy at %s (node %s)", p.name, p.url, p.node.describe())
                if pending and time.monotonic() > deadline:
                    p = pending[0]
                    raise ChildFailed(
                        f"{p.name} on {p.node.describe()} not healthy at {p.url} after {timeout_s:.0f}s "
                        f"(server.startup_timeout_s); its log: {p.log_path} there"
                    )
                if pending:
                    await asyncio.sleep(0.2)

    # ---- probing actors and nodes -------------------------------------------------------------------------------

    async def _answers(self, actor: Any, timeout_s: float) -> bool:
        """Whether `actor` answers within `timeout_s` (an actor on a lost node never does)."""
        try:
            await asyncio.wait_for(self.parts.future(actor.node.remote()), timeout_s)
            return True
        except Exception:  # RayActorError and kin, or the timeout
            return False

    async def _lost_why(self, node: RayNode, timeout_s: float) -> str | None:
        """Why `node` counts as lost (Ray lists it dead, within `timeout_s`), or None when Ray keeps it alive."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = await asyncio.to_thread(self.parts.node_state, node.node_id)
            if state is not None:
                return state
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.5)

    async def _placed(self, actor: Any, timeout_s: float, what: str) -> RayNode:
        """The node a new actor was placed on, once it runs; ChildFailed naming `what` when Ray does not place it
        within `timeout_s` (no node has room for its bundle)."""
        try:
            info = await asyncio.wait_for(self.parts.future(actor.node.remote()), timeout_s)
        except TimeoutError:
            self.parts.kill_actor(actor)
            raise ChildFailed(
                f"{what}: Ray placed no actor within {timeout_s:.0f}s (ray.placement_timeout_s): no node of the "
                "cluster has room for its bundle"
            ) from None
        return RayNode(info["node_id"], info["ip"], info["hostname"])

    # ---- servers ------------------------------------------------------------------------------------------------

    async def stop_server(self, name: str) -> None:
        """Kill a server that is alive but unwell (SIGKILL: a hung one may be stopped); its exit is no event."""
        p = self.procs.get(name)
        if p is None:
            return
        p.expected = True
        index = int(name.removeprefix("server"))
        actor = self.server_actors[index][0]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.parts.future(actor.stop.remote(p.pid, 0.0)), self.cfg.ray.node_timeout_s)

    async def restart_server(self, name: str) -> ServerHandle:
        """Start server `name` again through its actor (on its old port when it can); when the actor is gone, a new
        actor in the same bundle, which Ray moves off a lost node to one with room. Returns once the new server
        answers /health; `ServerJoined` follows from `watch`, and the recovery policy then loads the current
        weights into it. Raises ChildFailed when it cannot start, is not placed, or stays unhealthy."""
        if self.start_server_on is None:
            raise NotImplementedError(f"{name} was not started by this cluster: it cannot be restarted")
        index = next((i for i, s in enumerate(self.servers) if s.name == name), None)
        if index is None:
            raise KeyError(f"unknown server {name!r}")
        r = self.cfg.ray
        actor, node = self.server_actors[index]
        old = self.procs.get(name)
        if old is not None:
            old.expected = True
        moved = ""
        port = 0
        if await self._answers(actor, r.node_timeout_s):
            if old is not None:
                await self.parts.future(actor.stop.remote(old.pid, 0.0))
            if name not in self._fresh_port and old is not None and old.url:
                port = int(old.url.rsplit(":", 1)[1])
        else:
            self.parts.kill_actor(actor)
            why = await self._lost_why(node, r.node_timeout_s)
            actor = self.parts.new_actor(self.server_group, index, self.server_bundle)
            new_node = await self._placed(
                actor, r.placement_timeout_s, f"{name} (its node {node.describe()} {why or 'answers no more'})"
            )
            if new_node.node_id != node.node_id:
                moved = f", moved from {node.describe()}: {why or 'its actor answers no more'}"
                log.warning("%s moves from %s to %s: %s", name, node.describe(), new_node.describe(), why)
            node = new_node
            self.server_actors[index] = (actor, node)
        try:
            proc = await self.start_server_on(index, actor, node, port)
            self.add(proc)
            await self.wait_healthy([proc], self.cfg.server.startup_timeout_s, only=True)
        except BaseException:
            self._fresh_port.add(name)
            if name in self.procs:
                self.procs[name].expected = True
                with contextlib.suppress(Exception):
                    await self.parts.future(actor.stop.remote(self.procs[name].pid, 0.0))
            raise
        self._fresh_port.discard(name)
        handle = ServerHandle(name, proc.url or "")
        self.servers[index] = handle
        self._where[name] = f"on {node.describe()}{moved}"
        self._joined.append(ServerJoined(name, handle.url))
        return handle

    # ---- trainers -----------------------------------------------------------------------------------------------

    async def _stop_trainers(self) -> dict[int, RayNode]:
        """Stop the trainer job's agents through their actors; the bundles whose actor answers no more, by index."""
        gone: dict[int, RayNode] = {}
        r = self.cfg.ray
        olds = [p for p in self.procs.values() if p.role == "trainer"]
        for p in olds:
            p.expected = True

        async def stop_one(k: int, actor: Any, node: RayNode) -> None:
            if not await self._answers(actor, r.node_timeout_s):
                gone[k] = node
                return
            for p in olds:
                if p.node.node_id == node.node_id:
                    with contextlib.suppress(Exception):
                        await self.parts.future(actor.stop.remote(p.pid, 10.0))

        await asyncio.gather(*(stop_one(k, a, n) for k, (a, n) in enumerate(self.trainer_actors)))
        for p in olds:
            self.procs.pop(p.name, None)
        return gone

    def _forget_ranks(self) -> None:
        for name in [n for n, reg in self.registry.entries.items() if reg.kind == "rank"]:
            self.registry.entries.pop(name)
            with contextlib.suppress(OSError):
                os.remove(rank_file(self.registry.rank_dir, int(name.removeprefix("rank"))))

    async def place_trainers(self, nnodes: int, timeout_s: float) -> bool:
        """A new trainer group of `nnodes` bundles and an actor in each; False (nothing left) when Ray does not
        place the group within `timeout_s`."""
        strategy = "STRICT_SPREAD" if nnodes > 1 else "PACK"
        group = self.parts.new_group([dict(self.trainer_bundle) for _ in range(nnodes)], strategy)
        if not await self.parts.ready(group, timeout_s):
            self.parts.remove_group(group)
            return False
        actors = [self.parts.new_actor(group, k, self.trainer_bundle) for k in range(nnodes)]
        timeout = self.cfg.ray.placement_timeout_s
        nodes = await asyncio.gather(*(self._placed(a, timeout, f"trainer agent {k}") for k, a in enumerate(actors)))
        self.trainer_group, self.trainer_actors = group, list(zip(actors, nodes))
        self._trainer_world = nnodes * self.cfg.train.nproc
        return True

    async def restart_trainers(self, resume: str | None) -> TrainerHandle:
        """Replace the trainer job from trainer checkpoint `resume` (None: the base model): stop its agents, forget
        its ranks, start new agents on the same bundles. When a trainer node was lost, a new group instead: of the
        whole size if Ray places it within ray.regrow_timeout_s (another node took the lost one's place), else of
        the nodes left (`last_shrink` says so). Raises `RayNodeLost` when it can do neither."""
        if self.start_trainer_job is None:
            raise NotImplementedError(self.why_trainers_cannot_restart())
        r = self.cfg.ray
        self.last_shrink = None
        before = self.trainer_layout()
        gone = await self._stop_trainers()
        self._forget_ranks()
        if gone:
            lost: dict[str, str] = {}
            for node in gone.values():
                why = await self._lost_why(node, r.node_timeout_s)
                lost[node.hostname] = (
                    why or f"its actor did not answer within {r.node_timeout_s:.0f}s (ray.node_timeout_s)"
                )
            states = [await asyncio.to_thread(self.parts.node_state, n.node_id) for n in gone.values()]
            if any(state is None for state in states):
                raise RayNodeLost(
                    "trainer node(s) " + ", ".join(n.describe() for n in gone.values()) + " answer no more, yet Ray "
                    f"lists them alive after ray.node_timeout_s={r.node_timeout_s:g}: a new job could be placed there"
                )
            for actor, _ in self.trainer_actors:
                self.parts.kill_actor(actor)
            self.parts.remove_group(self.trainer_group)
            self.trainer_actors = []
            left = len(before.nodes) - len(gone)
            if await self.place_trainers(len(before.nodes), r.regrow_timeout_s):
                log.warning(
                    "trainer node(s) lost (%s); Ray placed the whole job again: %s",
                    lost,
                    self.trainer_layout().describe(),
                )
            elif not self.cfg.recovery.shrink_trainers or left < 1:
                why = "recovery.shrink_trainers=false" if left >= 1 else "no trainer node is left"
                raise RayNodeLost(
                    "trainer node(s) lost: " + "; ".join(f"{h}: {w}" for h, w in lost.items()) + f"; no other node "
                    f"took their place within ray.regrow_timeout_s={r.regrow_timeout_s:g}, and the job does not "
                    f"shrink ({why})"
                )
            else:
                if not await self.place_trainers(left, r.placement_timeout_s):
                    raise ChildFailed(
                        f"the trainer job of the {left} node(s) left was not placed within ray.placement_timeout_s"
                    )
                self.last_shrink = Shrink(before, self.trainer_layout(), lost)
                log.warning("%s", self.last_shrink.describe())
        self._generation += 1
        await self.start_trainer_job(resume, self._generation)
        return self.trainers

    # ---- teardown -----------------------------------------------------------------------------------------------

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Stop every child through its actor (the trainers get a few seconds to exit by themselves first: their
        ranks took the run's shutdown RPC when it ended normally), kill the actors, remove the placement groups,
        close the registry and disconnect from Ray. Bounded: an actor on a lost node is not waited for."""
        if self._closed:
            return
        self._closed = True
        for p in self.procs.values():
            p.expected = True
        actors = [a for a, _ in self.server_actors + self.trainer_actors]
        stops = [self.parts.future(a.shutdown.remote(grace_s, 3.0)) for a in actors]
        if stops:
            _, pending = await asyncio.wait(stops, timeout=grace_s + 10.0)
            if pending:
                log.warning("%d actor(s) did not answer the shutdown (their node lost?)", len(pending))
        for a in actors:
            with contextlib.suppress(Exception):
                self.parts.kill_actor(a)
        for group in (self.server_group, self.trainer_group):
            if group is not None:
                with contextlib.suppress(Exception):
                    self.parts.remove_group(group)
        await self.registry.close()
        await asyncio.to_thread(self.parts.disconnect)

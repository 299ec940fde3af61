"""Server fleets that change while a run goes on: servers join (a URL added at run time) and leave (drained).

How a server joins: add its base URL, one per line, to `run_dir/servers.txt` (`#` starts a comment). The cluster's
watch reads the file when it changes (`JoinFile`); a new URL is probed until it answers /health (with the run's
`server.api_key`; at most `server.startup_timeout_s`) and is then announced as `ServerJoined`. A URL taken out of
the file is announced as `ServerLeft`. A file rather than a network endpoint: whoever may write the run directory
may change its fleet, and nothing new listens on the network; it works the same for every launcher (launcher=slurm:
on the batch host's view of run_dir), for servers started by hand or by another job.

What the run does with them (`FleetPolicy`, the run's event handler): a joined server is handed to the inference
client (`add_server`), which keeps it out of rotation until it holds the current weights and version. With disk
weight sync it loads the latest published checkpoint at once. With broadcast it cannot: the NCCL (or gloo) group
that carries the weights was formed with the servers of its time, and a process group cannot grow (AReaL #1086). So
`ElasticBroadcastSync` forms a new group, under a new unique name, at the next version boundary (the next weight
update, when the servers are paused anyway): trainer rank 0 and every server the client knows join it, the weights
go out through it, and the newcomer, now holding the current version, enters rotation. A server that leaves is
drained (`remove_server`: its requests get `DRAIN_S` to finish, then continue elsewhere from their tokens so far)
and the next update forms a group without it, so no broadcast ever waits on a server that is gone. The old group is
destroyed on the servers that can (SGLang's /destroy_weights_update_group, which the embedded server serves too);
trainer rank 0 keeps its end of it until the trainers exit (no RPC drops one group yet). Group names carry a token
of the run, so a persistent server that still holds an earlier run's group is never asked to create a name twice;
the inference client destroys its groups on the servers when it closes, at the end of the run. How many ranks
each server holds and the backend come from the servers (rollout/broadcast_group.py). A server that dies or hangs
is left out the same way, and the recovery policy (launch/recovery.py) restarts it; with `recovery.enabled=false`
a dead process ends the run (`end_run_on_failure`). No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from typing import TYPE_CHECKING, Any

import aiohttp

from areal_async.launch.api import ClusterEvent, EventHandler, ServerJoined, ServerLeft, end_run_on_failure
from areal_async.rollout.broadcast_group import plan_group

if TYPE_CHECKING:
    from areal_async.config import RunConfig

log = logging.getLogger(__name__)

JOIN_FILE = "servers.txt"
DRAIN_S = 60.0  # a leaving server's requests get this long to finish there
_PROBE_S = 1.0  # between /health probes of a server waiting to join


def join_file(run_dir: str) -> str:
    return os.path.join(run_dir, JOIN_FILE)


def read_urls(path: str) -> list[str]:
    """The URLs of a join file, in order, without duplicates; a line that is not an http(s) URL is logged and
    skipped."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out: list[str] = []
    for n, line in enumerate(lines, 1):
        url = line.split("#", 1)[0].strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")) or " " in url:
            log.error("%s:%d: %r is not a server URL (http://host:port); ignored", path, n, line)
            continue
        if url not in out:
            out.append(url)
    return out


class JoinFile:
    """Turns changes of `run_dir/servers.txt` into `ServerJoined` and `ServerLeft` events (see the module
    docstring). `poll()` is cheap when nothing changed: one stat()."""

    def __init__(self, path: str, *, api_key: str | None, startup_timeout_s: float,
                 exclude: list[str] | None = None) -> None:
        self.path = path
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.exclude = {u.rstrip("/") for u in exclude or []}  # the launched servers: already in the run
        self.joined: dict[str, str] = {}  # url -> name
        self.waiting: dict[str, tuple[float, float]] = {}  # url -> (give up at, next probe at)
        self._given_up: set[str] = set()
        self._stamp: tuple[float, int] | None = None
        self._listed: list[str] = []
        self._count = 0

    def _read_if_changed(self) -> None:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        self._stamp = stamp
        self._listed = [u for u in read_urls(self.path) if u not in self.exclude]
        self._given_up.clear()  # a changed file is a new request: try those again

    async def poll(self) -> list[ClusterEvent]:
        self._read_if_changed()
        events: list[ClusterEvent] = []
        listed = set(self._listed)
        for url in [u for u in self.joined if u not in listed]:
            events.append(ServerLeft(name=self.joined.pop(url), url=url))
        for url in [u for u in self.waiting if u not in listed]:
            del self.waiting[url]
        now = time.monotonic()
        for url in self._listed:
            if url not in self.joined and url not in self.waiting and url not in self._given_up:
                self.waiting[url] = (now + self.startup_timeout_s, now)
        for url, (give_up, _) in list(self.waiting.items()):
            if now > give_up:
                del self.waiting[url]
                self._given_up.add(url)
                log.error("%s (from %s) did not answer /health within %.0fs (server.startup_timeout_s); not added "
                          "(edit the file to try again)", url, self.path, self.startup_timeout_s)
        due = [u for u, (_, at) in self.waiting.items() if at <= now]
        if due:
            healthy = await asyncio.gather(*(self._healthy(u) for u in due))
            for url, ok in zip(due, healthy):
                give_up, _ = self.waiting[url]
                if ok:
                    del self.waiting[url]
                    self.joined[url] = name = f"joined{self._count}"
                    self._count += 1
                    events.append(ServerJoined(name=name, url=url))
                else:
                    self.waiting[url] = (give_up, time.monotonic() + _PROBE_S)
        return events

    async def _healthy(self, url: str) -> bool:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as s:
                async with s.get(url + "/health", headers=headers) as r:
                    return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return False


class FleetPolicy:
    """The run's event handler: servers join and leave the inference client; anything else goes to `fallback`
    (today a dead process ends the run)."""

    def __init__(self, session: Any, fallback: EventHandler = end_run_on_failure, *, wait_client_s: float = 600.0
                 ) -> None:
        self.session = session
        self.fallback = fallback
        self.wait_client_s = wait_client_s
        self._drains: set[asyncio.Task] = set()

    async def _client(self) -> Any:
        """The run's inference client (a server may be announced while the run is still connecting)."""
        deadline = time.monotonic() + self.wait_client_s
        while self.session.client is None:
            if time.monotonic() > deadline:
                raise RuntimeError("the run has no inference client to add servers to")
            await asyncio.sleep(0.1)
        return self.session.client

    async def __call__(self, event: ClusterEvent) -> None:
        if isinstance(event, ServerJoined):
            client = await self._client()
            await client.add_server(event.url)
            log.info("%s joined at %s: it takes traffic once it holds the current weights", event.name, event.url)
        elif isinstance(event, ServerLeft):
            client = await self._client()
            log.info("%s at %s leaves: draining (up to %.0fs)", event.name, event.url, DRAIN_S)
            task = asyncio.ensure_future(self._drain(client, event))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        else:
            await self.fallback(event)

    @staticmethod
    async def _drain(client: Any, event: ServerLeft) -> None:
        try:
            await client.remove_server(event.url, drain_timeout_s=DRAIN_S)
            log.info("%s at %s drained and removed", event.name, event.url)
        except (KeyError, ValueError) as e:  # unknown, or the last server: it stays
            log.error("%s at %s cannot leave: %s", event.name, event.url, e)


def failure_policy(cfg: "RunConfig", cluster: Any, session: Any) -> EventHandler:
    """The event handler of a run. `session` holds what a handler acts on (the inference client, the trainer
    group and the controller, filled in as the run creates them). Servers join and leave through `FleetPolicy`;
    with `recovery.enabled` a `RunRecovery` (launch/recovery.py) sees every event first, restarts what died or
    hangs, and is stored as `session.recovery` (the run trains under its guard); it records what it does in
    `session.recovery_log` when the session has one."""
    fleet = FleetPolicy(session)
    if not cfg.recovery.enabled:
        return fleet
    from areal_async.launch.recovery import RecoveryLog, RunRecovery

    policy = RunRecovery(cfg, cluster, getattr(session, "recovery_log", None) or RecoveryLog(cfg.run_dir),
                         fallback=fleet)
    with contextlib.suppress(AttributeError):
        session.recovery = policy
    return policy


class _Members:
    """The client's two broadcast calls, with the group's membership limited to `urls`."""

    def __init__(self, client: Any, urls: tuple[str, ...]) -> None:
        self.client = client
        self.urls = list(urls)

    async def init_weights_update_group(self, master_address: str, master_port: int, **kw: Any) -> Any:
        return await self.client.init_weights_update_group(master_address, master_port, urls=self.urls, **kw)

    async def update_weights_from_distributed(self, *args: Any, urls: list[str] | None = None, **kw: Any) -> Any:
        """One bucket to the members, or to `urls` among them (the trainer gives each member a loop of its own)."""
        targets = self.urls if urls is None else [u for u in urls if u in self.urls]
        return await self.client.update_weights_from_distributed(*args, urls=targets, **kw)

    def weight_group_members(self, group_name: str) -> list[str]:
        del group_name  # this view is of one group
        return list(self.urls)

    def weights_update_abandoned(self, errors: dict[str, BaseException]) -> None:
        self.client.weights_update_abandoned(errors)


def _ranks_agreed(error: Any) -> bool:
    """Every trainer rank answered a failed broadcast with a BroadcastError (rank 0's, the others' Peer twin):
    rank 0 stopped sending and still took part in every gather, so no rank is stuck in a collective and the
    broadcast can be retried on a new group. A rank that did not answer, or another kind of error, may be stuck."""
    from areal_async.train.errors import BroadcastError

    kind = getattr(error, "kind", None)
    return kind is not None and issubclass(kind, BroadcastError) and not getattr(error, "unanswered", [None])


class ElasticBroadcastSync:
    """Broadcast weight sync (trainer rank 0 -> every server) whose group follows the fleet: when the servers that
    should be in it differ from the group's members, the next `apply` first forms a new group under a new name.

    Who should be in it: every server the client knows, except one that is down and was a member (dead, hung or
    being restarted: a group with it would never form, a broadcast to it fails) and a newcomer that stays down for
    `settle_s` (it gets one wait). A server that comes back (restarted under its old URL) holds the launch weights:
    `publish_current`, the client's `weight_source`, has the trainers publish a checkpoint of the version it must
    hold (when they still hold it), and the next update brings it into a new group anyway. A member that failed a
    bucket (TrainerGroup.broadcast_failures) stays out until it is back in rotation. A broadcast that fails (a
    member died or failed a bucket in the middle: the trainer client aborts rank 0's sending at once) forms a new
    group and sends again. With several trainer ranks that holds when every rank answered with a BroadcastError
    (rank 0 stopped sending but finished the FSDP gathers with the others); otherwise the other ranks may be stuck
    in a gather rank 0 left, so it is a trainer failure (`TrainerLost`: the run rolls back). After a trainer
    restart, `set_trainers`: the new job is in no group."""

    latest_checkpoint: str | None = None
    bucketed = True  # rollout/weight_sync.py: never applied without a pause

    def __init__(self, trainers: Any, client: Any, master_address: str, *, ranks_per_server: int, backend: str,
                 api_key: str | None = None, settle_s: float = 10.0, catch_up_root: str | None = None,
                 max_attempts: int = 2) -> None:
        self.trainers = trainers
        self.client = client
        self.master_address = master_address
        self.ranks_per_server = ranks_per_server
        self.backend = backend
        self.api_key = api_key
        self.settle_s = settle_s  # how long a newcomer not yet probed by the client may hold back a new group
        self.catch_up_root = catch_up_root  # where publish_current writes (None: no catch-up checkpoints)
        self.max_attempts = max_attempts
        self.group_name: str | None = None
        self.members: tuple[str, ...] = ()
        self.generation = 0
        self.run_token = secrets.token_hex(4)
        self._waited: set[str] = set()  # newcomers that had their wait
        self._failed: set[str] = set()  # members that failed a bucket of a broadcast (TrainerGroup.broadcast_failures)

    def set_trainers(self, trainers: Any) -> None:
        self.trainers = trainers
        self.members = ()

    def _states(self) -> dict[str, str]:
        return {u: s["state"] for u, s in self.client.stats()["servers"].items()}

    def _targets(self, *, newcomers_down: bool) -> tuple[str, ...]:
        states = self._states()
        # a member that failed a bucket stays out until it is back in rotation (it caught up by other means): alive
        # and reachable, it may well fail the next broadcast the same way, and every member's failure aborts one
        self._failed = {u for u in self._failed if states.get(u) not in (None, "serving")}
        return tuple(u for u in self.client.urls if u not in self._failed and (states.get(u) != "down"
                     or (newcomers_down and u not in self.members and u not in self._waited)))

    async def form_group(self) -> None:
        members = self._targets(newcomers_down=False)
        if not members:
            raise RuntimeError("no inference server is reachable to form a weight-update group with")
        self.generation += 1
        # unique per run: a persistent server still holding an earlier run's group (same process, same torch
        # group registry) refuses a name it has seen
        name = f"areal-{self.run_token}-{self.generation}"
        # each server's ranks (its tensor-parallel size) and the backend come from the servers (rollout/broadcast_group.py)
        plan = await plan_group(self.client, list(members), (getattr(self.trainers, "infos", None) or [None])[0],
                                default_ranks=self.ranks_per_server, backend=self.backend)
        # rank 0 hosts the group's store on a port it binds itself; the address is the launcher's view of where
        # the servers reach rank 0 (the same host's address for a local run, the trainer node's under Slurm)
        await self.trainers.init_broadcast_group(
            _Members(self.client, members), num_server_ranks=plan.num_server_ranks,
            master_address=self.master_address, ranks_per_server=plan.ranks, group_name=name,
            backend=plan.backend)
        old, self.group_name, self.members = self.group_name, name, members
        log.info("weight-update group %s (%s): trainer rank 0 and %d server(s), %d server rank(s)", name,
                 plan.backend, len(members), plan.num_server_ranks)
        if old is not None:
            await self._destroy_on_servers(old, members)

    async def _members_settled(self) -> None:
        """Wait (bounded) until no newcomer the client knows is still 'down' (not probed yet): every member must
        answer the group's rendezvous. A newcomer gets this wait once."""
        new = [u for u in self._targets(newcomers_down=True) if u not in self.members]
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline:
            states = self._states()
            if all(states.get(u) != "down" for u in new):
                break
            await asyncio.sleep(0.1)
        self._waited.update(new)

    async def _destroy_on_servers(self, name: str, urls: tuple[str, ...]) -> None:
        """The servers leave the old group (the client knows who joined it); an unknown name is no failure."""
        results = await self.client.destroy_weights_update_group(name)
        for url, r in results.items():
            if isinstance(r, BaseException):
                log.warning("%s could not destroy weight-update group %s: %s", url, name, r)

    async def prepare(self, version: int) -> None:
        del version

    async def apply(self, version: int, *, flush_cache: bool) -> None:
        from areal_async.launch.recovery import TrainerLost
        from areal_async.train.client import BroadcastIncomplete, TrainerError

        for attempt in range(1, self.max_attempts + 1):
            if self._targets(newcomers_down=True) != self.members:  # a version boundary after the fleet changed
                await self._members_settled()
                await self.form_group()
            try:
                await self.trainers.broadcast_weights(self.client, version, group_name=self.group_name,
                                                      flush_cache=flush_cache)
                return
            except (TrainerError, BroadcastIncomplete) as e:
                if isinstance(e, TrainerError) and e.bad_input:
                    raise
                if self.trainers.world_size > 1 and isinstance(e, TrainerError) and not _ranks_agreed(e):
                    raise TrainerLost(f"the weight broadcast of version {version} failed ({e}); with "
                                      f"{self.trainers.world_size} trainer ranks the others may be stuck in a "
                                      "collective") from e
                if attempt == self.max_attempts:
                    raise
                log.warning("weight broadcast of version %d failed (%s): forming a new group and sending again",
                            version, str(e).splitlines()[0])
                self.members = ()
            finally:
                self._failed.update(getattr(self.trainers, "broadcast_failures", None) or {})

    async def publish_current(self, version: int) -> str:
        """The client's `weight_source`: an HF checkpoint of `version` for a server that came back."""
        held = self.trainers.version
        if held != version or self.catch_up_root is None:
            raise RuntimeError(f"the trainers hold version {held}, not {version} (an update is under way)")
        return (await self.trainers.publish(version, self.catch_up_root, keep=1)).path

"""Server fleets that change while a run goes on: servers join (a URL added at run time) and leave (drained).

How a server joins: add its base URL, one per line, to `run_dir/servers.txt` (`#` starts a comment). The cluster's
watch reads the file when it changes (`JoinFile`); a new URL is probed until it answers /health (with the run's
`server.api_key`; at most `server.startup_timeout_s`) and is then announced as `ServerJoined`. A URL taken out of
the file is announced as `ServerLeft`. A file rather than a network endpoint: whoever may write the run directory
may change its fleet, and nothing new listens on the network; it works the same for every launcher (launcher=slurm:
on the batch host's view of run_dir), for servers started by hand or by another job.

`FleetPolicy`, the run's event handler, hands a joined server to the inference client (`add_server`: out of
rotation until it holds the current weights) and drains a leaving one (`remove_server`, `DRAIN_S`); with broadcast
weight sync the next update forms a new group (rollout/broadcast_sync.py, docs/weights.md). `failure_policy` puts
the recovery policy in front of it (launch/recovery.py, docs/recovery.md). No torch here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING, Protocol

import aiohttp

from areal_async.launch.api import Cluster, ClusterEvent, EventHandler, ServerJoined, ServerLeft, end_run_on_failure
from areal_async.launch.recovery import RecoveryLog, RunRecovery

if TYPE_CHECKING:
    from areal_async.config import RunConfig
    from areal_async.inference.client import InferenceClient

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

    def __init__(
        self, path: str, *, api_key: str | None, startup_timeout_s: float, exclude: list[str] | None = None
    ) -> None:
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
                log.error(
                    "%s (from %s) did not answer /health within %.0fs (server.startup_timeout_s); not added "
                    "(edit the file to try again)",
                    url,
                    self.path,
                    self.startup_timeout_s,
                )
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
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return False


class HoldsClient(Protocol):
    """What the fleet handler reads of the run's session (run.py `Session`): the inference client, once made."""

    client: InferenceClient | None


class FleetPolicy:
    """The run's event handler: servers join and leave the inference client; anything else goes to `fallback`
    (today a dead process ends the run)."""

    def __init__(
        self, session: HoldsClient, fallback: EventHandler = end_run_on_failure, *, wait_client_s: float = 600.0
    ) -> None:
        self.session = session
        self.fallback = fallback
        self.wait_client_s = wait_client_s
        self._drains: set[asyncio.Task] = set()

    async def _client(self) -> InferenceClient:
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
    async def _drain(client: InferenceClient, event: ServerLeft) -> None:
        try:
            await client.remove_server(event.url, drain_timeout_s=DRAIN_S)
            log.info("%s at %s drained and removed", event.name, event.url)
        except (KeyError, ValueError) as e:  # unknown, or the last server: it stays
            log.error("%s at %s cannot leave: %s", event.name, event.url, e)


def failure_policy(
    cfg: RunConfig, cluster: Cluster, session: HoldsClient, recovery_log: RecoveryLog | None = None
) -> FleetPolicy | RunRecovery:
    """The event handler of a run. `session` holds the inference client the fleet handler adds servers to (filled
    in as the run creates it). Servers join and leave through `FleetPolicy`; with `recovery.enabled` the handler is
    a `RunRecovery` (launch/recovery.py) that sees every event first, restarts what died or hangs, and records what
    it does in `recovery_log` (a new one in run_dir without it). The caller keeps a `RunRecovery` it gets back:
    the run trains under its guard."""
    fleet = FleetPolicy(session)
    if not cfg.recovery.enabled:
        return fleet
    return RunRecovery(cfg, cluster, recovery_log or RecoveryLog(cfg.run_dir), fallback=fleet)

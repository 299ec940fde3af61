"""Fault recovery: what a run does when a server, the trainer job or the controller itself fails.

`RunRecovery` is the run's event handler when `recovery.enabled` (launch/membership.py's `failure_policy` builds
it, run.py keeps it): it restarts dead and hung servers (with a watchdog over /health and the client's view), and
its `guard` around the training loop turns a trainer failure into `TrainerLost` and a fleet with no server serving
into `NoServerServing` (rollout/outcomes.py); `roll_back` (session/) does the rest. `RunLock` keeps one controller per
run directory and tells a rerun that the last one was killed; `RecoveryLog` records every fault and what was done.
The whole story, with the config keys: docs/recovery.md. No torch here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import aiohttp

from areal_async.launch.api import (
    Cluster,
    ClusterEvent,
    EventHandler,
    ProcessExited,
    ServerHandle,
    ServerJoined,
    TrainerHandle,
    end_run_on_failure,
)
from areal_async.launch.processes import ChildFailed
from areal_async.rollout.outcomes import NoServerServing, RunStopped, TrainerLost
from areal_async.train.client import TrainerError

if TYPE_CHECKING:
    from areal_async.config import RecoveryConfig, RunConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "LOCK_FILE",
    "LOG_FILE",
    "NoServerServing",
    "RecoveryLog",
    "RestartableCluster",
    "RunLock",
    "RunRecovery",
    "RunStopped",
    "TrainerLost",
    "backoff_s",
]

LOG_FILE = "recoveries.jsonl"
LOCK_FILE = "controller.lock"


class RestartableCluster(Cluster, Protocol):
    """What recovery needs of a cluster beyond `Cluster` (LocalCluster and SlurmCluster have it; a launcher that
    lacks a method leaves that kind of failure unrecovered). `restart_server` announces the server with
    `ServerJoined`. `can_restart_servers` and `can_restart_trainers` say whether a restart will be tried at all
    (servers or trainers the cluster did not start, agents started by hand elsewhere with recovery.shrink_trainers
    off: no), so that the record never announces a restart that cannot happen; `why_trainers_cannot_restart` says
    why not, and what the operator does. `server_where` (optional) says where a restarted server runs, and why there
    when it moved; `trainer_layout` and `last_shrink` (optional) where the trainer job runs, and what the last
    `restart_trainers` left out when it shrank the job to the hosts left (launch/shrink.py)."""

    can_restart_servers: bool
    can_restart_trainers: bool

    def why_trainers_cannot_restart(self) -> str: ...

    def server_alive(self, name: str) -> bool: ...

    def trainer_pids(self) -> set[int]: ...

    async def stop_server(self, name: str) -> None: ...

    async def restart_server(self, name: str) -> ServerHandle: ...

    async def restart_trainers(self, resume: str | None) -> TrainerHandle: ...


# ---- the record of what happened ----------------------------------------------------------------------------------


class RecoveryLog:
    """Faults and recoveries: `record` logs, appends to recoveries.jsonl and to metrics.jsonl (through `metrics`,
    set by the run), and counts. Each record has an `outcome`: fault (something failed), recovered (it is back;
    `recover_s` says how long it took), gave_up (retries spent), or info (a step on the way)."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOG_FILE)
        self.metrics: Callable[[str, int, dict[str, Any]], None] | None = None  # (kind, step, values)
        self.version: Callable[[], int] = lambda: 0
        self.history: list[dict[str, Any]] = []  # this run directory's records, earlier controllers' included
        if os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    with contextlib.suppress(json.JSONDecodeError):
                        self.history.append(json.loads(line))

    def record(self, outcome: str, event: str, name: str, what: str, action: str, **extra: Any) -> dict[str, Any]:
        version = extra.pop("version", None)
        version = self.version() if version is None else version
        rec = {
            "outcome": outcome,
            "event": event,
            "name": name,
            "what": what,
            "action": action,
            "version": version,
            "time": time.time(),
            **extra,
        }
        self.history.append(rec)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        (log.info if outcome == "info" else log.warning)(
            "recovery: %s %s: %s -> %s%s",
            event,
            name,
            what.splitlines()[0] if what else "",
            action,
            f" ({extra['recover_s']:.1f}s)" if "recover_s" in extra else "",
        )
        if self.metrics is not None:
            with contextlib.suppress(Exception):  # a closed logger mid-rollback must not fail a recovery
                self.metrics("recovery", version, {k: v for k, v in rec.items() if k != "time"})
        return rec

    def summary(self) -> dict[str, Any]:
        """For summary.json: counts by outcome and faults by event, recovery times, and the last records."""
        by_kind = collections.Counter(r.get("outcome") for r in self.history)
        times = [r["recover_s"] for r in self.history if r.get("outcome") == "recovered" and "recover_s" in r]
        return {
            "faults": by_kind.get("fault", 0),
            "recovered": by_kind.get("recovered", 0),
            "gave_up": by_kind.get("gave_up", 0),
            "by_event": dict(collections.Counter(r.get("event") for r in self.history if r.get("outcome") == "fault")),
            "recover_s_max": max(times) if times else None,
            "recover_s_mean": sum(times) / len(times) if times else None,
            "events": [{k: v for k, v in r.items() if k != "what" or len(str(v)) < 300} for r in self.history[-50:]],
        }


class RunLock:
    """One controller per run directory, and how the previous one ended.

    `run_dir/controller.lock` holds {"state": "starting" | "running" | "stopped" | "failed", "pid", ...} and is
    flock()ed while a controller runs. The kernel drops the lock when the process dies however it dies, so a rerun
    that finds "running" in an unlocked file knows the last controller was killed (SIGKILL, OOM, a lost node).
    "starting" (taken, servers and trainers not yet launched: `mark_running` ends it) is no crash to recover from:
    nothing was trained, so a controller interrupted or killed while starting up is not reported as a fault."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fd: int | None = None
        self._started = 0.0

    def acquire(self) -> dict[str, Any] | None:
        """Take the lock; returns the previous controller's record when it never stopped, else None. Raises
        `RuntimeError` when another live controller holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # no flock on this platform: the crash record still works
            pass
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"{os.path.dirname(self.path)} is in use by another running controller ({self._read().get('pid', '?')})"
            ) from None
        self._fd = fd
        previous = self._read()
        self._started = time.time()
        self._write({"state": "starting", "pid": os.getpid(), "started": self._started})
        return previous if previous.get("state") == "running" else None

    def mark_running(self) -> None:
        """The run is launched: from now on a controller that ends without `release` was killed mid-run."""
        if self._fd is not None:
            self._write({"state": "running", "pid": os.getpid(), "started": self._started})

    def release(self, state: str) -> None:
        if self._fd is None:
            return
        self._write({"state": state, "pid": os.getpid(), "ended": time.time()})
        os.close(self._fd)  # drops the flock
        self._fd = None

    def _read(self) -> dict[str, Any]:
        try:
            with open(self.path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, json.JSONDecodeError):
            return {}

    def _write(self, data: dict[str, Any]) -> None:
        assert self._fd is not None
        raw = json.dumps(data).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, raw, 0)
        os.fsync(self._fd)


# ---- the policy ---------------------------------------------------------------------------------------------------


@dataclass
class _ServerWatch:
    """The recovery side of one launched server."""

    restarts: collections.deque = field(default_factory=collections.deque)  # monotonic times, within the window
    unwell_since: float | None = None
    busy: bool = False  # a restart is under way
    given_up: bool = False
    warned: bool = False


def backoff_s(cfg: RecoveryConfig, earlier: int) -> float:
    """The wait before a restart that follows `earlier` restarts in the window."""
    return min(cfg.restart_backoff_max_s, cfg.restart_backoff_s * 2**earlier)


class RunRecovery:
    """The recovering event handler of a run (see the module docstring). Call `attach(client)` once the inference
    client exists (the watchdog starts), run the training loop under `guard`, and `close()` at the end."""

    def __init__(
        self, cfg: RunConfig, cluster: Cluster, log_: RecoveryLog, fallback: EventHandler | None = None
    ) -> None:
        self.cfg = cfg.recovery
        self.fallback = fallback or end_run_on_failure  # servers joining and leaving (launch/membership.py), the rest
        self.startup_timeout_s = cfg.server.startup_timeout_s
        self.api_key = cfg.server.api_key
        self.cluster = cluster
        self.log = log_
        self.client: Any = None
        self.trainer_restarts = 0
        self._servers: dict[str, _ServerWatch] = {}
        self._urls: dict[str, str] = {s.name: s.url for s in cluster.servers}
        self._tasks: set[asyncio.Task] = set()
        self._watchdog: asyncio.Task | None = None
        self._failure: BaseException | None = None
        self._failed: asyncio.Event | None = None
        self._none_since: float | None = None
        self.guarded = False  # set by the first guard(): from then on a trainer exit is a fault to recover from

    @property
    def can_restart_servers(self) -> bool:
        return bool(getattr(self.cluster, "can_restart_servers", False))

    @property
    def rolls_back_trainers(self) -> bool:
        """A trainer failure ends the segment with `TrainerLost` for `roll_back` (which restarts the job or, when
        the cluster cannot, stops the run with a resumable checkpoint), rather than ending the run at once."""
        return hasattr(self.cluster, "restart_trainers") and hasattr(self.cluster, "trainer_pids")

    def trainer_restart_refusal(self) -> str | None:
        """Why the trainer job will not be restarted however many restarts are left (None: a restart will be
        tried). Asked before a restart is announced, so that the record does not promise one."""
        if not self.rolls_back_trainers:
            return "this cluster cannot restart its trainers"
        if getattr(self.cluster, "can_restart_trainers", True):
            return None
        why = getattr(self.cluster, "why_trainers_cannot_restart", None)
        return why() if callable(why) else "this cluster cannot restart its trainers"

    def _watch(self, name: str) -> _ServerWatch:
        return self._servers.setdefault(name, _ServerWatch())

    # ---- events -------------------------------------------------------------------------------------------------

    async def __call__(self, event: ClusterEvent) -> None:
        if isinstance(event, ServerJoined) and event.name in self._urls:  # one of ours, restarted
            await self._admit(event.name, event.url)
        elif isinstance(event, ProcessExited) and event.role == "server" and event.name in self._urls:
            self._spawn(self._recover_server(event.name, "server_exited", event.describe(), time.monotonic()))
        elif (
            isinstance(event, ProcessExited) and event.role == "trainer" and self.rolls_back_trainers and self.guarded
        ):  # before anything ran under the guard, a trainer exit is a failed launch (below)
            if event.pid is not None and event.pid not in self.cluster.trainer_pids():
                return  # a job that was already replaced
            self.fail(TrainerLost(f"the trainer job exited: {event.describe()}", pid=event.pid))
        else:  # servers joining and leaving, processes we cannot restart, a trainer job that never came up (a
            # missing node, a bad checkpoint: restarting it would fail the same way) ends the run with its log tail
            await self.fallback(event)

    def fail(self, exc: BaseException) -> None:
        """End the current training segment with `exc` (the first failure stands until it is taken)."""
        if self._failure is None:
            self._failure = exc
            self._event().set()

    def _event(self) -> asyncio.Event:
        if self._failed is None:
            self._failed = asyncio.Event()
        return self._failed

    # ---- the training loop's guard ------------------------------------------------------------------------------

    async def guard(
        self,
        body: Awaitable[T],
        *,
        stop: Callable[[BaseException], Awaitable[None]] | None = None,
        stop_grace_s: float = 60.0,
    ) -> T:
        """Await `body`; when the trainer job fails (a `TrainerError` out of `body`, or the job's exit) cancel it
        and raise `TrainerLost`; when the servers are gone (`NoServerServing`) ask `body` to `stop` (it finishes
        the step it is in, so the trainer state stays checkpointable), wait `stop_grace_s`, then raise it."""
        self.guarded = True
        task = asyncio.ensure_future(body)
        waiter = asyncio.ensure_future(self._event().wait())
        try:
            while True:
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if task.done() or not self._stale(self._failure):
                    break
                self._failure = None  # the exit of a trainer job that was replaced already
                self._event().clear()
                waiter = asyncio.ensure_future(self._event().wait())
            if not task.done():
                failure = self._failure
                assert failure is not None
                if isinstance(failure, NoServerServing) and stop is not None:
                    await stop(failure)
                    await asyncio.wait({task}, timeout=stop_grace_s)
                    failure.stopped_cleanly = task.done()
                if not task.done():
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                self._take(failure)
                raise failure
            exc = None if task.cancelled() else task.exception()
            if exc is None:
                return task.result()
            if isinstance(exc, TrainerError) and not exc.bad_input:
                raise TrainerLost(str(exc)) from exc
            if self._failure is not None and not self._stale(self._failure):  # broke over what the watch saw
                failure = self._failure
                self._take(failure)
                raise failure from exc
            raise exc
        finally:
            waiter.cancel()
            if not task.done():
                task.cancel()

    def _stale(self, failure: BaseException | None) -> bool:
        if not isinstance(failure, TrainerLost) or failure.pid is None or not self.rolls_back_trainers:
            return False
        return failure.pid not in self.cluster.trainer_pids()  # replaced, or being replaced (no job right now)

    def _take(self, failure: BaseException) -> None:
        if self._failure is failure and not isinstance(failure, NoServerServing):
            self._failure = None
            self._event().clear()

    def trainer_restart_delay(self) -> float | None:
        """Count one trainer restart and return the wait before it; None when `max_trainer_restarts` are spent."""
        if self.trainer_restarts >= self.cfg.max_trainer_restarts or not self.rolls_back_trainers:
            return None
        self.trainer_restarts += 1
        return backoff_s(self.cfg, self.trainer_restarts - 1)

    # ---- servers ------------------------------------------------------------------------------------------------

    def attach(self, client: Any) -> None:
        """Start watching the servers through `client` (an InferenceClient)."""
        self.client = client
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_servers(), name="server-watchdog")

    def _spawn(self, coro: Awaitable[None]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._done)

    def _done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.error("recovery task failed: %r", t.exception(), exc_info=t.exception())

    def _server_states(self) -> dict[str, str]:
        if self.client is None:
            return {}
        return {u: s["state"] for u, s in self.client.stats()["servers"].items()}

    async def _watch_servers(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_timeout_s)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with aiohttp.ClientSession(timeout=timeout, headers=headers) as http:
            while True:
                await asyncio.sleep(self.cfg.health_interval_s)
                await self.check(http)

    async def _probe(self, http: aiohttp.ClientSession, url: str) -> bool:
        """The server's liveness path as the client probes it (a real SGLang's /health is a generation that waits
        out pauses and a busy scheduler: inference/dialect.py), with the dialect's patience for a slow answer."""
        path, grace = self.client.liveness(url) if self.client is not None else ("/health", None)
        timeout = aiohttp.ClientTimeout(total=max(grace or 0.0, self.cfg.health_timeout_s))
        try:
            async with http.get(url + path, timeout=timeout) as r:
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def check(self, http: aiohttp.ClientSession) -> None:
        """One watchdog round: find servers unwell for too long, and a run with no server serving."""
        handles = list(self.cluster.servers)
        oks = await asyncio.gather(*(self._probe(http, h.url) for h in handles))
        states = self._server_states()
        now = time.monotonic()
        for h, ok in zip(handles, oks):
            w = self._watch(h.name)
            if w.busy or w.given_up:
                continue
            state = states.get(h.url)
            if ok and state == "serving":
                w.unwell_since, w.warned = None, False
                continue
            if w.unwell_since is None:
                w.unwell_since = now
                continue
            limit = self.cfg.unhealthy_restart_s
            if not limit or now - w.unwell_since < limit:
                continue
            why = (
                f"silent on /health for {now - w.unwell_since:.0f}s"
                if not ok
                else f"out of rotation ({state}) for {now - w.unwell_since:.0f}s"
            )
            if self.can_restart_servers and self.cluster.server_alive(h.name):
                self._spawn(
                    self._recover_server(h.name, "server_unhealthy", f"{h.url}: {why}", w.unwell_since, kill=True)
                )
            elif not self.can_restart_servers and not w.warned:
                w.warned = True
                log.warning(
                    "inference server %s (%s): %s; it was not started by this run, so it is left to come "
                    "back by itself",
                    h.name,
                    h.url,
                    why,
                )
        if any(s == "serving" for s in states.values()):
            self._none_since = None
        elif states:
            self._none_since = self._none_since or now
            if now - self._none_since >= self.cfg.no_server_timeout_s and self._failure is None:
                self.log.record(
                    "gave_up",
                    "no_server",
                    "servers",
                    f"no inference server has been serving for {now - self._none_since:.0f}s (states: {states})",
                    "stopping the run",
                )
                self.fail(
                    NoServerServing(
                        f"no inference server has been serving for "
                        f"{now - self._none_since:.0f}s (recovery.no_server_timeout_s)"
                    )
                )

    async def _recover_server(self, name: str, event: str, what: str, lost_at: float, *, kill: bool = False) -> None:
        """Bring server `name` back: kill it first when it is alive but unwell, restart it with backoff within
        its budget, let the client load the current weights into it, and record how long it took."""
        w = self._watch(name)
        if w.busy or w.given_up:
            return
        w.busy = True
        try:
            if not self.can_restart_servers:
                self.log.record(
                    "fault",
                    event,
                    name,
                    what,
                    "this cluster cannot restart it: left to the client, which re-admits it if it answers again",
                )
                return
            action = "restarting" if self.cfg.max_server_restarts else "not restarted (recovery.max_server_restarts=0)"
            self.log.record("fault", event, name, what, f"killed; {action}" if kill else action)
            if kill:
                await self.cluster.stop_server(name)
            handle = await self._restart(name, w)
            if handle is None:
                return
            await self._admit(name, handle.url)
            try:
                await self.client.wait_serving(handle.url, self.cfg.unhealthy_restart_s or self.startup_timeout_s)
            except Exception as e:  # InferenceError; KeyError if it was removed meanwhile
                self.log.record(
                    "info",
                    "server_not_serving",
                    name,
                    f"{handle.url} restarted but not serving: {e}",
                    "left to the watchdog",
                )
                return
            target = self.client.weight_target
            held = self.client.stats()["servers"].get(handle.url, {}).get("version")
            current = target.version if target is not None else 0
            where = getattr(self.cluster, "server_where", None)
            where = where(name) if callable(where) else ""
            self.log.record(
                "recovered",
                "server_recovered",
                name,
                f"{handle.url} serving again{f' {where}' if where else ''}",
                f"restarted and loaded weight version {held if held is not None else 0} (current {current})",
                recover_s=time.monotonic() - lost_at,
                restarts=len(w.restarts),
                server_version=held if held is not None else 0,
                current_version=current,
                **({"where": where} if where else {}),
            )
        finally:
            w.busy = False
            w.unwell_since = None

    async def _restart(self, name: str, w: _ServerWatch) -> ServerHandle | None:
        while True:
            cut = time.monotonic() - self.cfg.server_restart_window_s
            while w.restarts and w.restarts[0] < cut:
                w.restarts.popleft()
            if len(w.restarts) >= self.cfg.max_server_restarts:
                w.given_up = True
                self.log.record(
                    "gave_up",
                    "server_given_up",
                    name,
                    f"{len(w.restarts)} restarts within {self.cfg.server_restart_window_s:g}s",
                    "restarts spent (recovery.max_server_restarts): it stays out of the run",
                )
                return None
            await asyncio.sleep(backoff_s(self.cfg, len(w.restarts)))
            w.restarts.append(time.monotonic())
            try:
                return await self.cluster.restart_server(name)
            except (ChildFailed, OSError) as e:
                self.log.record("info", "server_restart_failed", name, str(e)[-2000:], "retrying with backoff")

    async def _admit(self, name: str, url: str) -> None:
        """Make the client use server `name` at `url` (a restart on a new port replaces the old URL)."""
        if self.client is None:
            return
        old = self._urls.get(name)
        self._urls[name] = url
        if url not in self.client.urls:
            await self.client.add_server(url)
        if old is not None and old != url and old in self.client.urls:
            with contextlib.suppress(KeyError, ValueError):
                await self.client.remove_server(old, drain_timeout_s=0.0)

    async def close(self) -> None:
        tasks = [t for t in [self._watchdog, *self._tasks] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watchdog = None

"""Hang detection and recovery of the pool's servers: the heartbeat that probes busy servers, and the recovery
task that brings a lost one back into rotation.

Apart from transport.py because it is one policy on top of the exchange machinery (see transport.py's docstring
for the rules): it only sends GET /health through `send` and moves servers between states. `HealthWatch` is a
mixin of `ServerPool`, whose attributes it uses (declared below for readers; `ServerPool.__init__` sets them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from areal_async.inference.errors import DOWN_STATUS, ConnectionFailed, InferenceError
from areal_async.inference.routing import Router, ServerState

log = logging.getLogger("areal_async.inference.transport")  # the pool's log: one logger for its server states


def _liveness_path(server: ServerState) -> str:
    """What the heartbeat asks a busy server: its dialect's cheap liveness path (inference/dialect.py), /health
    until the dialect is known. Recovery and admission ask /health itself, which on SGLang proves that the
    scheduler generates, and take their time over it."""
    return server.dialect.liveness_path if server.dialect is not None else "/health"


class HealthWatch:
    """The heartbeat and the recovery tasks of a `ServerPool`."""

    # set by ServerPool.__init__ / ServerPool.session
    router: Router
    closed: bool
    probes_paused: bool
    probe_interval_s: float
    health_timeout_s: float
    max_health_failures: int
    ready_check: Callable[[ServerState], Awaitable[bool]] | None
    counts: dict[str, int]
    _loop: asyncio.AbstractEventLoop | None
    _any_healthy: asyncio.Event
    _recovery: dict[str, asyncio.Task]
    _probing: set[str]
    # ServerPool's methods
    send: Callable[..., Awaitable[tuple[int, bytes]]]
    server_failed: Callable[[ServerState, str], None]
    spawn: Callable[[Awaitable[Any]], None]

    def _start_recovery(self, server: ServerState) -> None:
        if self.closed or self._loop is None:
            return  # started with the session
        t = self._recovery.get(server.url)
        if t is None or t.done():
            self._recovery[server.url] = self._loop.create_task(self._recover(server))

    def probe_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.health_timeout_s)

    def _health_timeout(self, server: ServerState) -> aiohttp.ClientTimeout:
        """Recovery's /health deadline: a real SGLang's /health is a generation that answers a second or more
        after it is asked even when idle, so the engine's patience applies (its last known dialect's)."""
        patience = server.dialect.hang_timeouts if server.dialect is not None else None
        return aiohttp.ClientTimeout(total=self.health_timeout_s * (patience or 1))

    def _back_in_rotation(self, server: ServerState) -> None:
        self.router.set_state(server.url, "serving")
        server.dialect = None  # asked again at the next exchange: a restarted process may be another release
        self._any_healthy.set()
        self.counts["servers_recovered"] += 1

    async def _recover(self, server: ServerState) -> None:
        """Probe GET /health until it answers 200, then `ready_check` until it passes; then back in rotation."""
        delay = self.probe_interval_s
        first = server.state == "syncing"  # a reachable server is checked at once; a dead one after a pause
        while not self.closed and server.url in self.router.servers and server.state in ("down", "syncing"):
            if not first:
                await asyncio.sleep(delay)
            first = False
            try:
                status, _ = await self.send(
                    server, "GET", "/health", None, timeout=self._health_timeout(server), probe=True
                )
            except (ConnectionFailed, InferenceError):
                continue
            if status != 200:
                continue
            if server.state == "down":
                self.router.set_state(server.url, "syncing")
            try:
                ready = self.ready_check is None or await self.ready_check(server)
            except (ConnectionFailed, InferenceError) as e:
                log.warning("inference server %s: weight check failed: %s", server.url, e)
                ready = False
            if not ready:  # e.g. its weight load failed: back off up to 30 s between tries
                delay = min(30.0, max(delay * 2, self.probe_interval_s))
                continue
            if server.url in self.router.servers and server.state == "syncing":
                self._back_in_rotation(server)
                log.warning("inference server %s is back in rotation", server.url)
                return
            # it failed again meanwhile (state "down"): keep probing

    async def try_admit(self, server: ServerState) -> bool:
        """Put an out-of-rotation server back now if /health answers and `ready_check` passes."""
        if server.url not in self.router.servers or server.state not in ("down", "syncing"):
            return server.state == "serving"
        try:
            status, _ = await self.send(
                server, "GET", "/health", None, timeout=self._health_timeout(server), probe=True
            )
            if status != 200:
                return False
            if server.state == "down":
                self.router.set_state(server.url, "syncing")
            if self.ready_check is not None and not await self.ready_check(server):
                return False
        except (ConnectionFailed, InferenceError):
            return False
        if server.url in self.router.servers and server.state == "syncing":
            self._back_in_rotation(server)
            log.warning("inference server %s is in rotation", server.url)
        return server.state == "serving"

    async def _heartbeat_loop(self) -> None:
        while not self.closed:
            await asyncio.sleep(self.probe_interval_s)
            if self.probes_paused:
                continue
            for s in list(self.router.servers.values()):
                if (
                    s.state in ("serving", "draining")
                    and s.exchanges > 0
                    and s.admin_ops == 0
                    and s.url not in self._probing
                ):
                    self._probing.add(s.url)
                    self.spawn(self._heartbeat_probe(s))

    async def _heartbeat_probe(self, server: ServerState) -> None:
        """One liveness probe of a busy server; enough unanswered ones in a row mean it hangs.

        Slow is not hung:
        - a probe that goes unanswered while the server sent us other bytes since it went out (a streamed token, a
          finished generation) does not count;
        - a dialect with `hang_timeouts` (a real engine, whose HTTP front shares the host's cores with its
          scheduler and, on a small machine, with the trainers) gives one probe that many `health_timeout_s` to
          answer, and that probe is the whole verdict. SGLang's own /health allows its scheduler 20 s likewise.
        A SIGSTOPped or wedged server answers nothing at all, and is still found: the embedded server after
        `max_health_failures` probes of `health_timeout_s`, a real engine after its `hang_timeouts` of them."""
        sent_at = time.monotonic()
        grace = server.dialect.hang_timeouts if server.dialect is not None else None
        timeout = aiohttp.ClientTimeout(total=self.health_timeout_s * (grace or 1))
        try:
            status, _ = await self.send(server, "GET", _liveness_path(server), None, timeout=timeout, probe=True)
        except ConnectionFailed as e:
            if server.state in ("serving", "draining"):
                self.server_failed(server, f"health probe: {e}")
            return
        except InferenceError:  # no answer within the probe's deadline
            if server.last_answer >= sent_at:
                server.health_failures = 0  # slow, and working
                return
            server.health_failures += 1
            waited = timeout.total or 0.0
            if (grace or server.health_failures >= self.max_health_failures) and server.state in (
                "serving",
                "draining",
            ):
                self.server_failed(
                    server, f"hung: {server.health_failures} health probes unanswered within {waited:g}s"
                )
            return
        finally:
            self._probing.discard(server.url)
        if status == 200:
            server.health_failures = 0
        elif status in DOWN_STATUS and server.state in ("serving", "draining"):
            self.server_failed(server, f"health probe: HTTP {status}")

"""A pool of SGLang-protocol servers over HTTP: one exchange, routing with retries and failover, health, membership.

No torch here, and nothing about generation: the pool moves bytes and keeps each server's state (routing.py). One
aiohttp session (made lazily inside the running loop) carries every request. The heartbeat and the recovery of lost
servers are in health.py (a mixin of the pool), the errors and the status classification in errors.py.

Failure handling, as the rest of the client relies on it:
- retries with exponential backoff on connection errors, 429 and 5xx; never on other 4xx (those raise
  `InferenceError` with the server's message). A retry goes to another serving server when there is one.
- a server that refuses connections, drops them, or answers 502/503/504 leaves rotation at once ("down").
- hung servers (SIGSTOP: the socket accepts, nothing answers) are found by a heartbeat: every `probe_interval_s`
  each server with requests in flight is sent GET /health with a `health_timeout_s` deadline; after
  `max_health_failures` unanswered probes in a row it is down. A long healthy generation is never cut short: the
  deadline applies to /health, which a working server answers at once, not to the generation. Servers loading
  weights are not probed (a real SGLang server may not answer /health while it loads); a weight load that takes
  longer than `weight_load_timeout_s` counts as failed instead.
- when a server goes down, every exchange in flight on it ends at once with `ConnectionFailed` (the caller
  resubmits elsewhere), and a recovery task probes it until /health answers, then runs `ready_check` (the client
  brings the server to the current weights there) and only then puts it back in rotation.
- when no server is serving, a request waits up to `unavailable_timeout_s` for one to come back, then raises.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec

from areal_async.inference.dialect import Dialect, EventSink
from areal_async.inference.engines import detect
from areal_async.inference.errors import (
    DOWN_STATUS,
    RETRY_STATUS,
    AdminError,
    ConnectionFailed,
    InferenceError,
    StreamError,
    error_message,
)
from areal_async.inference.health import HealthWatch
from areal_async.inference.http_exchange import KEEPALIVE_S, exchange
from areal_async.inference.routing import Router, ServerState

# the errors live in errors.py; re-exported here, where the client's modules and tests import them from
__all__ = [
    "DOWN_STATUS",
    "RETRY_STATUS",
    "AdminError",
    "ConnectionFailed",
    "EventSink",
    "InferenceError",
    "ServerPool",
    "StreamError",
    "error_message",
]

log = logging.getLogger(__name__)

# Python 3.11+: a cancellation we caused can be told from the owner's (Task.uncancel); 3.10 has no counter, and a
# swallowed cancellation there is the owner's only when it cancels in the same instant
_UNCANCEL = hasattr(asyncio.Task, "uncancel")

BodyFn = Callable[[int, str], "bytes | None"]  # (attempt, server url) -> body; None: nothing left to ask


class ServerPool(HealthWatch):
    """The servers, their states, and the HTTP machinery. Bound to the event loop that first uses it.

    At most `max_connections` routed requests are on the wire at once; the rest wait in the pool, uncounted by the
    router. Probes and admin calls never wait behind them.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 3600,
        max_retries: int = 3,
        backoff_s: float = 0.2,
        probe_interval_s: float = 1.0,
        max_connections: int = 1024,
        unavailable_timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        health_timeout_s: float = 10.0,
        max_health_failures: int = 2,
        weight_load_timeout_s: float = 600.0,
    ):
        self.router = Router(urls)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.probe_interval_s = probe_interval_s
        self.max_connections = max_connections
        self.unavailable_timeout_s = unavailable_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health_timeout_s = health_timeout_s
        self.max_health_failures = max_health_failures
        # weight loads are not watched by the heartbeat (see the module docstring): this bounds them instead
        self.weight_load_timeout_s = weight_load_timeout_s
        # runs after /health answers and before a server returns to rotation; False: not yet, probe again later
        self.ready_check: Callable[[ServerState], Awaitable[bool]] | None = None
        # set while the client holds the fleet paused: SGLang's /health is a one-token generation that waits for
        # /continue_generation (503 after 20 s), so a paused server would look hung to the heartbeat
        self.probes_paused = False
        self.closed = False
        self.counts = {
            "requests": 0,
            "retries": 0,
            "failovers": 0,
            "errors": 0,
            "servers_lost": 0,
            "servers_recovered": 0,
            "rewritten_requests": 0,  # written again on a new connection: the kept-alive one was closed (http_exchange)
        }
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._any_healthy = asyncio.Event()
        self._any_healthy.set()
        self._exchanges: dict[str, set[asyncio.Task]] = {}  # url -> tasks awaiting an exchange with it
        self._lost_cancels: dict[asyncio.Task, str] = {}  # tasks we cancelled because their server left, and why
        self._recovery: dict[str, asyncio.Task] = {}
        self._probing: set[str] = set()  # heartbeat probes in flight
        self._detecting: dict[str, asyncio.Future] = {}  # url -> its dialect detection in flight
        self._heartbeat: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    def session(self) -> aiohttp.ClientSession:
        """The shared session, made on first use inside the running loop (with the heartbeat)."""
        if self.closed:
            raise InferenceError("InferenceClient is closed")
        loop = asyncio.get_running_loop()
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            # no connector limit: routed requests are capped by `_slots`, so admin calls and probes never queue
            # behind thousands of generations waiting for a connection
            # idle connections closed before the servers close them: SGLang's and vLLM's uvicorn drop a connection
            # idle for 5 s, and a request written onto one they just closed fails (a lost server, wrongly)
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S, ttl_dns_cache=300
            )
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
            # no cookie jar: SGLang sets no cookies, and a real jar costs a cookie filter + parse per request
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=timeout, headers=headers, cookie_jar=aiohttp.DummyCookieJar()
            )
            self._slots = asyncio.Semaphore(self.max_connections)
            self._loop = loop
            self._heartbeat = loop.create_task(self._heartbeat_loop())
            for s in self.router.servers.values():  # servers added before the loop existed
                if s.state in ("down", "syncing"):
                    self._start_recovery(s)
        elif loop is not self._loop:
            raise InferenceError("InferenceClient is bound to the event loop that first used it")
        return self._session

    async def close(self) -> None:
        """Stop probes and background tasks, wake every waiter (they raise), close the session."""
        if self.closed:
            return
        self.closed = True
        self._any_healthy.set()
        tasks = [*self._recovery.values(), *self._background]
        if self._heartbeat is not None:
            tasks.append(self._heartbeat)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run `coro` in the background; cancelled by close()."""
        t = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    @property
    def urls(self) -> list[str]:
        return list(self.router.servers)

    # ---- one HTTP exchange --------------------------------------------------------------------------------------

    async def send(
        self,
        server: ServerState,
        method: str,
        path: str,
        body: bytes | None,
        *,
        timeout: aiohttp.ClientTimeout | None = None,
        on_event: EventSink | None = None,
        routed: bool = False,
        probe: bool = False,
    ) -> tuple[int, bytes]:
        """(status, body) of one request, or `ConnectionFailed` if the server cannot be reached, drops us, or leaves
        rotation meanwhile. With `on_event`, a 200 `text/event-stream` answer is read event by event (each `data:`
        payload goes to `on_event`) and (200, b"") comes back after `[DONE]`; a stream cut before `[DONE]` is a
        `ConnectionFailed`. `routed` requests count as outstanding on the server (the router balances on it);
        every request but a `probe` makes the heartbeat watch the server while it is in flight.

        How an exchange ends when its server leaves rotation: the task awaiting it is registered under the server
        and cancelled (`_end_exchanges`), and the cancellation is turned into `ConnectionFailed` here, unless the
        task was also cancelled by its owner. No extra task per request (thousands are in flight).
        """
        session = self.session()
        if routed:
            server.outstanding += 1
            server.num_requests += 1
        if not probe:
            server.exchanges += 1
        task = asyncio.current_task()
        assert task is not None
        registry = self._exchanges.setdefault(server.url, set())
        registry.add(task)
        try:
            dialect = server.dialect or await self._detect(session, server)

            def raw(m: str, p: str, b: bytes | None, ev: EventSink | None) -> Awaitable[tuple[int, bytes]]:
                return self._exchange(session, server, m, p, b, timeout, ev)

            return await dialect.call(raw, method, path, body, on_event)
        except asyncio.CancelledError:
            why = self._lost_cancels.pop(task, None)
            if why is None or (_UNCANCEL and task.uncancel() > 0):  # not ours, or its owner cancelled it too
                raise
            raise ConnectionFailed(f"{server.url}{path}: server taken out of rotation ({why})") from None
        finally:
            registry.discard(task)
            self._lost_cancels.pop(task, None)
            if routed:
                server.outstanding -= 1
            if not probe:
                server.exchanges -= 1

    async def _detect(self, session: aiohttp.ClientSession, server: ServerState) -> Dialect:
        """The server's dialect, asked once per server process (engines.py); concurrent first requests share one
        detection. A server that cannot say yet (starting, unreachable) is spoken to as it is for this exchange and
        asked again at the next one."""
        pending = self._detecting.get(server.url)
        if pending is None:

            def raw(m: str, p: str, b: bytes | None, ev: EventSink | None) -> Awaitable[tuple[int, bytes]]:
                return self._exchange(session, server, m, p, b, self.probe_timeout(), ev)

            pending = self._detecting[server.url] = asyncio.ensure_future(detect(raw))
            pending.add_done_callback(lambda _f, url=server.url: self._detecting.pop(url, None))
        try:
            found = await asyncio.shield(pending)
        except (ConnectionFailed, InferenceError):
            found = None
        if found is None:
            return Dialect()
        if server.dialect is None:
            server.dialect = found
            said = bool(found.info.get("incremental_streaming_output"))
            server.incremental_stream = said if found.incremental_stream is None else found.incremental_stream
            log.info("inference server %s speaks %r", server.url, found)
        return server.dialect

    def _end_exchanges(self, url: str, why: str) -> None:
        """End every exchange in flight with `url` (see `send`)."""
        for task in list(self._exchanges.get(url, ())):
            if task not in self._lost_cancels and not task.done():
                self._lost_cancels[task] = why
                task.cancel()

    async def _exchange(
        self,
        session: aiohttp.ClientSession,
        server: ServerState,
        method: str,
        path: str,
        body: bytes | None,
        timeout: aiohttp.ClientTimeout | None,
        on_event: EventSink | None,
    ) -> tuple[int, bytes]:
        return await exchange(session, server, method, path, body, timeout or self.timeout_s, on_event, self.counts)

    # ---- server states ------------------------------------------------------------------------------------------

    def server_failed(self, server: ServerState, why: str) -> None:
        """Take a server out of rotation, end the exchanges in flight on it, and start probing it."""
        server.num_failures += 1
        server.health_failures = 0
        server.incremental_stream = None  # it may come back as another process, with other settings
        if server.url not in self.router.servers:
            return
        if server.state == "serving":
            self.counts["servers_lost"] += 1
            log.warning("inference server %s taken out of rotation: %s", server.url, why)
        if server.state != "draining":
            self.router.set_state(server.url, "down")
        self._end_exchanges(server.url, why)
        if not self.router.healthy():
            self._any_healthy.clear()
        if server.state != "draining":
            self._start_recovery(server)

    def needs_sync(self, server: ServerState, why: str) -> None:
        """Reachable but not holding the right weights: out of rotation until `ready_check` says it does."""
        if server.url not in self.router.servers or server.state in ("down", "draining"):
            return
        if server.state == "serving":
            log.warning("inference server %s out of rotation until it holds the current weights: %s", server.url, why)
        self.router.set_state(server.url, "syncing")
        if not self.router.healthy():
            self._any_healthy.clear()
        self._start_recovery(server)

    # ---- membership ---------------------------------------------------------------------------------------------

    def add(self, url: str) -> ServerState:
        """A new server: out of rotation until /health answers and `ready_check` passes."""
        s = self.router.add(url, "down")
        if self._session is not None:
            self._start_recovery(s)
        return s

    async def remove(self, url: str, drain_timeout_s: float | None = 0.0) -> None:
        """Stop routing to `url`; wait up to `drain_timeout_s` (None: forever) for its requests to finish, then end
        the rest (they fail over, keeping their tokens so far) and forget the server."""
        url = url.rstrip("/")
        server = self.router.servers.get(url)
        if server is None:
            raise KeyError(f"unknown server {url!r}")
        if len(self.router.servers) == 1:
            raise ValueError("cannot remove the last server")
        self.router.set_state(url, "draining")
        t = self._recovery.pop(url, None)
        if t is not None:
            t.cancel()
        if not self.router.healthy():
            self._any_healthy.clear()
        deadline = None if drain_timeout_s is None else time.monotonic() + drain_timeout_s
        while server.outstanding > 0 and (deadline is None or time.monotonic() < deadline) and not self.closed:
            await asyncio.sleep(0.01)
        self.router.remove(url)
        self._end_exchanges(url, "removed from the pool")
        self._exchanges.pop(url, None)
        log.warning("inference server %s removed from the pool", url)

    # ---- routed requests ----------------------------------------------------------------------------------------

    async def _wait_for_healthy(self, deadline: float, last_err: BaseException | None) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise InferenceError(
                f"no healthy inference server among {self.urls} for "
                f"{self.unavailable_timeout_s:g}s; last error: {last_err}"
            )
        try:
            await asyncio.wait_for(self._any_healthy.wait(), remaining)
        except TimeoutError:
            pass
        if self.closed:
            raise InferenceError("InferenceClient is closed")

    async def routed(
        self,
        method: str,
        path: str,
        make_body: BodyFn,
        session_key: str | None = None,
        *,
        on_event: EventSink | None = None,
        progress: Callable[[], int] | None = None,
    ) -> tuple[bytes, ServerState | None]:
        """One logical request with routing, retries, failover and waiting out a full outage.

        `make_body(attempt, url)` builds the body per attempt: generation gives each attempt its own rid (a retry never
        collides with a request the dead server may still be running) and its prompt + tokens so far; None means
        nothing is left to ask, and (b"", None) comes back. `progress()` counts what the request has received so
        far (streamed tokens): a failure after progress does not count against `max_retries`.
        """
        self.counts["requests"] += 1
        self.session()  # the session and its slot semaphore exist from here on
        slots = self._slots
        assert slots is not None
        failures = 0
        attempt = 0
        tried: list[str] = []
        last_err: BaseException | None = None
        deadline: float | None = None
        while True:
            sent = await self._send_one(slots, method, path, make_body, session_key, tried, attempt, on_event, progress)
            if sent is None:  # no healthy server: wait for one, up to unavailable_timeout_s
                if deadline is None:
                    deadline = time.monotonic() + self.unavailable_timeout_s
                await self._wait_for_healthy(deadline, last_err)
                continue
            server, answer, before = sent
            if answer is None:
                return b"", None
            attempt += 1
            deadline = None
            if isinstance(answer, tuple) and answer[0] == 200:
                return answer[1], server
            last_err = self._failed_attempt(server, path, answer)
            if progress is not None and progress() > before:
                failures = 0  # it got somewhere: a request that outlives several servers is not failing
            failures += 1
            if failures > self.max_retries:
                self.counts["errors"] += 1
                raise InferenceError(f"{method} {path} failed after {failures} attempts: {last_err}") from last_err
            self.counts["retries"] += 1
            tried.append(server.url)
            if not any(s.url not in tried for s in self.router.healthy()):  # nowhere new to go: back off first
                await asyncio.sleep(self.backoff_s * 2 ** (failures - 1) * (0.5 + random.random()))

    async def _send_one(
        self,
        slots: asyncio.Semaphore,
        method: str,
        path: str,
        make_body: BodyFn,
        session_key: str | None,
        tried: list[str],
        attempt: int,
        on_event: EventSink | None,
        progress: Callable[[], int] | None,
    ) -> tuple[ServerState, tuple[int, bytes] | BaseException | None, int] | None:
        """One attempt of `routed`: None when no server is healthy, else (the server picked, its answer: (status,
        data), the ConnectionFailed or StreamError it raised, or None when `make_body` has nothing left to ask,
        `progress()` before the attempt)."""
        # a slot first, then the server: a request waiting for a connection holds no aiohttp state, and the
        # least-outstanding choice is made with the load at the moment the request actually goes out
        await slots.acquire()
        try:
            server = self.router.pick(session_key, tried)
            if server is None:
                return None
            body = make_body(attempt, server.url)
            if body is None:
                return server, None, 0
            if tried and server.url not in tried:
                self.counts["failovers"] += 1
            before = progress() if progress is not None else 0
            try:
                answer: tuple[int, bytes] | BaseException = await self.send(
                    server, method, path, body, on_event=on_event, routed=True
                )
            except (ConnectionFailed, StreamError) as e:
                answer = e
            return server, answer, before
        finally:
            slots.release()

    def _failed_attempt(
        self, server: ServerState, path: str, answer: tuple[int, bytes] | BaseException
    ) -> InferenceError | ConnectionFailed:
        """Book a failed attempt against `server` and return its error, or raise it when retrying cannot help
        (a client error: the request itself is wrong)."""
        if isinstance(answer, ConnectionFailed):
            self.server_failed(server, str(answer))
            return answer
        if isinstance(answer, StreamError):
            err = InferenceError(f"{server.url}{path}: error in stream: {answer}", status=answer.status, url=server.url)
            if not 500 <= answer.status < 600 and answer.status != 429:
                self.counts["errors"] += 1
                raise err
            server.num_failures += 1
            return err
        assert isinstance(answer, tuple)
        status, data = answer
        msg = error_message(data)
        err = InferenceError(f"{server.url}{path} -> HTTP {status}: {msg}", status=status, url=server.url)
        if status not in RETRY_STATUS:
            self.counts["errors"] += 1
            raise err
        if status in DOWN_STATUS:
            self.server_failed(server, f"HTTP {status}")
        else:
            server.num_failures += 1
        return err

    # ---- admin fan-out ------------------------------------------------------------------------------------------

    async def fanout(
        self,
        method: str,
        path: str,
        payload: dict | Callable[[int, str], dict] | None = None,
        *,
        servers: list[ServerState] | None = None,
        check_success: bool = False,
        timeout: aiohttp.ClientTimeout | None = None,
        admin: bool = False,
    ) -> dict[str, Any]:
        """Send to `servers` (default: every known server, in any state) at once. Returns url -> decoded answer,
        or the exception. `check_success`: a 200 answer with `"success": false` is an `InferenceError` too.
        `admin`: the call counts as an admin operation on each server (the heartbeat leaves it alone meanwhile:
        pause, continue and group calls may legitimately keep a server from answering /health)."""
        enc = msgspec.json.encode

        async def one(i: int, server: ServerState) -> Any:
            p = payload(i, server.url) if callable(payload) else payload
            body = None if p is None else enc(p)
            if admin:
                server.admin_ops += 1
            try:
                status, data = await self.send(server, method, path, body, timeout=timeout)
            except ConnectionFailed as e:
                if server.state in ("serving", "syncing", "draining"):
                    self.server_failed(server, str(e))
                raise InferenceError(str(e), url=server.url) from e
            finally:
                if admin:
                    server.admin_ops -= 1
            if status != 200:
                raise InferenceError(
                    f"{server.url}{path} -> HTTP {status}: {error_message(data)}", status=status, url=server.url
                )
            try:
                out = msgspec.json.decode(data) if data else None
            except msgspec.DecodeError:
                out = data.decode("utf-8", "replace")
            if check_success and isinstance(out, dict) and out.get("success") is False:
                raise InferenceError(f"{server.url}{path}: {out.get('message', 'failed')}", url=server.url)
            return out

        targets = list(self.router.servers.values()) if servers is None else servers
        results = await asyncio.gather(*(one(i, s) for i, s in enumerate(targets)), return_exceptions=True)
        for r in results:  # a cancelled caller must not be swallowed as a per-server failure
            if isinstance(r, asyncio.CancelledError):
                raise r
        return {s.url: r for s, r in zip(targets, results)}

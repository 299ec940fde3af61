"""Which weights each server holds, and keeping every server in rotation on the current ones.

The rule: a server serves only while it holds the current `WeightTarget` (the version last published and where to
load it from); one that fails a load, misses a broadcast or comes back on other weights stays out until it loads
the target. What each kind of update does to servers that fail it is in docs/inference.md, "Weights across the
fleet". No torch here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import aiohttp
import msgspec

from areal_async.inference.dialect import parse_release
from areal_async.inference.routing import ServerState
from areal_async.inference.transport import AdminError, ConnectionFailed, InferenceError, ServerPool, error_message

log = logging.getLogger(__name__)

WeightSource = Callable[[int], Awaitable[str]]  # version -> an HF checkpoint directory holding that version


class WeightTarget(NamedTuple):
    """The weights every serving server must hold."""

    version: int
    path: str | None  # an HF checkpoint directory the client can load; None: broadcast, or never loaded
    launch: bool = False  # the launch weights relabelled: a restarted server holds them already


_warned_versions: set = set()  # labels already warned about, once per process


def parse_weight_version(v: Any) -> int:
    """SGLang reports `weight_version` as a string. Ours are integers (train steps). SGLang's initial value is
    "default", meaning weights loaded at launch and never updated: that is version 0. Any other non-integer label
    (set by someone else) is also read as 0, with a warning, rather than failing a whole rollout over a label."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if v is None or v == "" or v == "default":
        return 0
    try:
        return int(str(v).strip())
    except ValueError:
        if v not in _warned_versions:
            _warned_versions.add(v)
            log.warning("non-integer weight_version %r read as version 0", v)
        return 0


# SGLang releases whose /pause_generation reads its body (`mode`); before, every pause aborts. pyproject pins 0.5.6.
IN_PLACE_MIN_SGLANG = (0, 5, 6)


def sglang_version(info: dict) -> tuple[int, ...] | None:
    """The SGLang release a /get_server_info answer reports (its `version` field), as integers; None for our
    embedded server (its answer carries `api_key_required`, a field SGLang's ServerArgs does not have) and for an
    answer without a readable version."""
    if not isinstance(info, dict) or "api_key_required" in info:
        return None
    return parse_release(info.get("version"))


def in_place_supported(info: dict) -> bool:
    """False only for a server known to be an SGLang older than IN_PLACE_MIN_SGLANG, or one whose radix cache is
    on: requests that run across an in-place update keep their old-weight KV, and SGLang's radix cache would hand
    it to new requests with the same prefix (a flush is refused while they run)."""
    v = sglang_version(info)
    return v is None or (v >= IN_PLACE_MIN_SGLANG and info.get("disable_radix_cache", True) is not False)


class Fleet:
    """The weight side of a `ServerPool`; installs itself as the pool's `ready_check`."""

    def __init__(self, pool: ServerPool, *, on_ready: Callable[[ServerState], Awaitable[None]] | None = None):
        self.pool = pool
        self.target: WeightTarget | None = None  # None: nothing loaded since launch, any server is current
        self.weight_source: WeightSource | None = None
        self.on_ready = on_ready  # runs before a caught-up server returns to rotation (the client un-pauses it)
        self.counts = {"weight_load_failures": 0, "catch_ups": 0}
        self._locks: dict[str, asyncio.Lock] = {}
        self._warned_stuck: set[str] = set()
        # url -> version whose label that server carries without holding all of its weights (a failed bucket of a
        # broadcast relabels the buckets it did receive): its /model_info cannot be trusted for that version
        self._tainted: dict[str, int] = {}
        # servers that failed a bucket of the broadcast in progress (buckets before the last carry no version)
        self._partial_failed: set[str] = set()
        pool.ready_check = self.ready

    def _lock(self, url: str) -> asyncio.Lock:
        lock = self._locks.get(url)
        if lock is None:
            lock = self._locks[url] = asyncio.Lock()
        return lock

    def reachable(self) -> list[ServerState]:
        """Servers an update should go to now: every one that is not down (down ones catch up on return)."""
        return [s for s in self.pool.router.servers.values() if s.state != "down"]

    # ---- one server ---------------------------------------------------------------------------------------------

    # where a server reports its weight version: the current name, SGLang's older name, and the narrow endpoint
    VERSION_PATHS = ("/model_info", "/get_model_info", "/get_weight_version")

    async def server_version(self, server: ServerState) -> int | None:
        """The version a server reports (None when it does not say): GET /model_info, else (404: an older SGLang)
        /get_model_info, else /get_weight_version. Without the fallbacks an older server would read as "unknown"
        at every recovery and be reloaded or relabelled each time."""
        for path in self.VERSION_PATHS:
            status, body = await self.pool.send(server, "GET", path, None, timeout=self.pool.probe_timeout())
            if status in (404, 405):
                continue
            if status != 200:
                return None
            try:
                info = msgspec.json.decode(body)
            except msgspec.DecodeError:
                return None
            if not isinstance(info, dict) or "weight_version" not in info:
                return None
            return parse_weight_version(info["weight_version"])
        return None

    async def _post(self, server: ServerState, path: str, payload: dict) -> tuple[bool, str]:
        """One weight call on one server (counted as a weight load: the heartbeat leaves it alone meanwhile)."""
        server.admin_ops += 1
        try:
            status, body = await self.pool.send(
                server,
                "POST",
                path,
                msgspec.json.encode(payload),
                timeout=aiohttp.ClientTimeout(total=self.pool.weight_load_timeout_s),
            )
        finally:
            server.admin_ops -= 1
        if status != 200:
            return False, f"HTTP {status}: {error_message(body)}"
        try:
            out = msgspec.json.decode(body) if body else {}
        except msgspec.DecodeError:
            out = {}
        if isinstance(out, dict) and out.get("success") is False:
            return False, str(out.get("message", "failed"))
        return True, ""

    async def ready(self, server: ServerState) -> bool:
        """The pool's `ready_check`: True once `server` holds the current weights (loading them if it can)."""
        async with self._lock(server.url):
            target = self.target
            if target is None:
                ok = True
            else:
                ok = await self._catch_up(server, target)
            if ok and self.on_ready is not None:
                await self.on_ready(server)
            return ok

    async def _catch_up(self, server: ServerState, target: WeightTarget) -> bool:
        have = await self.server_version(server)
        if have == target.version and self._tainted.get(server.url) != target.version:
            server.version = have
            return True
        if target.launch:  # the current weights are the launch weights under a new label
            ok, why = await self._post(
                server, "/update_weight_version", {"new_version": str(target.version), "abort_all_requests": False}
            )
        else:
            path = target.path
            if path is None and self.weight_source is not None:
                try:
                    path = await self.weight_source(target.version)
                except Exception as e:  # the hook's failure keeps the server out, like a failed load
                    self.counts["weight_load_failures"] += 1
                    log.warning(
                        "inference server %s: weight_source(%d) failed: %s: %s",
                        server.url,
                        target.version,
                        type(e).__name__,
                        e,
                    )
                    return False
                if self.target == target:  # later catch-ups of this version load the same checkpoint
                    self.target = target = target._replace(path=path)
            if path is None:
                if server.url not in self._warned_stuck:
                    self._warned_stuck.add(server.url)
                    log.warning(
                        "inference server %s holds version %s, not %d, and the current weights came by "
                        "broadcast: it stays out of rotation until load_weights() brings it to version %d "
                        "or a weight_source is set",
                        server.url,
                        have,
                        target.version,
                        target.version,
                    )
                return False
            ok, why = await self._post(
                server,
                "/update_weights_from_disk",
                {
                    "model_path": path,
                    "weight_version": str(target.version),
                    "abort_all_requests": False,
                    "flush_cache": True,
                },
            )
        if not ok:
            self.counts["weight_load_failures"] += 1
            log.warning(
                "inference server %s failed to catch up to weight version %d: %s", server.url, target.version, why
            )
            return False
        if self.target != target:  # an update landed meanwhile: check again against the new target
            return await self._catch_up(server, self.target) if self.target is not None else True
        server.version = target.version
        self.counts["catch_ups"] += 1
        self._warned_stuck.discard(server.url)
        self._tainted.pop(server.url, None)
        log.warning("inference server %s caught up to weight version %d", server.url, target.version)
        return True

    async def load_one(self, url: str, path: str, version: int) -> None:
        """Load the checkpoint at `path` as `version` into one server (a restarted one, before it takes traffic).
        When that is the current version the server returns to rotation (after a /health check); raises
        `InferenceError` if the load fails."""
        server = self.pool.router.servers.get(url.rstrip("/"))
        if server is None:
            raise KeyError(f"unknown server {url!r}")
        async with self._lock(server.url):
            try:
                ok, why = await self._post(
                    server,
                    "/update_weights_from_disk",
                    {
                        "model_path": path,
                        "weight_version": str(version),
                        "abort_all_requests": False,
                        "flush_cache": True,
                    },
                )
            except ConnectionFailed as e:
                raise InferenceError(str(e), url=server.url) from e
            if not ok:  # the server keeps the weights it had
                self.counts["weight_load_failures"] += 1
                raise InferenceError(f"{server.url}: loading {path} failed: {why}", url=server.url)
            server.version = version
            self._tainted.pop(server.url, None)
            current = self.target is None or version == self.target.version
            if self.target is not None and current and self.target.path is None:
                self.target = self.target._replace(path=path)  # other servers can catch up from it too
        if current:
            if server.state in ("down", "syncing"):
                await self.pool.try_admit(server)
        elif server.state == "serving":
            self.pool.needs_sync(server, f"loaded version {version}, not the current {self.target.version}")

    # ---- the whole fleet ----------------------------------------------------------------------------------------

    async def _fan(self, servers: list[ServerState], path: str, payload: dict) -> dict[str, Any]:
        async def one(server: ServerState) -> Any:
            async with self._lock(server.url):
                try:
                    ok, why = await self._post(server, path, payload)
                except ConnectionFailed as e:
                    if server.state != "down":
                        self.pool.server_failed(server, str(e))
                    raise InferenceError(str(e), url=server.url) from e
                if not ok:
                    raise InferenceError(f"{server.url}{path}: {why}", url=server.url)
                return {"success": True}

        results = await asyncio.gather(*(one(s) for s in servers), return_exceptions=True)
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
        return {s.url: r for s, r in zip(servers, results)}

    def _settle(
        self, what: str, servers: list[ServerState], results: dict[str, Any], version: int, *, taints: bool = False
    ) -> None:
        """Servers that took the update hold `version`; the others leave rotation until they catch up (with
        `taints`, a failure also means the server's label can no longer be trusted for `version`)."""
        for s in servers:
            r = results[s.url]
            if isinstance(r, BaseException):
                self.counts["weight_load_failures"] += 1
                if taints:
                    self._tainted[s.url] = version
                self.pool.needs_sync(s, f"{what} to version {version} failed: {r}")
            elif self._tainted.get(s.url) != version:
                self._tainted.pop(s.url, None)
                s.version = version
                if s.state == "syncing":  # it was catching up and now holds the current weights
                    self.pool.spawn(self.pool.try_admit(s))

    async def update_from_disk(
        self, path: str, version: int, *, flush_cache: bool, abort_all_requests: bool
    ) -> dict[str, Any]:
        servers = self.reachable()
        previous = self.target
        self.target = WeightTarget(version, path)
        payload = {
            "model_path": path,
            "weight_version": str(version),
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        results = await self._fan(servers, "/update_weights_from_disk", payload)
        if servers and all(isinstance(r, BaseException) for r in results.values()):
            self.target = previous  # nobody took it: every server still holds what it held
            self.counts["weight_load_failures"] += len(servers)
            detail = "; ".join(f"{u}: {r}" for u, r in results.items())
            raise AdminError(f"update_weights_from_disk failed on every server: {detail}", results)
        self._settle("update_weights_from_disk", servers, results, version)
        return results

    async def relabel(self, version: int, *, abort_all_requests: bool) -> dict[str, Any]:
        target = self.target
        if target is None:
            servers = self.reachable()
        else:  # only servers known to hold the current weights get the new label
            servers = [s for s in self.reachable() if s.state != "syncing" and s.version == target.version]
        payload = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        self.target = WeightTarget(version, target.path if target else None, target.launch if target else True)
        results = await self._fan(servers, "/update_weight_version", payload)
        self._settle("update_weight_version", servers, results, version)
        return results

    async def distributed(self, payload: dict, version: int | None, urls: list[str] | None = None) -> dict[str, Any]:
        """One bucket of a broadcast. Buckets before the last carry no version (`None`): nothing is relabelled yet,
        and a server that fails one is remembered and treated as failed (tainted) when the last bucket settles.

        `urls`: the group's members. Every member must get every bucket, also one marked down meanwhile (its call
        then fails fast), because the trainer broadcasts to the whole group; a member skipped would leave the
        trainer's broadcast waiting. None: every reachable server (a group of the whole fleet)."""
        if urls is None:
            servers = self.reachable()
        else:
            servers = [
                self.pool.router.servers[u.rstrip("/")] for u in urls if u.rstrip("/") in self.pool.router.servers
            ]
        results = await self._fan(servers, "/update_weights_from_distributed", payload)
        if servers and all(isinstance(r, BaseException) for r in results.values()):
            detail = "; ".join(f"{u}: {r}" for u, r in results.items())
            raise AdminError(f"update_weights_from_distributed failed on every server: {detail}", results)
        if version is None:
            self._partial_failed.update(u for u, r in results.items() if isinstance(r, BaseException))
            return results
        if self.target is None or self.target.version != version or self.target.path is not None:
            self.target = WeightTarget(version, None)
        failed_earlier, self._partial_failed = self._partial_failed, set()
        for url in failed_earlier:  # holds a mix of versions whatever the last bucket did
            if url in results and not isinstance(results[url], BaseException):
                results[url] = AdminError(f"{url}: an earlier bucket of this broadcast failed", {})
        self._settle("update_weights_from_distributed", servers, results, version, taints=True)
        return results

    def abandon_distributed(self, errors: dict[str, BaseException]) -> None:
        """A broadcast stopped part-way for these servers (url -> why; a member that failed a bucket, or one whose
        receive loop ended when the update was aborted): they never get the last bucket, which is what settles a
        broadcast, so they are settled here. Each holds some buckets of the new version under its old label, so
        the label is tainted for the version it reports (the current target's) and the server leaves rotation
        until it holds the current weights (a later broadcast, `load_weights`, or the `weight_source` hook)."""
        if not errors:
            return
        if self.target is None:  # "any server is current" would readmit them at once: their launch label is false
            self.target = WeightTarget(0, None)
        for url, why in errors.items():
            self._partial_failed.discard(url)
            server = self.pool.router.servers.get(url.rstrip("/"))
            if server is None:
                continue
            self.counts["weight_load_failures"] += 1
            self._tainted[server.url] = self.target.version
            self.pool.needs_sync(
                server, f"a weight broadcast stopped part-way for it ({why}); it holds a mix of versions"
            )

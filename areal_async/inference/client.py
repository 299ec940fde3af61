"""The controller's client for SGLang-protocol inference servers (real SGLang 0.5.x or the embedded server).

No torch here. `InferenceClient` is the facade over transport.py (the server pool), routing.py, resume.py
(interruptible generation), sglang_wire.py (the /generate wire), fleet.py (which weights each server holds) and
weight_groups.py (the trainer's broadcast groups), lora_window.py (SGLang's LoRA adapters); the errors are in errors.py.
How generations survive pauses and lost servers, and why `stream="auto"` streams only to servers with incremental
events, is in docs/inference.md; the measurements behind that choice are in benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal

import aiohttp
import msgspec

from areal_async.inference.errors import AdminError, ConnectionFailed, InferenceError, raise_if_failed
from areal_async.inference.fleet import (
    IN_PLACE_MIN_SGLANG,
    Fleet,
    WeightSource,
    WeightTarget,
    in_place_supported,
    parse_weight_version,
)
from areal_async.inference.identity import IdentityGate, Verdict, held_combined
from areal_async.inference.lora_window import AdapterPin, LoRAAdapters
from areal_async.inference.resume import ResumeState, SegmentEnd, SegmentRejected, find_stop, generate_resumable
from areal_async.inference.routing import ServerState
from areal_async.inference.sglang_wire import SegmentReader, segment_payload
from areal_async.inference.transport import ServerPool
from areal_async.inference.weight_groups import WeightGroups
from areal_async.protocol.weight_identity import Identity
from areal_async.types import GenerationResult, SamplingParams

__all__ = [
    "AdminError",
    "InferenceClient",
    "InferenceError",
    "PauseMode",
    "WeightTarget",
    "find_stop",
    "parse_weight_version",
]

PauseMode = Literal["abort", "retract", "in_place"]


class InferenceClient(WeightGroups, LoRAAdapters):
    """Drives one or more SGLang-protocol servers. Use `async with InferenceClient(urls) as c:` or `await close()`.

    Bound to the event loop that first uses it (aiohttp sessions are). Safe for thousands of concurrent
    `agenerate` calls; admin calls fan out to every reachable server concurrently. At most `max_connections`
    generations (and raw completions) are on the wire at once; the rest wait in the client, and admin calls
    (pause, resume, abort, health, weight updates) never wait behind them. For N rollouts in flight, set
    `max_connections` >= N or the servers see only `max_connections` of them.

    Hang detection: a server with requests in flight gets GET /health every `probe_interval_s`; after
    `max_health_failures` probes in a row unanswered within `health_timeout_s` it is taken out and its requests
    move on. `timeout_s` bounds one exchange (one generation segment, or one admin call); a weight load on one
    server is bounded by `weight_load_timeout_s` (the heartbeat leaves loading servers alone).
    """

    def __init__(
        self,
        urls: list[str] | str,
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
        stream: bool | Literal["auto"] = "auto",
    ):
        if stream not in (True, False, "auto"):
            raise ValueError(f"stream must be True, False or 'auto', got {stream!r}")
        if isinstance(urls, str):
            urls = [urls]
        self._pool = ServerPool(
            [u.rstrip("/") for u in urls],
            api_key=api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            probe_interval_s=probe_interval_s,
            max_connections=max_connections,
            unavailable_timeout_s=unavailable_timeout_s,
            connect_timeout_s=connect_timeout_s,
            health_timeout_s=health_timeout_s,
            max_health_failures=max_health_failures,
            weight_load_timeout_s=weight_load_timeout_s,
        )
        self._fleet = Fleet(self._pool, on_ready=self._align_pause)
        self._identity = IdentityGate(self._pool, self._taint)
        self._pool.ready_check = self._identity.wrap(self._fleet.ready)  # a server that comes back is checked too
        self.api_key = api_key
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.stream = stream
        self._resumed = asyncio.Event()  # cleared by pause(), set by resume(): interrupted requests wait on it
        self._resumed.set()
        self._pause_mode: PauseMode = "abort"
        self._active: dict[str, bool] = {}  # rid -> cancelled by abort()
        # rid -> the rid of its segment on a server now: SGLang aborts by exact rid (TokenizerManager.abort_request
        # returns early for an rid it does not know), and a resubmission runs under "{rid}-{n}"
        self._segment_rid: dict[str, str] = {}
        self._in_place_ok: dict[str, bool] = {}  # url -> its /get_server_info allows pause(mode="in_place")
        self._enc = msgspec.json.Encoder()
        # tokens: received from servers; failover_kept_tokens: received in an attempt that then failed and kept
        # for its resubmission (only streaming can keep them: see docs/inference.md)
        self._counts = {"tokens": 0, "interruptions": 0, "failover_kept_tokens": 0}
        self._groups: dict[str, list[str]] = {}  # weight-update groups this client formed -> the servers in them

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    async def __aenter__(self) -> InferenceClient:
        self._pool.session()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self, *, group_timeout_s: float = 10.0) -> None:
        """Leave the weight-update groups this client formed (POST /destroy_weights_update_group on their
        servers, so a persistent server can join a later run's group), stop probes and background aborts, wake
        every waiter (they raise), close the session."""
        if self._groups and not self._pool.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    asyncio.gather(*(self.destroy_weights_update_group(name) for name in list(self._groups))),
                    group_timeout_s,
                )
        self._resumed.set()
        await self._pool.close()

    @property
    def urls(self) -> list[str]:
        """Every server the client knows, in any state."""
        return self._pool.urls

    # ---- generation ---------------------------------------------------------------------------------------------

    def is_paused(self) -> bool:
        return not self._resumed.is_set()

    async def wait_resumed(self) -> None:
        await self._resumed.wait()
        if self._pool.closed:
            raise InferenceError("InferenceClient is closed")

    def cancelled(self, rid: str) -> bool:
        return self._active.get(rid, False)

    async def agenerate(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        session_key: str | None = None,
        return_text: bool = False,
        priority: int | None = None,
        on_segment: Callable[[ResumeState], None] | None = None,
    ) -> GenerationResult:
        """Generate one completion of `input_ids`, resuming across interruptions and lost servers until stop or
        length.

        `priority` (sent only when given): a larger one is queued ahead on the server; the embedded server always
        honours it, SGLang only with --enable-priority-scheduling.

        The result concatenates every segment; `output_versions[i]` is the weight version that produced token i.
        A client `abort(rid)` ends it early with finish_reason "abort" and the tokens so far. `text` (with
        `return_text`) joins the segments' texts; decode `output_ids` where exact text across boundaries matters.
        `on_segment(state)`: called with the tokens so far after each segment that brought some (resume.py).
        """
        if sampling.n != 1:
            raise ValueError("agenerate makes one completion; call it n times for n samples (each resumes alone)")
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        if sampling.max_new_tokens < 0 or sampling.min_new_tokens < 0:
            raise ValueError("max_new_tokens and min_new_tokens must be >= 0")
        rid = rid or uuid.uuid4().hex
        if rid in self._active:
            raise ValueError(f"rid {rid!r} is already in flight on this client")
        self._active[rid] = False
        state = ResumeState(rid, input_ids, sampling)
        base = sampling.to_sglang()
        sent = 0  # bodies sent, retries included: each gets its own rid
        pin: AdapterPin | None = None  # with adapters: the version every submission of it runs under

        async def submit(st: ResumeState) -> SegmentEnd | None:
            reader: SegmentReader | None = None

            def make_body(attempt: int, url: str) -> bytes | None:
                nonlocal sent, reader, pin
                if attempt > 0 and st.segment_starts:  # a retry: count what the failed attempt streamed to us
                    self._counts["failover_kept_tokens"] += len(st.out_ids) - st.segment_starts[-1]
                if self.cancelled(rid) or (st.segment_starts and st.remaining <= 0):
                    return None  # aborted by the caller, or every token arrived before the server was lost
                st.begin_segment()
                pin = self._adapter_pin(pin)  # its own adapter while loaded (lora_window.py)
                reader = SegmentReader(st, url, self._counts, pinned=None if pin is None else pin.version)
                # each body has its own rid (a server refuses an rid in flight); abort() sends the current one
                seg_rid = self._segment_rid[rid] = rid if sent == 0 else f"{rid}-{sent}"
                payload = segment_payload(st, seg_rid, base, stream=self._streams_to(url), priority=priority)
                if pin is not None and pin.name is not None:
                    payload["lora_path"] = pin.name  # SGLang: the adapter's name
                sent += 1
                return self._enc.encode(payload)

            def on_event(data: bytes) -> None:
                assert reader is not None
                reader.feed(data)

            data, server = await self._pool.routed(
                "POST",
                "/generate",
                make_body,
                session_key,
                on_event=on_event if self.stream is not False else None,
                progress=lambda: len(st.out_ids),
            )
            if server is None:
                return None
            assert reader is not None
            if data:  # the whole answer (not streamed, or a server that ignored `stream`)
                reader.feed(data)
            return reader.end()

        try:
            result = await generate_resumable(
                state,
                submit,
                self,
                return_text=return_text,
                max_idle_aborts=self.max_retries,
                backoff_s=self.backoff_s,
                on_segment=on_segment,
            )
        except SegmentRejected as e:
            raise InferenceError(f"{e.server}/generate aborted: {e}", status=e.status, url=e.server) from None
        except BaseException:  # cancelled or failed: a server may still be generating for nobody
            if not self._pool.closed:
                self._pool.spawn(self._abort_everywhere(self._segment_rid.get(rid, rid)))
            raise
        finally:
            self._active.pop(rid, None)
            self._segment_rid.pop(rid, None)
            self._counts["interruptions"] += state.interruptions
        return result

    def _streams_to(self, url: str) -> bool:
        """Stream to this server? With "auto", only once its dialect (detected at the first exchange, from
        /get_server_info) says its events are incremental; JSON until then."""
        if isinstance(self.stream, bool):
            return self.stream
        server = self._pool.router.servers.get(url)
        return bool(server is not None and server.incremental_stream)

    async def _abort_everywhere(self, rid: str) -> None:
        await self._pool.fanout("POST", "/abort_request", {"rid": rid, "abort_all": False}, servers=self._reachable())

    async def acompletion_raw(self, path: str, payload: dict, *, session_key: str | None = None) -> Any:
        """POST any JSON body (e.g. /v1/completions, /v1/chat/completions) with routing, retries and failover;
        returns the decoded JSON answer. No resumption: an OpenAI-style caller sees aborts as they are."""
        body = self._enc.encode(payload)
        data, _ = await self._pool.routed(
            "POST", path if path.startswith("/") else "/" + path, lambda _a, _u: body, session_key
        )
        return msgspec.json.decode(data)

    # ---- admin fan-out ------------------------------------------------------------------------------------------

    def _reachable(self) -> list[ServerState]:
        return self._fleet.reachable()

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> dict[str, Any]:
        """Abort `rid` or everything, on every reachable server. The matching `agenerate` calls return
        finish_reason "abort" with their tokens so far instead of resuming. For a request of this client the
        rid sent is that of its segment in flight (a resubmission runs as "{rid}-{n}"; SGLang matches rids
        exactly); the cancel flag set here keeps it from resubmitting again."""
        if abort_all:
            for k in self._active:
                self._active[k] = True
        elif rid is None:
            raise ValueError("give a rid or abort_all=True")
        elif rid in self._active:
            self._active[rid] = True
        sent = "" if abort_all or rid is None else self._segment_rid.get(rid, rid)
        return await self._pool.fanout(
            "POST", "/abort_request", {"rid": sent, "abort_all": abort_all}, servers=self._reachable()
        )

    async def pause(self, mode: PauseMode = "abort") -> dict[str, Any]:
        """Pause every reachable server. With "abort", in-flight requests come back with their partial tokens and
        the matching `agenerate` calls wait for `resume()` before resubmitting. The event is cleared before the
        servers are told, so no aborted answer can slip through as an abort from elsewhere."""
        if mode == "in_place":
            await self._check_in_place()
        self._resumed.clear()
        self._pool.probes_paused = True  # SGLang's /health waits for continue: no hang detection while paused
        self._pause_mode = mode
        return await self._pause_call("/pause_generation", {"mode": mode})

    async def resume(self) -> dict[str, Any]:
        """Continue every reachable server, then release the waiting `agenerate` calls (even if a server failed:
        a dead server must not hold the rollout hostage)."""
        try:
            return await self._pause_call("/continue_generation", {})
        finally:
            self._resumed.set()
            self._pool.probes_paused = False

    async def _pause_call(self, path: str, payload: dict) -> dict[str, Any]:
        """pause/continue on every reachable server. The heartbeat leaves these calls alone (while paused it does
        not probe at all: SGLang's /health waits for continue), so they carry their own bound: a server that
        does not answer within `max_health_failures` x `health_timeout_s` is hung, as the heartbeat would say."""
        pool = self._pool
        bound = aiohttp.ClientTimeout(total=pool.health_timeout_s * max(pool.max_health_failures, 1))
        servers = self._reachable()
        results = await pool.fanout("POST", path, payload, servers=servers, admin=True, timeout=bound)
        for server in servers:
            r = results.get(server.url)
            if (
                isinstance(r, InferenceError)
                and r.status is None
                and server.state in ("serving", "syncing", "draining")
            ):
                pool.server_failed(server, f"hung: {path} unanswered within {bound.total:g}s")
        return results

    async def _check_in_place(self) -> None:
        """Refuse pause(mode="in_place") on a server whose /get_server_info reports an SGLang version older than
        IN_PLACE_MIN_SGLANG: its pause_generation reads no body, so the mode is ignored and every request in
        flight would be aborted instead (silently). Asked once per server; a server that does not say is let be."""
        servers = [s for s in self._reachable() if s.url not in self._in_place_ok]
        if servers:
            infos = await self.server_info([s.url for s in servers])
            for url, info in infos.items():
                if isinstance(info, BaseException):
                    continue  # asked again at the next in-place pause
                self._in_place_ok[url] = in_place_supported(info)
        old = sorted(u for u, ok in self._in_place_ok.items() if not ok and u in self._pool.router.servers)
        if old:
            raise AdminError(
                f"pause(mode='in_place') needs SGLang >= {'.'.join(map(str, IN_PLACE_MIN_SGLANG))} started with "
                f"--disable-radix-cache (older ones abort every request; a radix cache would reuse old-weight KV): "
                f"{', '.join(old)} (set schedule.interrupt_mode=abort, or restart them so)",
                {},
            )

    @property
    def paused(self) -> bool:
        return self.is_paused()

    async def _align_pause(self, server: ServerState) -> None:
        """A server returning to rotation may have been paused when it went away (or not, when we pause now)."""
        if self.is_paused():
            await self._pool.send(server, "POST", "/pause_generation", self._enc.encode({"mode": self._pause_mode}))
        else:
            await self._pool.send(server, "POST", "/continue_generation", b"{}")

    async def update_weights_from_disk(
        self, path: str, version: int, *, flush_cache: bool = True, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """Every reachable server loads the HF checkpoint at `path` as weight version `version`.

        Servers that fail keep their old weights and leave rotation until they have loaded it (retried in the
        background); servers that are down load it when they come back. Returns url -> answer or exception.
        Raises `AdminError` only when every reachable server failed: then nothing changed anywhere."""
        return await self._fleet.update_from_disk(
            path, version, flush_cache=flush_cache, abort_all_requests=abort_all_requests
        )

    async def update_weight_version(self, version: int, *, abort_all_requests: bool = False) -> dict[str, Any]:
        """Relabel the current weights (after an update made by other means). Servers that do not hold them are
        not relabelled: they catch up first, under the new label."""
        return raise_if_failed(
            "update_weight_version", await self._fleet.relabel(version, abort_all_requests=abort_all_requests)
        )

    async def server_info(self, urls: list[str] | None = None) -> dict[str, Any]:
        """GET /get_server_info (SGLang: its ServerArgs, e.g. tp_size, dp_size, plus scheduler state) from
        `urls` (default: every server). Returns url -> dict or exception."""
        targets = [self._pool.router.servers[u.rstrip("/")] for u in (self.urls if urls is None else urls)]
        results = await self._pool.fanout(
            "GET", "/get_server_info", servers=targets, timeout=self._pool.probe_timeout()
        )
        for url, r in results.items():  # servers that only know the newer name
            if isinstance(r, InferenceError) and r.status == 404:
                try:
                    status, data = await self._pool.send(
                        self._pool.router.servers[url], "GET", "/server_info", None, timeout=self._pool.probe_timeout()
                    )
                    results[url] = msgspec.json.decode(data) if status == 200 else r
                except (ConnectionFailed, InferenceError, KeyError, msgspec.DecodeError) as e:
                    results[url] = e
        return results

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        version: int | None,
        *,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        urls: list[str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Every reachable server receives the named tensors by broadcast from the trainer (which broadcasts while
        this is pending) and tags them `version` (None, for every bucket but the last: no label is sent and the
        servers keep theirs). A server that fails a bucket leaves rotation (it may hold a mix of versions) until
        `load_weights` or the `weight_source` hook brings it to the current weights. Raises `AdminError` only when
        every reachable server failed. `urls`: the group's members (default: the servers that joined
        `group_name` through this client, else every reachable one)."""
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if version is not None:  # None (every bucket but the last): the servers keep their label
            payload["weight_version"] = str(version)
        if extra:  # fields of our own (a delta's base and result: the embedded server); SGLang is never sent them
            payload.update(extra)
        members = urls if urls is not None else self._groups.get(group_name)
        return await self._fleet.distributed(payload, version, members)

    def weights_update_abandoned(self, errors: dict[str, BaseException]) -> None:
        """A broadcast left these servers part-way (url -> why): they hold a mix of versions, so they leave
        rotation until they hold the current weights (see Fleet.abandon_distributed)."""
        self._fleet.abandon_distributed(errors)

    async def verify_weights(self, expected: Identity) -> dict[str, Verdict]:
        """Policy identity (inference/identity.py): every serving server on `expected.version` proves it serves
        the weights `expected` describes. A server that does not leaves rotation, logged with the parameters that
        differ, and reloads the current weights; servers that come back later are checked before they serve.
        Returns url -> verdict."""
        servers = [s for s in self._reachable() if s.state == "serving" and s.version == expected.version]
        return await self._identity.check(expected, servers)

    async def weights_fingerprints(self, urls: list[str]) -> dict[str, str | None]:
        """url -> the combined digest of the weights it serves (None: it cannot say, e.g. SGLang)."""
        servers = [self._pool.router.servers[u.rstrip("/")] for u in urls if u.rstrip("/") in self._pool.router.servers]
        got = await asyncio.gather(*(held_combined(self._pool, s) for s in servers))
        return {s.url: g for s, g in zip(servers, got)}

    def _taint(self, server: ServerState, version: int, why: str) -> None:
        """Its label says `version` but its weights are not that version's: out of rotation, and its label is not
        trusted when it catches up (it reloads, as after a failed bucket of a broadcast)."""
        self._fleet._tainted[server.url] = version
        self._fleet.counts["weight_load_failures"] += 1
        self._pool.needs_sync(server, why)

    async def flush_cache(self) -> dict[str, Any]:
        return await self._pool.fanout("POST", "/flush_cache", None, servers=self._reachable())

    async def health(self) -> dict[str, bool]:
        """GET /health on every server now; also updates rotation (a failing server starts being probed)."""
        results = await self._pool.fanout("GET", "/health", timeout=self._pool.probe_timeout())
        out = {}
        for url, r in results.items():
            out[url] = not isinstance(r, BaseException)
            server = self._pool.router.servers.get(url)
            if server is not None and not out[url] and server.state == "serving":
                self._pool.server_failed(server, str(r))  # recovery goes through the probe, which syncs weights
        return out

    def liveness(self, url: str) -> tuple[str, float | None]:
        """(path, patience or None) of the liveness probe of `url`'s engine (dialect.py), for launch/recovery.py."""
        server = self._pool.router.servers.get(url.rstrip("/"))
        d = server.dialect if server is not None else None
        return (d.liveness_path, (d.hang_timeouts or 1) * self._pool.health_timeout_s) if d else ("/health", None)

    async def model_info(self) -> dict[str, Any]:
        """GET /model_info (or the older /get_model_info) from every server."""
        timeout = self._pool.probe_timeout()
        results = await self._pool.fanout("GET", "/model_info", timeout=timeout)
        for url, r in results.items():
            if isinstance(r, InferenceError) and r.status == 404:
                try:
                    status, data = await self._pool.send(
                        self._pool.router.servers[url], "GET", "/get_model_info", None, timeout=timeout
                    )
                    results[url] = msgspec.json.decode(data) if status == 200 else r
                except (ConnectionFailed, InferenceError, KeyError) as e:
                    results[url] = e
        return results

    # ---- membership: servers joining and leaving a running job --------------------------------------------------

    async def add_server(self, url: str, *, wait: bool = False, timeout_s: float | None = None) -> None:
        """Start using a new (or restarted) server. It takes traffic once /health answers and it holds the current
        weights (loaded from the last checkpoint path, or from the `weight_source` hook after a broadcast). With
        `wait`, return only once it serves (`InferenceError` after `timeout_s`)."""
        self._pool.add(url)
        if wait:
            await self.wait_serving(url, timeout_s)

    async def remove_server(self, url: str, *, drain_timeout_s: float | None = 0.0) -> None:
        """Stop routing to `url`; its requests get `drain_timeout_s` (None: as long as they need) to finish there,
        then continue elsewhere from their tokens so far. The server itself is left running."""
        await self._pool.remove(url, drain_timeout_s)

    async def load_weights(self, url: str, path: str, version: int) -> None:
        """Load a checkpoint into one server (e.g. one the launcher restarted after a broadcast update) before it
        takes traffic; when `version` is the current one it then returns to rotation."""
        await self._fleet.load_one(url, path, version)

    async def wait_serving(self, url: str, timeout_s: float | None = None) -> None:
        """Until `url` is in rotation; `InferenceError` after `timeout_s`."""
        url = url.rstrip("/")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            s = self._pool.router.servers.get(url)
            if s is None:
                raise KeyError(f"unknown server {url!r}")
            if s.healthy:
                return
            if self._pool.closed:
                raise InferenceError("InferenceClient is closed")
            if deadline is not None and time.monotonic() > deadline:
                raise InferenceError(f"{url} is not serving after {timeout_s:g}s (state {s.state})", url=url)
            await asyncio.sleep(0.02)

    @property
    def weight_source(self) -> WeightSource | None:
        """`async fn(version) -> checkpoint directory` for when a server must catch up to weights that came by
        broadcast (there is no checkpoint of them to load): e.g. the trainer publishes one. Without it such a
        server stays out of rotation until `load_weights`."""
        return self._fleet.weight_source

    @weight_source.setter
    def weight_source(self, fn: WeightSource | None) -> None:
        self._fleet.weight_source = fn

    @property
    def weight_target(self) -> WeightTarget | None:
        """The weights every serving server holds (None: the launch weights, never updated). Set it before the
        first request to servers that were running before the run (an external fleet): one whose label is not
        the target's version loads the target's checkpoint before it serves."""
        return self._fleet.target

    @weight_target.setter
    def weight_target(self, target: WeightTarget | None) -> None:
        self._fleet.target = target

    async def bring_to_target(self) -> None:
        """Every reachable server to `weight_target` now (relabelled or reloaded); one that cannot leaves rotation
        until it can. For servers that were running before the run."""
        for server in self._reachable():
            if not await self._fleet.ready(server):
                self._pool.needs_sync(server, "not on the run's weights")

    # ---- observability ------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Totals since start and each server's state right now."""
        return {
            **self._pool.counts,
            **self._fleet.counts,
            **self._identity.stats(),
            **self._counts,
            **(self._adapters.counts if self._adapters is not None else {}),
            "servers": {
                s.url: {
                    "outstanding": s.outstanding,
                    "healthy": s.healthy,
                    "state": s.state,
                    "requests": s.num_requests,
                    "failures": s.num_failures,
                    "version": s.version,
                }
                for s in self._pool.router.servers.values()
            },
        }

    def session_server(self, session_key: str) -> str | None:
        """The URL a session key is pinned to (None before its first request)."""
        return self._pool.router.session_server(session_key)

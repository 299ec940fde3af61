"""The controller's HTTP client for SGLang-protocol inference servers (real SGLang 0.5.x or our embedded server).

No torch here: a controller may run on a machine without it. One aiohttp session (made lazily inside the running
loop) carries every request; bodies are encoded and decoded with msgspec.

Interruptible generation, from the client's side (see shared/reference/async_rl.md):

    agenerate ──POST /generate──> server ... pause(abort) ──> response: partial tokens, finish_reason "abort"
        │ record tokens + the weight_version that made them
        │ wait for resume() (the client paused the servers itself), or back off (someone else aborted us)
        └─POST /generate with prompt + tokens so far, max_new_tokens - len(tokens so far) ──> ... stop | length

The caller gets one seamless `GenerationResult`; each output token carries the version that produced it.

Routing and failure handling (policy in routing.py): least outstanding requests, sticky session keys, retries with
exponential backoff on connection errors, 429 and 5xx (never on other 4xx: those raise `InferenceError` with the
server's message), a failed server leaves rotation and is probed with GET /health in the background until it
answers, and requests fail over to the other servers meanwhile. When no server is healthy a request waits up to
`unavailable_timeout_s` for one to come back, then raises.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import math
import random
import time
import uuid
from typing import Any, Callable, Literal

import aiohttp
import msgspec

from areal_async.inference.routing import Router, ServerState
from areal_async.types import GenerationResult, SamplingParams

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]


class InferenceError(RuntimeError):
    """A request the servers could not or would not serve. `status` is the HTTP status when there was one."""

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url


class AdminError(InferenceError):
    """An admin call (weight update, ...) failed on at least one server; `results` maps every URL to its result
    or its exception, so the caller can decide whether to retry, drop the server or stop."""

    def __init__(self, message: str, results: dict[str, Any]):
        super().__init__(message)
        self.results = results


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


_warned_versions: set = set()  # labels (and conditions) already warned about, once per process

# ---- wire shapes of POST /generate (SGLang's field names; unknown fields are ignored) --------------------------


class _FinishReason(msgspec.Struct):
    type: str
    matched: int | str | None = None
    message: str | None = None
    status_code: Any = None
    length: int | None = None


class _MetaInfo(msgspec.Struct):
    id: str = ""
    finish_reason: _FinishReason | None = None
    weight_version: Any = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # [logprob, token_id, token_text]; orjson (SGLang's encoder) writes -inf as null
    output_token_logprobs: list[tuple[float | None, int, str | None]] | None = None


class _GenerateResponse(msgspec.Struct):
    meta_info: _MetaInfo
    text: str = ""


class _ConnectionFailed(Exception):
    """The server could not be reached or dropped the connection: take it out of rotation and fail over."""


_RETRY_STATUS = {429, 500, 502, 503, 504}
_DOWN_STATUS = {502, 503, 504}  # the server (or its proxy) says it cannot serve at all: leave rotation
_JSON = {"Content-Type": "application/json"}
_ADMIN_HEADROOM = 8  # connections per server beyond `max_connections`, kept for admin calls and probes


def _error_message(body: bytes) -> str:
    """The human part of an error body: SGLang's {"error": {"message"}}, FastAPI's {"detail"}, or the raw text."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:500].decode("utf-8", "replace").strip()
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("error", "message", "detail"):
            if data.get(key):
                return str(data[key])
    return str(data)[:500]


def _find_stop(token_texts: list[str], stops: list[str], min_tokens: int) -> tuple[int, str, int] | None:
    """Earliest stop-string match in the joined token texts whose completing token index is >= min_tokens - 1.

    Returns (index of the token that completes the match, the stop string, char offset where the match starts).
    """
    ends: list[int] = []
    n = 0
    for t in token_texts:
        n += len(t)
        ends.append(n)
    full = "".join(token_texts)
    best: tuple[int, str, int] | None = None
    for s in stops:
        pos = full.find(s)
        while pos >= 0:
            tok = bisect.bisect_left(ends, pos + len(s))
            if tok >= min_tokens - 1:
                if best is None or (tok, pos) < (best[0], best[2]):
                    best = (tok, s, pos)
                break
            pos = full.find(s, pos + 1)
    return best


class InferenceClient:
    """Drives one or more SGLang-protocol servers. Use `async with InferenceClient(urls) as c:` or `await close()`.

    Bound to the event loop that first uses it (aiohttp sessions are). Safe for thousands of concurrent
    `agenerate` calls; admin calls fan out to every server concurrently. At most `max_connections` generations
    (and raw completions) are on the wire at once; the rest wait in the client, uncounted by the router, and admin
    calls (pause, resume, abort, health, weight updates) never wait behind them. For N rollouts in flight, set
    `max_connections` >= N or the servers see only `max_connections` of them.
    """

    def __init__(self, urls: list[str], *, api_key: str | None = None, timeout_s: float = 3600,
                 max_retries: int = 3, backoff_s: float = 0.2, probe_interval_s: float = 1.0,
                 max_connections: int = 1024, unavailable_timeout_s: float = 300.0,
                 connect_timeout_s: float = 10.0):
        if isinstance(urls, str):
            urls = [urls]
        self.urls = [u.rstrip("/") for u in urls]
        self._router = Router(self.urls)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.probe_interval_s = probe_interval_s
        self.max_connections = max_connections
        self.unavailable_timeout_s = unavailable_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None  # made with the session: one per routed request on the wire
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._resumed = asyncio.Event()  # cleared by pause(), set by resume(): interrupted requests wait on it
        self._resumed.set()
        self._any_healthy = asyncio.Event()
        self._any_healthy.set()
        self._probes: dict[str, asyncio.Task] = {}
        self._background: set[asyncio.Task] = set()
        self._active: dict[str, bool] = {}  # rid -> cancelled by abort()
        self._last_disk_update: tuple[str, int] | None = None  # replayed on a server that comes back
        self._enc = msgspec.json.Encoder()
        self._gen_dec = msgspec.json.Decoder(_GenerateResponse)
        self._counts = {"requests": 0, "tokens": 0, "interruptions": 0, "retries": 0, "failovers": 0,
                        "errors": 0}

    # ---- lifecycle ----------------------------------------------------------------------------------------------

    async def __aenter__(self) -> "InferenceClient":
        self._http()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _http(self) -> aiohttp.ClientSession:
        """The shared session, made on first use inside the running loop."""
        if self._closed:
            raise InferenceError("InferenceClient is closed")
        loop = asyncio.get_running_loop()
        if self._session is None:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            # routed requests are capped by `_slots`; the headroom above the cap keeps admin calls (pause, abort,
            # probes) from queueing behind thousands of generations waiting for a connection
            connector = aiohttp.TCPConnector(limit=self.max_connections + _ADMIN_HEADROOM * len(self.urls),
                                             limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=300)
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
            # no cookie jar: SGLang sets no cookies, and a real jar costs a cookie filter + parse per request
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers,
                                                  cookie_jar=aiohttp.DummyCookieJar())
            self._slots = asyncio.Semaphore(self.max_connections)
            self._loop = loop
        elif loop is not self._loop:
            raise InferenceError("InferenceClient is bound to the event loop that first used it")
        return self._session

    async def close(self) -> None:
        """Stop probes and background aborts, wake every waiter (they raise), close the session."""
        if self._closed:
            return
        self._closed = True
        self._resumed.set()
        self._any_healthy.set()
        tasks = [*self._probes.values(), *self._background]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _spawn(self, coro) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    # ---- one HTTP exchange --------------------------------------------------------------------------------------

    async def _send(self, server: ServerState, method: str, path: str, body: bytes | None,
                    timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, bytes]:
        """(status, body) of one request; `_ConnectionFailed` if the server cannot be reached or drops us."""
        session = self._http()
        server.outstanding += 1
        server.num_requests += 1
        try:
            kw: dict[str, Any] = {}
            if body is not None:
                kw["data"] = body
                kw["headers"] = _JSON
            if timeout is not None:
                kw["timeout"] = timeout
            async with session.request(method, server.url + path, **kw) as resp:
                return resp.status, await resp.read()
        except aiohttp.ClientError as e:  # includes connect timeouts: the server is unreachable
            raise _ConnectionFailed(f"{server.url}{path}: {e!r}") from e
        except asyncio.TimeoutError as e:
            raise InferenceError(f"{server.url}{path}: no answer within {self.timeout_s:g}s", url=server.url) from e
        except OSError as e:
            raise _ConnectionFailed(f"{server.url}{path}: {e!r}") from e
        finally:
            server.outstanding -= 1

    def _server_failed(self, server: ServerState, why: str) -> None:
        """Take a server out of rotation and start probing it."""
        server.num_failures += 1
        if self._router.mark_down(server.url):
            log.warning("inference server %s taken out of rotation: %s", server.url, why)
        if not self._router.healthy():
            self._any_healthy.clear()
        if not self._closed and (server.url not in self._probes or self._probes[server.url].done()):
            self._probes[server.url] = asyncio.get_running_loop().create_task(self._probe(server))

    def _probe_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=max(2.0, 5 * self.probe_interval_s))

    async def _probe(self, server: ServerState) -> None:
        """GET /health until it answers 200; replay the last disk weight update if the server missed it."""
        timeout = self._probe_timeout()
        while not self._closed:
            await asyncio.sleep(self.probe_interval_s)
            try:
                status, _ = await self._send(server, "GET", "/health", None, timeout)
                if status == 200 and await self._catch_up_weights(server):
                    break
            except (_ConnectionFailed, InferenceError):
                pass
        else:
            return
        self._router.mark_up(server.url)
        self._any_healthy.set()
        log.warning("inference server %s is back in rotation", server.url)

    async def _catch_up_weights(self, server: ServerState) -> bool:
        """A restarted server comes back with its launch weights; load the last published ones before it serves."""
        if self._last_disk_update is None:
            return True
        path, version = self._last_disk_update
        status, body = await self._send(server, "GET", "/model_info", None)
        if status == 200:
            try:
                info = msgspec.json.decode(body)
            except msgspec.DecodeError:
                info = None
            if isinstance(info, dict) and parse_weight_version(info.get("weight_version")) == version:
                return True
        payload = {"model_path": path, "weight_version": str(version), "abort_all_requests": False,
                   "flush_cache": True}
        status, body = await self._send(server, "POST", "/update_weights_from_disk", self._enc.encode(payload))
        if status == 200:
            log.warning("inference server %s caught up to weight version %d", server.url, version)
            return True
        log.warning("inference server %s failed to catch up weights: %s", server.url, _error_message(body))
        return False

    async def _wait_for_healthy(self, deadline: float, last_err: BaseException | None) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise InferenceError(f"no healthy inference server among {self.urls} for "
                                 f"{self.unavailable_timeout_s:g}s; last error: {last_err}")
        try:
            await asyncio.wait_for(self._any_healthy.wait(), remaining)
        except asyncio.TimeoutError:
            pass
        if self._closed:
            raise InferenceError("InferenceClient is closed")

    async def _routed(self, method: str, path: str, make_body: Callable[[int], bytes | None],
                      session_key: str | None = None) -> tuple[bytes, ServerState]:
        """One logical request with routing, retries, failover and waiting out a full outage.

        `make_body(attempt)` builds the body per attempt (generate gives each attempt its own rid so that a
        retry never collides with a request the server may still be running)."""
        self._counts["requests"] += 1
        self._http()  # the session and its slot semaphore exist from here on
        slots = self._slots
        assert slots is not None
        failures = 0
        attempt = 0
        tried: list[str] = []
        last_err: BaseException | None = None
        deadline: float | None = None
        while True:
            # a slot first, then the server: a request waiting for a connection holds no aiohttp state, and the
            # least-outstanding choice is made with the load at the moment the request actually goes out
            await slots.acquire()
            try:
                server = self._router.pick(session_key, tried)
                if server is not None:
                    if tried and server.url not in tried:
                        self._counts["failovers"] += 1
                    body = make_body(attempt)
                    attempt += 1
                    try:
                        answer: tuple[int, bytes] | _ConnectionFailed = await self._send(server, method, path, body)
                    except _ConnectionFailed as e:
                        answer = e
            finally:
                slots.release()
            if server is None:
                if deadline is None:
                    deadline = time.monotonic() + self.unavailable_timeout_s
                await self._wait_for_healthy(deadline, last_err)
                continue
            deadline = None
            if isinstance(answer, _ConnectionFailed):
                self._server_failed(server, str(answer))
                last_err = answer
            else:
                status, data = answer
                if status == 200:
                    return data, server
                msg = _error_message(data)
                if status not in _RETRY_STATUS:
                    self._counts["errors"] += 1
                    raise InferenceError(f"{server.url}{path} -> HTTP {status}: {msg}", status=status,
                                         url=server.url)
                last_err = InferenceError(f"{server.url}{path} -> HTTP {status}: {msg}", status=status,
                                          url=server.url)
                if status in _DOWN_STATUS:
                    self._server_failed(server, f"HTTP {status}")
                else:
                    server.num_failures += 1
            failures += 1
            if failures > self.max_retries:
                self._counts["errors"] += 1
                raise InferenceError(f"{method} {path} failed after {failures} attempts: {last_err}") from last_err
            self._counts["retries"] += 1
            tried.append(server.url)
            if not any(s.url not in tried for s in self._router.healthy()):  # nowhere new to go: back off first
                await asyncio.sleep(self.backoff_s * 2 ** (failures - 1) * (0.5 + random.random()))

    # ---- generation ---------------------------------------------------------------------------------------------

    async def agenerate(self, input_ids: list[int], sampling: SamplingParams, *, rid: str | None = None,
                        session_key: str | None = None, return_text: bool = False,
                        priority: int | None = None) -> GenerationResult:
        """Generate one completion of `input_ids`, resuming across interruptions until stop or length.

        `priority` (sent only when given): a larger one is queued ahead on the server; the embedded server always
        honours it, SGLang only with --enable-priority-scheduling.

        The result concatenates every segment; `output_versions[i]` is the weight version that produced token i.
        A client `abort(rid)` ends it early with finish_reason "abort" and the tokens so far.
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
        t0 = time.perf_counter()
        prompt = list(input_ids)
        out_ids: list[int] = []
        out_lps: list[float] = []
        out_vers: list[int] = []
        tok_texts: list[str | None] = []
        seg_texts: list[str] = []
        stops = [s for s in (sampling.stop or []) if s]
        base = sampling.to_sglang()
        interruptions = 0
        idle_aborts = 0  # consecutive aborts from elsewhere that produced nothing
        submissions = 0  # answered /generate calls (segments)
        sent = 0  # bodies sent, retries included: each gets its own rid
        finish: str = "length"
        matched: int | str | None = None
        server_url = ""
        text_override: str | None = None
        try:
            while True:
                remaining = sampling.max_new_tokens - len(out_ids)
                if submissions > 0 and remaining <= 0:
                    finish = "length"
                    break
                sp = dict(base)
                sp["max_new_tokens"] = remaining
                sp["min_new_tokens"] = max(0, sampling.min_new_tokens - len(out_ids))
                payload: dict[str, Any] = {"input_ids": prompt + out_ids if out_ids else prompt, "sampling_params": sp,
                                           "return_logprob": True, "stream": False}
                if stops:  # per-token text lets us honour a stop string that spans a resubmission boundary
                    payload["return_text_in_logprobs"] = True
                if priority is not None:
                    payload["priority"] = priority

                def make_body(_attempt: int, payload=payload) -> bytes:
                    nonlocal sent
                    payload["rid"] = rid if sent == 0 else f"{rid}-{sent}"  # prefix-abort by rid still reaches it
                    sent += 1
                    return self._enc.encode(payload)

                try:
                    data, server = await self._routed("POST", "/generate", make_body, session_key)
                except BaseException:  # cancelled or timed out: a server may still be generating for nobody
                    if not self._closed:
                        self._spawn(self._fanout("POST", "/abort_request", {"rid": rid, "abort_all": False}))
                    raise
                submissions += 1
                server_url = server.url
                try:
                    resp = self._gen_dec.decode(data)
                except msgspec.DecodeError as e:
                    raise InferenceError(f"{server.url}/generate: malformed response: {e}", url=server.url) from e
                meta = resp.meta_info
                fr = meta.finish_reason
                if fr is None:
                    raise InferenceError(f"{server.url}/generate: response without finish_reason", url=server.url)
                triples = meta.output_token_logprobs
                if triples is None:
                    raise InferenceError(f"{server.url}/generate: no output_token_logprobs (return_logprob "
                                         "ignored?)", url=server.url)
                version = parse_weight_version(meta.weight_version)
                if triples:  # column-wise in C: long answers make a per-token Python loop the hot spot
                    lps, tids, ttexts = zip(*triples)
                    out_ids.extend(tids)
                    out_lps.extend([-math.inf if lp is None else lp for lp in lps] if None in lps else lps)
                    out_vers.extend(itertools.repeat(version, len(tids)))
                    if stops:
                        tok_texts.extend(ttexts)
                seg_texts.append(resp.text)
                self._counts["tokens"] += len(triples)

                if stops and interruptions > 0:
                    hit = self._stop_across_boundary(tok_texts, stops, sampling.min_new_tokens)
                    if hit is not None:
                        tok, s, pos = hit
                        del out_ids[tok + 1:], out_lps[tok + 1:], out_vers[tok + 1:]
                        text_override = "".join(tok_texts[: tok + 1])[:pos]  # type: ignore[arg-type]
                        finish, matched = "stop", s
                        break

                if fr.type != "abort":
                    finish, matched = fr.type, fr.matched
                    break
                code = fr.status_code
                if isinstance(code, int) and 400 <= code < 500:
                    raise InferenceError(f"{server.url}/generate aborted: {fr.message}", status=code,
                                         url=server.url)
                if self._active.get(rid):  # abort() on this client: the caller wants it over
                    finish = "abort"
                    break
                if not self._resumed.is_set():  # we paused the servers: continue once they are resumed
                    await self._resumed.wait()
                    if self._closed:
                        raise InferenceError("InferenceClient is closed")
                else:  # aborted from elsewhere (another controller, a server shutting down): back off and retry;
                    # give up if it keeps happening with nothing made, since then someone means to stop it
                    idle_aborts = 0 if triples else idle_aborts + 1
                    if idle_aborts > self.max_retries:
                        finish = "abort"
                        break
                    await asyncio.sleep(self.backoff_s * 2 ** idle_aborts)
                if self._active.get(rid):
                    finish = "abort"
                    break
                interruptions += 1
                self._counts["interruptions"] += 1
        finally:
            self._active.pop(rid, None)

        if not return_text:
            text = ""
        elif text_override is not None:
            text = text_override
        else:
            text = "".join(seg_texts)
        return GenerationResult(input_ids=prompt, output_ids=out_ids, output_logprobs=out_lps,
                                output_versions=out_vers, finish_reason=finish,  # type: ignore[arg-type]
                                text=text, matched_stop=matched if finish == "stop" else None,
                                num_interruptions=interruptions, latency_s=time.perf_counter() - t0,
                                server=server_url)

    @staticmethod
    def _stop_across_boundary(tok_texts: list[str | None], stops: list[str], min_new_tokens: int
                              ) -> tuple[int, str, int] | None:
        """Each server checks stop strings in its own segment only; a match spanning a resubmission is ours to
        find. Needs per-token text (return_text_in_logprobs); without it the match cannot be placed on a token."""
        if any(t is None for t in tok_texts):
            if "__no_token_text__" not in _warned_versions:
                _warned_versions.add("__no_token_text__")
                log.warning("server returned no per-token text; stop strings across interruptions are not checked")
            return None
        return _find_stop(tok_texts, stops, min_new_tokens)  # type: ignore[arg-type]

    async def acompletion_raw(self, path: str, payload: dict, *, session_key: str | None = None) -> Any:
        """POST any JSON body (e.g. /v1/completions, /v1/chat/completions) with routing, retries and failover;
        returns the decoded JSON answer. No resumption: an OpenAI-style caller sees aborts as they are."""
        body = self._enc.encode(payload)
        data, _ = await self._routed("POST", path if path.startswith("/") else "/" + path, lambda _a: body,
                                     session_key)
        return msgspec.json.decode(data)

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> dict[str, Any]:
        """Abort `rid` (and its resubmissions, which share its prefix) or everything, on every server. The
        matching `agenerate` calls return finish_reason "abort" with their tokens so far instead of resuming."""
        if abort_all:
            for k in self._active:
                self._active[k] = True
        elif rid is None:
            raise ValueError("give a rid or abort_all=True")
        elif rid in self._active:
            self._active[rid] = True
        return await self._fanout("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    # ---- admin fan-out ------------------------------------------------------------------------------------------

    async def _fanout(self, method: str, path: str, payload: dict | Callable[[int, str], dict] | None = None,
                      *, check_success: bool = False, timeout: aiohttp.ClientTimeout | None = None
                      ) -> dict[str, Any]:
        """Send to every server at once (healthy or not). Returns url -> decoded answer, or the exception."""

        async def one(i: int, server: ServerState) -> Any:
            p = payload(i, server.url) if callable(payload) else payload
            body = None if p is None else self._enc.encode(p)
            try:
                status, data = await self._send(server, method, path, body, timeout)
            except _ConnectionFailed as e:
                self._server_failed(server, str(e))
                raise InferenceError(str(e), url=server.url) from e
            if status != 200:
                raise InferenceError(f"{server.url}{path} -> HTTP {status}: {_error_message(data)}",
                                     status=status, url=server.url)
            try:
                out = msgspec.json.decode(data) if data else None
            except msgspec.DecodeError:
                out = data.decode("utf-8", "replace")
            if check_success and isinstance(out, dict) and out.get("success") is False:
                raise InferenceError(f"{server.url}{path}: {out.get('message', 'failed')}", url=server.url)
            return out

        servers = list(self._router.servers.values())
        results = await asyncio.gather(*(one(i, s) for i, s in enumerate(servers)), return_exceptions=True)
        return {s.url: r for s, r in zip(servers, results)}

    @staticmethod
    def _raise_if_failed(what: str, results: dict[str, Any]) -> dict[str, Any]:
        bad = {u: r for u, r in results.items() if isinstance(r, BaseException)}
        if bad:
            detail = "; ".join(f"{u}: {r}" for u, r in bad.items())
            raise AdminError(f"{what} failed on {len(bad)} of {len(results)} servers: {detail}", results)
        return results

    async def pause(self, mode: PauseMode = "abort") -> dict[str, Any]:
        """Pause every server. With "abort", in-flight requests come back with their partial tokens and the
        matching `agenerate` calls wait for `resume()` before resubmitting. The event is cleared before the
        servers are told, so no aborted answer can slip through as an abort from elsewhere."""
        self._resumed.clear()
        return await self._fanout("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> dict[str, Any]:
        """Continue every server, then release the waiting `agenerate` calls (even if a server failed: a dead
        server must not hold the rollout hostage)."""
        try:
            return await self._fanout("POST", "/continue_generation", {})
        finally:
            self._resumed.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def update_weights_from_disk(self, path: str, version: int, *, flush_cache: bool = True,
                                       abort_all_requests: bool = False) -> dict[str, Any]:
        """Every server loads the HF checkpoint at `path` as weight version `version`. Raises `AdminError` if any
        server failed (its old weights stay). A server that is down now catches up when it comes back."""
        payload = {"model_path": path, "weight_version": str(version), "abort_all_requests": abort_all_requests,
                   "flush_cache": flush_cache}
        results = await self._fanout("POST", "/update_weights_from_disk", payload, check_success=True)
        if any(not isinstance(r, BaseException) for r in results.values()):  # a bad path must not block recovery
            self._last_disk_update = (path, version)
        return self._raise_if_failed("update_weights_from_disk", results)

    async def update_weight_version(self, version: int, *, abort_all_requests: bool = False) -> dict[str, Any]:
        """Relabel the servers' current weights (after an update made by other means)."""
        payload = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return self._raise_if_failed("update_weight_version",
                                     await self._fanout("POST", "/update_weight_version", payload,
                                                        check_success=True))

    async def init_weights_update_group(self, master_address: str, master_port: int, *,
                                        ranks_per_server: int | list[int] = 1,
                                        group_name: str = "weight_update_group", backend: str = "nccl"
                                        ) -> dict[str, Any]:
        """Every server joins the trainer's broadcast group. The trainer is rank 0; server i's ranks start after
        the ranks of servers 0..i-1 (`ranks_per_server` = each server's tensor-parallel size). The calls block
        until the trainer joins too, so they run concurrently; the trainer must join while this is pending."""
        per = [ranks_per_server] * len(self.urls) if isinstance(ranks_per_server, int) else list(ranks_per_server)
        if len(per) != len(self.urls) or min(per) < 1:
            raise ValueError("ranks_per_server must be >= 1 for each server")
        offsets = [1 + sum(per[:i]) for i in range(len(per))]
        world_size = 1 + sum(per)

        def payload(i: int, _url: str) -> dict:
            return {"master_address": master_address, "master_port": master_port, "rank_offset": offsets[i],
                    "world_size": world_size, "group_name": group_name, "backend": backend}

        return self._raise_if_failed("init_weights_update_group",
                                     await self._fanout("POST", "/init_weights_update_group", payload,
                                                        check_success=True))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              version: int | None, *, group_name: str = "weight_update_group",
                                              flush_cache: bool = True, abort_all_requests: bool = False
                                              ) -> dict[str, Any]:
        """Every server receives the named tensors by broadcast from the trainer (which broadcasts while this is
        pending) and tags them `version` (None: no weight_version is sent, the server keeps its label)."""
        payload = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                   "flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
        if version is not None:
            payload["weight_version"] = str(version)
        results = await self._fanout("POST", "/update_weights_from_distributed", payload, check_success=True)
        # a restarted server cannot rejoin the broadcast group by itself; it comes back with its launch weights
        # (its tokens say so in their versions) rather than with an older checkpoint from disk
        self._last_disk_update = None
        return self._raise_if_failed("update_weights_from_distributed", results)

    async def flush_cache(self) -> dict[str, Any]:
        return await self._fanout("POST", "/flush_cache", None)

    async def health(self) -> dict[str, bool]:
        """GET /health on every server now; also updates rotation (a failing server starts being probed)."""
        results = await self._fanout("GET", "/health", timeout=self._probe_timeout())
        out = {}
        for url, r in results.items():
            out[url] = not isinstance(r, BaseException)
            server = self._router.servers[url]
            if not out[url] and server.healthy:  # recovery goes through the probe, which also syncs weights
                self._server_failed(server, str(r))
        return out

    async def model_info(self) -> dict[str, Any]:
        """GET /model_info (or the older /get_model_info) from every server."""
        results = await self._fanout("GET", "/model_info")
        for url, r in results.items():
            if isinstance(r, InferenceError) and r.status == 404:
                try:
                    status, data = await self._send(self._router.servers[url], "GET", "/get_model_info", None)
                    results[url] = msgspec.json.decode(data) if status == 200 else r
                except (_ConnectionFailed, InferenceError) as e:
                    results[url] = e
        return results

    # ---- observability ------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Totals since start and each server's state right now."""
        return {**self._counts,
                "servers": {s.url: {"outstanding": s.outstanding, "healthy": s.healthy, "requests": s.num_requests,
                                    "failures": s.num_failures} for s in self._router.servers.values()}}

    def session_server(self, session_key: str) -> str | None:
        """The URL a session key is pinned to (None before its first request)."""
        return self._router.session_server(session_key)

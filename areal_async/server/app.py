"""The embedded inference server: SGLang's HTTP protocol over an `Engine` (aiohttp).

Why embedded: on a laptop or a CPU box there is no SGLang, yet the controller, the client and the tests must talk to
the very protocol they will meet on GPUs. This server answers the same requests with the same shapes (SGLang
0.5's native endpoints: /generate, pause and weight control, info), so a real SGLang server can replace it without
the client noticing.

Parsing, validation and response shapes are in protocol/sglang.py and protocol/openai_requests.py (pure
functions); this module only moves bytes between HTTP and the engine, and owns three pieces of server state:
readiness (503 while starting or stopping), the set of request ids in flight (a duplicate rid is a 400), and the API
key. The middlewares that enforce readiness, the key and the error shape are in server/middleware.py; the driving of
one call's engine requests is in server/engine_calls.py.

In-process use (tests, launchers, notebooks):

    server = await start_server("/path/to/hf_checkpoint", port=0, api_key="secret")
    ...  # server.url is "http://127.0.0.1:<port>", server.engine is the engine
    await server.close()  # or: async with await start_server(...) as server: ...

Authentication: with an API key every endpoint except /health and /health_generate requires
`Authorization: Bearer <key>` (401 otherwise), as SGLang's --api-key does; the key is compared in constant time.

Errors: bad input is HTTP 400 `{"error": {"message": ...}}`; a failure inside a handler is logged and becomes a 500
with the same shape; the server keeps serving either way. A client that disconnects mid-request has its engine
requests aborted (aiohttp cancels the handler; the cleanup is shielded from that cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.metadata
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from areal_async.protocol import openai_requests, openai_responses
from areal_async.protocol import sglang as sglang_protocol
from areal_async.protocol.engine_api import Engine, EngineRequest, EngineSampling
from areal_async.server.engine_calls import EngineCall
from areal_async.server.middleware import (
    auth_middleware,
    error_middleware,
    json_response,
    ready_middleware,
)

log = logging.getLogger(__name__)

_json_enc = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
HEALTH_GENERATE_TIMEOUT_S = 20.0
MAX_BODY_BYTES = 256 << 20  # a batch of long token-id prompts is large; aiohttp's default is 1 MiB


@functools.cache
def package_version() -> str:
    """The installed package's version (pyproject.toml's), from its metadata rather than `areal_async.__version__`:
    the root package re-exports the embedding API, the top of the import order, which a server never imports."""
    try:
        return importlib.metadata.version("areal_async")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def sse_event(obj: Any) -> bytes:
    return b"data: " + _json_enc.encode(obj) + b"\n\n"


class SGLangServer:
    """Handlers and state of one server; `build_app` wires them into an aiohttp application."""

    def __init__(self, engine: Engine, *, api_key: str | None = None, served_model_name: str | None = None):
        self.engine = engine
        self.api_key = api_key
        self.served_model_name = served_model_name or engine.model_path
        self.status = "starting"  # starting | ready | stopping
        self.created = int(time.time())
        self.inflight: set[str] = set()
        self.url = ""
        self._background: set[asyncio.Task] = set()

    # ---- shared machinery ---------------------------------------------------------------------------------------

    @property
    def limits(self) -> sglang_protocol.Limits:
        return sglang_protocol.Limits(vocab_size=self.engine.vocab_size, context_len=self.engine.context_len)

    def claim(self, rids: list[str]) -> None:
        """Reserve request ids for this call; a rid already in flight is a 400, as in SGLang."""
        dup = next((r for r in rids if r in self.inflight), None)
        if dup is not None:
            raise sglang_protocol.ProtocolError(
                f"duplicate request id {dup!r}: a request with this rid is already in flight"
            )
        self.inflight.update(rids)

    def release(self, rids: list[str]) -> None:
        self.inflight.difference_update(rids)

    async def abort_exact(self, rid: str) -> None:
        """Abort one request. The engine aborts by prefix, so skip it when that would hit another request
        (closing the request's generator has already told the engine)."""
        if any(r != rid and r.startswith(rid) for r in self.inflight):
            return
        with contextlib.suppress(Exception):
            await self.engine.abort(rid)

    async def shielded(self, coro) -> Any:
        """Run `coro` to completion even if the awaiting handler is cancelled (client gone)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return await asyncio.shield(task)

    def start_run(self, reqs: list[EngineRequest], *, text_in_logprobs: bool = False) -> EngineCall:
        started = time.perf_counter()
        self.claim([r.rid for r in reqs])
        accs = [
            sglang_protocol.Accumulator(r, self.engine, text_in_logprobs=text_in_logprobs, started=started)
            for r in reqs
        ]
        return EngineCall(self, accs)

    async def run_to_end(self, run: EngineCall) -> None:
        try:
            async for _ in run.progress():
                pass
        except sglang_protocol.ProtocolError:
            raise
        except ValueError as e:  # the engine refused the request (Engine.generate's contract)
            raise sglang_protocol.ProtocolError(str(e)) from None
        finally:
            await run.close()

    async def stream(
        self,
        request: web.Request,
        run: EngineCall,
        render: Callable[[int], list[dict]],
        tail: Callable[[], list[dict]] = lambda: [],
    ) -> web.StreamResponse:
        """Server-sent events: `render(i)` turns progress on request i into events; `[DONE]` ends the stream.

        Headers go out with the first event, so an engine refusal before any token is still a plain 400.
        """
        resp: web.StreamResponse | None = None

        async def open_stream() -> web.StreamResponse:
            r = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await r.prepare(request)
            return r

        try:
            async for i in run.progress():
                events = render(i)
                if events and resp is None:
                    resp = await open_stream()
                for ev in events:
                    await resp.write(sse_event(ev))
            if resp is None:
                resp = await open_stream()
            for ev in tail():
                await resp.write(sse_event(ev))
        except asyncio.CancelledError:  # the client went away while we waited on the engine
            await run.close()
            raise
        except ConnectionResetError:  # ... or while we were writing to it
            await run.close()
            if resp is None:
                raise
            return resp
        except Exception as e:
            if resp is None:
                await run.close()
                if isinstance(e, ValueError) and not isinstance(e, sglang_protocol.ProtocolError):
                    raise sglang_protocol.ProtocolError(str(e)) from None
                raise
            log.exception("error while streaming %s", request.path)
            status = e.status if isinstance(e, sglang_protocol.ProtocolError) else 500
            with contextlib.suppress(ConnectionResetError):
                await resp.write(sse_event(sglang_protocol.error_body(f"{type(e).__name__}: {e}", status)))
        await run.close()
        with contextlib.suppress(ConnectionResetError):
            await resp.write(SSE_DONE)
            await resp.write_eof()
        return resp

    # ---- native SGLang endpoints --------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        plan = sglang_protocol.parse_generate(await request.read(), self.engine, self.limits)
        run = self.start_run(plan.requests, text_in_logprobs=plan.return_text_in_logprobs)
        if not plan.stream:
            await self.run_to_end(run)
            out = [a.generate_response() for a in run.accs]
            return json_response(out if plan.batched else out[0])

        sent = [-1] * len(run.accs)  # tokens covered by the last event; -2 once the final event is out

        def render(i: int) -> list[dict]:
            acc = run.accs[i]
            if sent[i] == -2 or (not acc.finished and len(acc.output_ids) == sent[i]):
                return []
            sent[i] = -2 if acc.finished else len(acc.output_ids)
            ev = acc.generate_response()
            if plan.batched:
                ev["index"] = i
            return [ev]

        return await self.stream(request, run, render)

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = sglang_protocol.parse_pause(await request.read())
        await self.shielded(self.engine.pause(mode))
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await request.read()
        await self.shielded(self.engine.resume())
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request: web.Request) -> web.Response:
        a: sglang_protocol.AbortIn = sglang_protocol.decode_body(
            await request.read(), sglang_protocol.AbortIn, empty_ok=True
        )
        if a.abort_all:
            await self.engine.abort(abort_all=True)
        elif a.rid:  # an empty rid would prefix-match everything; only abort_all may do that
            await self.engine.abort(a.rid)
        return web.Response()

    async def flush_cache(self, request: web.Request) -> web.Response:
        if await self.engine.flush_cache():
            return web.Response(text="Cache flushed.\n")
        return web.Response(status=400, text="Cache not flushed: requests are running or waiting.\n")

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        u: sglang_protocol.UpdateFromDiskIn = sglang_protocol.decode_body(
            await request.read(), sglang_protocol.UpdateFromDiskIn
        )
        try:
            ok, msg, paused = await self.shielded(
                self.engine.update_weights_from_disk(
                    u.model_path, sglang_protocol.version_str(u.weight_version), u.abort_all_requests, u.flush_cache
                )
            )
        except Exception as e:
            log.exception("update_weights_from_disk(%s) failed", u.model_path)
            ok, msg, paused = False, f"{type(e).__name__}: {e}", 0
        return json_response({"success": ok, "message": msg, "num_paused_requests": paused}, 200 if ok else 400)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        g: sglang_protocol.InitGroupIn = sglang_protocol.decode_body(await request.read(), sglang_protocol.InitGroupIn)
        return await self._success_call(
            "init_weights_update_group",
            self.engine.init_weights_update_group(
                g.master_address, g.master_port, g.rank_offset, g.world_size, g.group_name, g.backend
            ),
        )

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        g: sglang_protocol.DestroyGroupIn = sglang_protocol.decode_body(
            await request.read(), sglang_protocol.DestroyGroupIn, empty_ok=True
        )
        return await self._success_call(
            "destroy_weights_update_group", self.engine.destroy_weights_update_group(g.group_name)
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        u: sglang_protocol.UpdateFromDistributedIn = sglang_protocol.decode_body(
            await request.read(), sglang_protocol.UpdateFromDistributedIn
        )
        u.check()
        if u.abort_all_requests:
            await self.engine.abort(abort_all=True)
        return await self._success_call(
            "update_weights_from_distributed",
            self.engine.update_weights_from_distributed(
                u.names,
                u.dtypes,
                u.shapes,
                u.group_name,
                sglang_protocol.version_str(u.weight_version),
                u.flush_cache,
                delta=u.delta,
                lora=u.lora,
            ),
        )

    async def _success_call(self, what: str, coro) -> web.Response:
        try:
            ok, msg = await self.shielded(coro)
        except Exception as e:
            log.exception("%s failed", what)
            ok, msg = False, f"{type(e).__name__}: {e}"
        return json_response({"success": ok, "message": msg}, 200 if ok else 400)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        u: sglang_protocol.UpdateWeightVersionIn = sglang_protocol.decode_body(
            await request.read(), sglang_protocol.UpdateWeightVersionIn
        )
        version = str(u.new_version)
        if u.abort_all_requests:
            await self.engine.abort(abort_all=True)
        await self.engine.set_weight_version(version)
        return json_response(
            {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's /get_weights_by_name (GET or POST, JSON body): a slice of one named parameter, the probe that
        policy identity reads from a server without digests (protocol/weight_identity.py)."""
        g: sglang_protocol.GetWeightsByNameIn = sglang_protocol.decode_body(
            await request.read(), sglang_protocol.GetWeightsByNameIn
        )
        if g.truncate_size < 1:
            return json_response(sglang_protocol.error_body("truncate_size must be >= 1"), 400)
        value = await self.engine.weights_by_name(g.name, g.truncate_size)
        if value is None:
            return json_response(
                sglang_protocol.error_body(f"Get parameter by name failed: no parameter {g.name!r}"), 400
            )
        return json_response(value)

    async def weights_fingerprint(self, request: web.Request) -> web.Response:
        """Our own: the digest of every parameter as served (protocol/weight_identity.py's Identity)."""
        identity = await self.engine.weights_identity()
        return web.Response(body=msgspec.json.encode(identity), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.status == "ready" else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """200 when the engine can make a token: it is busy (so it evidently can) or paused by choice, or a
        one-token request finishes within the timeout."""
        if self.status != "ready":
            return web.Response(status=503)
        if self.engine.paused or self.engine.num_running() > 0:
            return web.Response(status=200)
        req = EngineRequest(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=[0],
            sampling=EngineSampling(max_new_tokens=1, temperature=0.0, ignore_eos=True),
            stream=False,
        )
        run = self.start_run([req])
        try:
            await asyncio.wait_for(self.run_to_end(run), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as e:
            log.warning("health_generate failed: %s", e)
            return web.Response(status=503)
        ok = run.accs[0].finish_reason is not None and run.accs[0].finish_reason.get("type") != "abort"
        return web.Response(status=200 if ok else 503)

    async def get_model_info(self, request: web.Request) -> web.Response:
        e = self.engine
        args = e.server_args()
        arch = args.get("architecture")
        return json_response(
            {
                "model_path": e.model_path,
                "tokenizer_path": args.get("tokenizer_path", e.model_path),
                "is_generation": True,
                "weight_version": e.weight_version,
                "served_model_name": self.served_model_name,
                "preferred_sampling_params": None,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "architectures": [arch] if arch else None,
                "context_len": e.context_len,
                "vocab_size": e.vocab_size,
            }
        )

    async def get_server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        info = {k: v for k, v in e.server_args().items() if k != "api_key"}  # never echo a secret
        info.update(
            {
                "served_model_name": self.served_model_name,
                "url": self.url,
                "version": package_version(),
                "weight_version": e.weight_version,
                "status": self.status,
                "paused": e.paused,
                "num_running_reqs": e.num_running(),
                "num_waiting_reqs": e.num_waiting(),
                "context_length": e.context_len,
                "api_key_required": self.api_key is not None,
                # /update_weights_from_disk also takes a delta directory (server/delta_load.py); SGLang does not
                "weights_delta": True,
                "weights_adapter": True,  # loads a peft adapter directory by merging it (server/lora_load.py)
            }
        )
        return json_response(info)

    async def list_models(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "areal_async",
                        "root": self.engine.model_path,
                        "max_model_len": self.engine.context_len,
                    }
                ],
            }
        )

    # ---- OpenAI-compatible endpoints ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        plan = openai_requests.parse_completion(await request.read(), self.engine, self.limits)
        return await self._openai(
            request, plan, "cmpl-", openai_responses.completion_response, openai_responses.completion_chunk
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        engine = self.engine
        plan = openai_requests.parse_chat(
            await request.read(),
            engine,
            self.limits,
            lambda msgs, tools: engine.apply_chat_template(msgs, tools, add_generation_prompt=True),
        )
        return await self._openai(
            request, plan, "chatcmpl-", openai_responses.chat_response, openai_responses.chat_chunk
        )

    async def _openai(
        self, request: web.Request, plan: openai_requests.OpenAIPlan, id_prefix: str, respond, chunk
    ) -> web.StreamResponse:
        rid = f"{id_prefix}{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.served_model_name
        run = self.start_run(plan.requests)
        if not plan.stream:
            await self.run_to_end(run)
            return json_response(respond(plan, run.accs, model, rid, created))

        deltas = [openai_responses.StreamDelta(hold_tool_calls=bool(plan.tools)) for _ in run.accs]
        done = [False] * len(run.accs)

        def render(i: int) -> list[dict]:
            acc = run.accs[i]
            if done[i]:
                return []
            done[i] = acc.finished
            ev = chunk(plan, i, acc, deltas[i], model, rid, created)
            return [] if ev is None else [ev]

        def tail() -> list[dict]:
            return [openai_responses.usage_chunk(plan, run.accs, model, rid, created)] if plan.include_usage else []

        return await self.stream(request, run, render, tail)


# ---- the application --------------------------------------------------------------------------------------------

SERVER_KEY = web.AppKey("sglang_server", SGLangServer)


def build_app(engine: Engine, *, api_key: str | None = None, served_model_name: str | None = None) -> web.Application:
    """The aiohttp application for `engine`. The server starts in state "starting" (health 503, generation 503);
    `start_server` marks it ready once the engine has started (`app[SERVER_KEY].status = "ready"`)."""
    srv = SGLangServer(engine, api_key=api_key, served_model_name=served_model_name)
    app = web.Application(
        middlewares=[error_middleware, auth_middleware(api_key), ready_middleware(srv)],
        client_max_size=MAX_BODY_BYTES,
    )
    app[SERVER_KEY] = srv
    r = app.router
    r.add_post("/generate", srv.generate)
    r.add_put("/generate", srv.generate)
    r.add_post("/pause_generation", srv.pause_generation)
    r.add_post("/continue_generation", srv.continue_generation)
    r.add_post("/abort_request", srv.abort_request)
    r.add_route("GET", "/flush_cache", srv.flush_cache)
    r.add_post("/flush_cache", srv.flush_cache)
    r.add_post("/update_weights_from_disk", srv.update_weights_from_disk)
    r.add_post("/init_weights_update_group", srv.init_weights_update_group)
    r.add_post("/update_weights_from_distributed", srv.update_weights_from_distributed)
    r.add_post("/destroy_weights_update_group", srv.destroy_weights_update_group)
    r.add_post("/update_weight_version", srv.update_weight_version)
    r.add_route("GET", "/get_weights_by_name", srv.get_weights_by_name)
    r.add_post("/get_weights_by_name", srv.get_weights_by_name)
    r.add_get("/weights_fingerprint", srv.weights_fingerprint)
    r.add_get("/health", srv.health)
    r.add_get("/health_generate", srv.health_generate)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, srv.get_model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, srv.get_server_info)
    r.add_get("/v1/models", srv.list_models)
    r.add_post("/v1/completions", srv.completions)
    r.add_post("/v1/chat/completions", srv.chat_completions)
    return app


@dataclass
class RunningServer:
    """A started server: `url` to call, `engine` behind it, `close()` to stop both (in that order: requests in
    flight are aborted, the listener closes, then the engine shuts down)."""

    url: str
    engine: Engine
    runner: web.AppRunner
    server: SGLangServer

    async def close(self) -> None:
        if self.server.status == "stopping":
            return
        self.server.status = "stopping"
        with contextlib.suppress(Exception):
            await self.engine.abort(abort_all=True)
            if self.engine.paused:
                await self.engine.resume()  # waiting requests were aborted; nothing left to hold
        await self.runner.cleanup()
        await self.engine.shutdown()

    async def __aenter__(self) -> RunningServer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


async def start_server(
    model: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    api_key: str | None = None,
    *,
    engine: Engine | None = None,
    served_model_name: str | None = None,
    **engine_kw: Any,
) -> RunningServer:
    """Bind `host:port` (0 = an ephemeral port), start the engine, and return once the server is ready.

    `engine_kw` go to `AsyncEngine(model, ...)` (device, dtype, max_total_tokens, max_running_requests,
    weight_version, seed); pass `engine=` to serve an engine you built yourself. While the engine starts, the
    port is already bound and /health answers 503, as SGLang's does.
    """
    if engine is None:
        from areal_async.server.engine import AsyncEngine  # lazy: torch; the app serves any Engine without it

        # loading a checkpoint takes seconds to minutes: keep the caller's event loop responsive meanwhile
        engine = await asyncio.to_thread(AsyncEngine, model, **engine_kw)
    app = build_app(engine, api_key=api_key, served_model_name=served_model_name)
    srv = app[SERVER_KEY]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_port = runner.addresses[0][1]
        url_host = f"[{host}]" if ":" in host else host
        srv.url = f"http://{url_host}:{bound_port}"
        await engine.start()
    except BaseException:
        await runner.cleanup()
        raise
    srv.status = "ready"
    log.info("serving %s at %s", model, srv.url)
    return RunningServer(url=srv.url, engine=engine, runner=runner, server=srv)

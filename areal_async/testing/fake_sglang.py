"""A stand-in SGLang server for client tests: SGLang 0.5.x's /generate shapes (JSON and SSE streams), pause and
abort, weight updates, and faults on demand.

Not a model and not our server: it exists because a real server will not, on demand, answer 500 twice, hang like a
stopped process, abort a request "from elsewhere" at a chosen token, switch weights at a chosen token, or fail a
weight update on one replica. It records what it received. Its "model" is arithmetic: token ids 4..29 stand for the
letters a..z and the next token is the letter after the last input token (wrapping), so outputs are predictable and
a resubmitted request continues seamlessly. Behaviour the client relies on is also tested against the real
embedded server (tests/test_client.py, tests/test_interruption.py, tests/test_client_faults.py).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgspec
from aiohttp import web

from areal_async.testing.fake_weight_groups import FakeWeightGroups

FIRST, NUM = 4, 26  # token ids 4..29 are the letters a..z


def tok_text(t: int) -> str:
    return chr(ord("a") + (t - FIRST) % NUM) if FIRST <= t < FIRST + NUM else f"<{t}>"


def next_tok(t: int) -> int:
    return FIRST + (t - FIRST + 1) % NUM if FIRST <= t < FIRST + NUM else FIRST


def tok_logprob(t: int, version: str) -> float:
    v = 0 if version == "default" else int(version)
    return -0.01 * t - v


LORA_OFF = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
LORA_OFF_GENERATE = (
    "Please launch the server with --enable-lora flag and preload adapters using --lora-paths or "
    "/load_lora_adapter endpoint."
)
# /flush_cache's plain-text answer (http_server.py), 200 when taken
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the "
    "operation will not be performed.)\n"
)


def lora_logprob(name: str | None) -> float:
    """What an adapter adds to every logprob: -0.001 * its version for our names (areal-v<k>), 0 for the base."""
    rest = name.rsplit("v", 1)[-1] if name else ""
    return -0.001 * int(rest) if rest.isdigit() else 0.0


# SGLang's sampling_params keys (0.5.22 refuses others)
_SAMPLING_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty presence_penalty "
    "repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos skip_special_tokens "
    "spaces_between_special_tokens no_stop_trim stream_interval logit_bias sampling_seed custom_params".split()
)


class FakeSGLang(FakeWeightGroups):
    def __init__(self, port: int = 0, *, token_delay: float = 0.0, version: str = "default"):
        self.port = port
        self.token_delay = token_delay
        self.version = version
        self.received: list[dict] = []  # /generate bodies in arrival order
        self.auth: list[str | None] = []
        self.fail_statuses: list[int] = []  # popped one per /generate: answer with this status instead
        self.abort_after: list[int] = []  # popped one per /generate: abort after this many tokens
        self.health_status = 200
        self.hung = False  # like SIGSTOP: connections are accepted, nothing is answered
        self.spans = False  # report meta_info.weight_version_spans (our embedded server does; SGLang does not)
        self.incremental = False  # streams carry only the new tokens (SGLang's --incremental-streaming-output)
        # (n, version), in order: when a request has made n tokens, the weights become that version (the head
        # entry applies to whichever request reaches its n first; then the next entry waits for its n)
        self.version_at: list[tuple[int, str]] = []
        self.dist_ok = True
        self.mutate = None  # callable(answer dict): edits every /generate answer or event before it is sent
        self.update_ok = True
        self.admin: list[tuple[str, dict]] = []
        self.paused = False
        # SGLang's own behaviour where our fake is lenient by default:
        # - sglang_health: /health is SGLang's health_generate, a one-token generation that waits for
        #   /continue_generation while paused and answers 503 after `health_pause_timeout` s; an in-place pause
        #   also holds decoding (the scheduler launches no batch)
        # - exact_abort: /abort_request matches the rid exactly (TokenizerManager.abort_request), not as a prefix
        # - model_info_path: where the weight version is served ("/get_model_info": SGLang before the rename)
        # - sglang_version: the `version` /get_server_info reports (None: the field is left out)
        self.sglang_health = False
        self.health_pause_timeout = 20.0
        self.exact_abort = False
        self.model_info_path = "/model_info"
        self.sglang_version: str | None = None
        # as recorded from real releases (tests/fixtures/sglang/<release>/answers.json; FakeSGLang.like sets them):
        # - both_model_info: /model_info and /get_model_info both answer
        # - server_args: ServerArgs fields /get_server_info adds (dtype, tp_size, ...; left out by default: tests
        #   of the broadcast layout give their own)
        # - retractions_key: meta_info's retraction count ("total_retractions" at 0.5.10, "num_retractions" at 0.5.23)
        # - unknown_key_500: an unknown sampling_params key fails SamplingParams(**kw) with a 500, before 0.5.22
        self.both_model_info = False
        self.server_args: dict[str, Any] = {}
        self.retractions_key = "total_retractions"
        self.unknown_key_500 = False
        # what later releases changed (FakeSGLang.like sets them for a release; tests/test_sglang_conformance.py
        # runs the same checks against this and a real server of the release):
        # - version_spans (0.5.19): the finishing answer carries meta_info.weight_versions [{version, start, end}]
        # - update_sessions (0.5.21): /update_weights_from_distributed only between /begin_ and /end_weight_update
        # - strict_json (0.5.22): unknown sampling_params keys are a 400
        self.version_spans = False
        self.update_sessions = False
        self.strict_json = False
        self.in_session = False
        self.health_calls = 0
        # a real member of the trainer's weight-update group (gloo, CPU), as SGLang is one with nccl: it joins at
        # /init_weights_update_group and receives every tensor of a bucket by broadcast. Opt-in (it loads torch):
        # - fail_bucket: the bucket (0-based, counted per group) it fails like an SGLang whose allocation fails:
        #   it receives `fail_after_tensors` of that bucket's tensors, then answers success=false, alive and
        #   still in the group
        # - buckets: (group name, bucket index, names received) per bucket call, in order
        self.gloo_member = False
        self.fail_bucket: int | None = None
        self.fail_after_tensors = 0
        self.buckets: list[tuple[str, int, list[str]]] = []
        # /get_weights_by_name, as SGLang serves it: `weights` is name -> the parameter as nested lists of floats
        # (rows first), answered as `weights[name][:truncate_size]`; an unknown name is SGLang's 400. A load of a
        # path in `weights_by_path` makes that path's weights the served ones (a load of any other path keeps
        # them, like a server whose load silently did nothing)
        self.weights: dict[str, list] = {}
        self.weights_by_path: dict[str, dict[str, list]] = {}
        # SGLang's LoRA serving (--enable-lora; lora/lora_registry.py, the tokenizer manager's load/unload): a
        # registry name -> path; /generate's `lora_path` names an adapter and its tokens' logprobs carry that
        # adapter (lora_logprob); an unload unregisters at once and answers once the requests under it finished.
        # Faults: a load of a path in `lora_fail_paths` is refused (SGLang's 400), `lora_silent` answers success
        # without registering (an adapter that never arrives)
        self.lora_enabled = False
        self.adapters: dict[str, str] = {}
        self.lora_fail_paths: set[str] = set()
        self.lora_silent = False
        self.lora_calls: list[tuple[str, dict]] = []  # ("load" | "unload", body), in arrival order
        self._lora_users: dict[str, int] = {}  # adapter name -> requests in flight under it
        self._groups: dict[str, Any] = {}
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._inflight: dict[str, dict] = {}
        self._runner: web.AppRunner | None = None

    @classmethod
    def like(cls, release: str, **kw: Any) -> FakeSGLang:
        """A stand-in that answers as SGLang `release` does where the client can tell (the checks that hold it to
        the real server are in tests/test_sglang_conformance.py)."""
        fake = cls(**kw)
        v = tuple(int(p) for p in release.split(".")[:3])
        fake.sglang_version = release
        fake.sglang_health = fake.exact_abort = True
        fake.version_spans = v >= (0, 5, 19)
        fake.update_sessions = v >= (0, 5, 21)
        fake.strict_json = v >= (0, 5, 22)
        fake.unknown_key_500 = not fake.strict_json
        fake.both_model_info = True
        fake.retractions_key = "num_retractions" if v > (0, 5, 10) else "total_retractions"
        fake.server_args = {"dtype": "bfloat16", "tp_size": 1, "dp_size": 1, "pp_size": 1,
                            "enable_dp_attention": False, "disable_radix_cache": True}  # fmt: skip
        return fake

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    async def wait_progress(self, n_requests: int, n_tokens: int) -> None:
        """Until `n_requests` are in flight and each has made at least `n_tokens` tokens."""
        for _ in range(5000):
            made = [st["made"] for st in self._inflight.values()]
            if len(made) >= n_requests and min(made) >= n_tokens:
                return
            await asyncio.sleep(0.002)
        raise AssertionError("stand-in made no progress")

    async def start(self) -> FakeSGLang:
        @web.middleware
        async def hang(request: web.Request, handler):  # a stopped process answers nothing, on any endpoint
            await self._hang_if_hung()
            return await handler(request)

        app = web.Application(middlewares=[hang])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/get_model_info", self._model_info)
        app.router.add_get("/get_server_info", self._server_info)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_post("/update_weights_from_disk", self._update)
        app.router.add_post("/update_weight_version", self._update_version)
        app.router.add_post("/init_weights_update_group", self._init_group)
        app.router.add_post("/destroy_weights_update_group", self._destroy_group)
        app.router.add_post("/flush_cache", self._flush)
        app.router.add_post("/begin_weight_update", self._session)
        app.router.add_post("/end_weight_update", self._session)
        app.router.add_post("/update_weights_from_distributed", self._distributed)
        app.router.add_route("GET", "/get_weights_by_name", self._weights_by_name)
        app.router.add_post("/get_weights_by_name", self._weights_by_name)
        app.router.add_post("/load_lora_adapter", self._load_lora)
        app.router.add_post("/unload_lora_adapter", self._unload_lora)
        self._runner = web.AppRunner(app, shutdown_timeout=0.05, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    async def kill(self) -> None:
        """Drop every connection and stop listening, like a crashed process."""
        for st in list(self._inflight.values()):
            st["task"].cancel()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._inflight.clear()

    @staticmethod
    def _json(obj, status: int = 200) -> web.Response:
        return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")

    async def _hang_if_hung(self) -> None:
        while self.hung:
            await asyncio.sleep(0.01)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        self.received.append(body)
        self.auth.append(request.headers.get("Authorization"))
        await self._hang_if_hung()
        if self.fail_statuses:
            status = self.fail_statuses.pop(0)
            return self._json({"error": {"message": f"injected {status}"}}, status)
        sp = body["sampling_params"]
        unknown = sorted(set(sp) - _SAMPLING_KEYS) if self.strict_json or self.unknown_key_500 else []
        if unknown and self.unknown_key_500:
            return web.Response(text="Internal Server Error", status=500)
        if unknown:
            return self._json({"error": f"unknown field `{unknown[0]}`, expected one of ..."}, 400)
        if sp["max_new_tokens"] > 10_000:
            return self._json({"error": {"message": "max_new_tokens is too large"}}, 400)
        rid = body["rid"]
        if rid in self._inflight:
            return self._json({"error": {"message": f"rid {rid} in flight"}}, 400)
        lora = body.get("lora_path")
        if lora is not None and not self.lora_enabled:  # the tokenizer manager's _validate_and_resolve_lora
            why = f"LoRA adapter '{lora}' was requested, but LoRA is not enabled. " + LORA_OFF_GENERATE
            return self._json({"error": {"message": why}}, 400)
        if lora is not None:  # the tokenizer manager resolves the name first (LoRARegistry.acquire)
            if lora not in self.adapters:
                why = f"The following requested LoRA adapters are not loaded: {lora}\n"
                return self._json({"error": {"message": why + f"Loaded adapters: {list(self.adapters)}."}}, 400)
            self._lora_users[lora] = self._lora_users.get(lora, 0) + 1  # acquired before it waits
        try:
            await self._resumed.wait()  # a request that arrives while paused waits, as in SGLang
        except BaseException:
            if lora is not None:
                self._lora_users[lora] -= 1
            raise
        st = {"aborted": False, "task": asyncio.current_task(), "made": 0}
        self._inflight[rid] = st
        resp: web.StreamResponse | None = None
        try:
            abort_at = self.abort_after.pop(0) if self.abort_after else None
            ids = list(body["input_ids"])
            out: list[int] = []
            vers: list[str] = []  # the version that made each token
            finish: dict | None = None
            stops = sp.get("stop") or []
            text = ""
            with_text = body.get("return_text_in_logprobs", False)
            stream = body.get("stream", False)
            sent = 0  # tokens already streamed
            answered = [0]  # answers (events) sent so far

            def answer(final: bool) -> dict:
                lo = sent if (stream and self.incremental) else 0
                meta = {
                    "id": rid,
                    "finish_reason": finish if final else None,
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out),
                    "cached_tokens": 0,
                    "cached_tokens_details": None,
                    "dp_rank": None,
                    "reasoning_tokens": 0,
                    self.retractions_key: 0,
                    "weight_version": self.version,
                    "input_token_logprobs": [],
                    "output_token_logprobs": [
                        [tok_logprob(t, v) + lora_logprob(lora), t, tok_text(t) if with_text else None]
                        for t, v in zip(out[lo:], vers[lo:])
                    ],
                    "output_token_logprobs_length": len(out) - lo,
                }
                if final:
                    meta["e2e_latency"] = 0.0
                if not answered[0]:  # SGLang stamps the first answer of a request only
                    meta["response_sent_to_client_ts"] = 0.0
                answered[0] += 1
                if final and self.version_spans and out:
                    starts = [k for k in range(len(vers)) if k == 0 or vers[k] != vers[k - 1]]
                    ends = [*starts[1:], len(vers)]
                    meta["weight_versions"] = [{"version": vers[a], "start": a, "end": b} for a, b in zip(starts, ends)]
                if self.spans:
                    vs = vers[lo:]  # offsets into this answer's output_ids
                    meta["weight_version_spans"] = [[k, v] for k, v in enumerate(vs) if k == 0 or v != vs[k - 1]]
                ans = {"text": text if lo == 0 else text[lo:], "output_ids": out[lo:], "meta_info": meta}
                if self.mutate is not None:
                    self.mutate(ans)
                return ans

            if stream:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
            while len(out) < sp["max_new_tokens"]:
                await asyncio.sleep(self.token_delay)
                await self._hang_if_hung()
                if self.sglang_health and self.paused and not st["aborted"]:
                    await self._resumed.wait()  # in place: the request keeps its state and waits
                if st["aborted"] or (abort_at is not None and len(out) >= abort_at):
                    finish = {
                        "type": "abort",
                        "message": "Abort before prefill" if not out else "Aborted",
                        "status_code": None,
                        "err_type": None,
                    }
                    break
                if self.version_at and len(out) == self.version_at[0][0]:
                    self.version = self.version_at.pop(0)[1]
                t = next_tok(ids[-1] if not out else out[-1])
                out.append(t)
                vers.append(self.version)
                st["made"] = len(out)
                text += tok_text(t)
                if len(out) >= sp.get("min_new_tokens", 0):
                    hit = next((s for s in stops if text.endswith(s)), None)  # own segment only, like SGLang
                    if hit is not None:
                        finish = {"type": "stop", "matched": hit}
                        text = text[: -len(hit)]
                        break
                if resp is not None and len(out) < sp["max_new_tokens"]:  # the last token comes with the finish
                    await resp.write(b"data: " + msgspec.json.encode(answer(False)) + b"\n\n")
                    sent = len(out)
            if finish is None:
                finish = {"type": "length", "length": sp["max_new_tokens"]}
            if resp is None:
                return self._json(answer(True))
            await resp.write(b"data: " + msgspec.json.encode(answer(True)) + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except ConnectionResetError:  # the client went away mid-stream (aiohttp's reset error subclasses it)
            assert resp is not None
            return resp
        finally:
            self._inflight.pop(rid, None)
            if lora is not None:
                self._lora_users[lora] -= 1

    async def _health(self, request: web.Request) -> web.Response:
        await self._hang_if_hung()
        self.health_calls += 1
        if self.sglang_health and self.paused:
            try:
                await asyncio.wait_for(self._resumed.wait(), self.health_pause_timeout)
            except TimeoutError:
                return web.Response(status=503)
        return web.Response(status=self.health_status)

    async def _model_info(self, request: web.Request) -> web.Response:
        if request.path != self.model_info_path and not self.both_model_info:
            return self._json({"detail": "Not Found"}, 404)
        return self._json(
            {"model_path": "fake", "tokenizer_path": "fake", "is_generation": True, "weight_version": self.version}
        )

    async def _server_info(self, request: web.Request) -> web.Response:
        await self._hang_if_hung()
        info = {"model_path": "fake", "incremental_streaming_output": self.incremental, **self.server_args}
        if self.sglang_version is not None:
            info["version"] = self.sglang_version
        return self._json(info)

    async def _pause(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        self.admin.append(("pause", body))
        self.paused = True
        self._resumed.clear()
        if body.get("mode", "abort") == "abort":
            marked = set(self._inflight)
            for st in self._inflight.values():
                st["aborted"] = True
            while marked & set(self._inflight):  # returns once the aborted requests have answered
                await asyncio.sleep(0.001)
        return self._json({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        self.admin.append(("continue", msgspec.json.decode(await request.read())))
        self.paused = False
        self._resumed.set()
        return self._json({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        self.admin.append(("abort", body))
        for rid, st in self._inflight.items():
            wanted = body.get("rid", "")
            if body.get("abort_all") or (rid == wanted if self.exact_abort else rid.startswith(wanted)):
                st["aborted"] = True
        return web.Response(status=200)

    async def _update(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        self.admin.append(("update", body))
        path = body.get("model_path", "")
        if not self.update_ok:
            return self._json({"success": False, "message": "cannot load", "num_paused_requests": 0}, 400)
        if os.path.isdir(path) and not os.listdir(path):  # a folder without weights, as SGLang words it
            why = f"Failed to get weights iterator: Cannot find any model weights with `{path}`."
            return self._json({"success": False, "message": why, "num_paused_requests": 0}, 400)
        self.version = body["weight_version"]
        if path in self.weights_by_path:
            self.weights = self.weights_by_path[path]
        why = f"Succeeded to update model weights. Weight version updated to {self.version}."
        return self._json({"success": True, "message": why, "num_paused_requests": 0})

    async def _weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang 0.5's GetWeightsByNameReqInput {"name", "truncate_size": 100}; the answer is the parameter's
        first `truncate_size` rows as a JSON nested list (float values), or a 400 error object."""
        raw = await request.read()
        body = msgspec.json.decode(raw) if raw.strip() else {}
        self.admin.append(("get_weights_by_name", body))
        name, size = body.get("name"), int(body.get("truncate_size", 100))
        if name not in self.weights:
            return self._json({"error": {"message": "Get parameter by name failed"}}, 400)
        return self._json(self.weights[name][:size])

    async def _session(self, request: web.Request) -> web.Response:
        if not self.update_sessions:
            return self._json({"detail": "Not Found"}, 404)
        self.admin.append((request.path, {}))
        opening = request.path == "/begin_weight_update"
        if opening and self.in_session:
            return self._json({"success": False, "message": "a weight-update session is already open"}, 400)
        self.in_session = opening
        return self._json({"success": True, "message": "Success"})

    async def _flush(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.admin.append((request.path, msgspec.json.decode(raw) if raw else {}))
        return web.Response(text=FLUSHED)

    async def _distributed(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        self.admin.append((request.path, body))
        if self.update_sessions and not self.in_session:
            why = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            return self._json({"success": False, "message": why}, 400)
        if not self.dist_ok:
            return self._json({"success": False, "message": "broadcast failed"}, 400)
        if self.gloo_member:
            answer = await self._receive(body)
            if answer.status != 200:
                return answer
        if "weight_version" in body:  # as SGLang: the buckets received are relabelled; no label, the old one
            self.version = body["weight_version"]
        return self._json({"success": True, "message": "ok"})

    def _lora_answer(self, ok: bool, why: str = "", *, listed: bool = True) -> web.Response:
        """SGLang's LoRAUpdateOutput as http_server.py sends it (orjson of the dataclass, BaseReq's fields too):
        200 on success, else 400; `loaded_adapters` maps every registered name to its path, except in a refusal
        the tokenizer manager makes itself (LoRA off, an unknown name to unload), which lists none."""
        out = {"success": ok, "error_message": why, "loaded_adapters": dict(self.adapters) if listed else None}
        return self._json({**out, "rid": None, "http_worker_ipc": None}, 200 if ok else 400)

    async def _load_lora(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        self.lora_calls.append(("load", body))
        name, path = body.get("lora_name", ""), body.get("lora_path", "")
        if not self.lora_enabled:
            return self._lora_answer(False, LORA_OFF, listed=False)
        if name in self.adapters:
            return self._lora_answer(False, f"Failed to load LoRA adapter {name} because it is already loaded")
        if path in self.lora_fail_paths:
            return self._lora_answer(False, f"Can't find adapter_config.json in {path}")
        if not self.lora_silent:
            self.adapters[name] = path
        return self._lora_answer(True)

    async def _unload_lora(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        self.lora_calls.append(("unload", body))
        name = body.get("lora_name", "")
        if not self.lora_enabled:
            return self._lora_answer(False, LORA_OFF, listed=False)
        if name not in self.adapters:
            why = f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}"
            return self._lora_answer(False, why, listed=False)
        del self.adapters[name]  # unregistered at once: new requests naming it are refused
        while self._lora_users.get(name, 0) > 0:  # the adapter leaves memory once the requests under it finished
            await asyncio.sleep(0.002)
        return self._lora_answer(True)

    async def _update_version(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        self.admin.append(("version", body))
        self.version = body["new_version"]
        why = f"Weight version updated to {self.version}"
        return self._json({"success": True, "message": why, "new_version": self.version})

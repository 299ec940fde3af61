"""An OpenAI-compatible endpoint in front of the policy, recording every call for training.

Agents written against the official `openai` SDK run unchanged: point them at the proxy,

    client = AsyncOpenAI(base_url=proxy.base_url, api_key=episode_id)     # base_url ends in /v1

and every request goes through `InferenceClient.agenerate` with token ids (so interruption and resumption,
routing with the episode as the sticky session key, and per-token policy versions all apply). The proxy renders
the chat template itself (Tokenizer), decodes the output, and parses Qwen-style tool calls
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) into OpenAI `tool_calls`.

Episodes. The episode id travels as the API key (`Authorization: Bearer <id>`, what the SDK sends) or, taking
precedence, as an `X-Episode-Id` header. Ids come from `start_episode()`: random, unguessable, and by default the
only ones accepted (401 otherwise), so the ids double as capabilities; `require_known_episodes=False` creates
episodes on first use instead. Each call's prompt ids, output ids, logprobs and versions are recorded in the
episode (see episode.py for rewards, discounting and export).

Token continuity: a chat request whose messages start with an earlier call's messages plus the assistant message
that call returned (the usual agent loop) is NOT re-rendered from text: its prompt is the earlier call's prompt +
its output ids + the template's end-of-turn + the new messages rendered as a delta. So the tokens trained are the
tokens sampled, and the episode exports as one concatenated trajectory. Completions get the same treatment when a
prompt text extends an earlier prompt + its returned text exactly.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /v1/reward
(`{"reward": float, "call_id": optional}`, episode from the key), GET /v1/episode (what was recorded).
Streaming is answered in OpenAI's SSE format, but as one content chunk after generation finishes.
Not supported (400): `echo`, `suffix`, `best_of`; `top_logprobs` is answered with empty lists.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgspec
from aiohttp import web

from areal_async.agent.episode import CallRecord, Episode, ExportMode
from areal_async.inference.client import InferenceError
from areal_async.rollout.workflow_api import Generator
from areal_async.rollout.chat import ChatTokens
from areal_async.tokenizer import Tokenizer
from areal_async.types import GenerationResult, SamplingParams, Sample, Trajectory

log = logging.getLogger(__name__)

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; OpenAI clients expect a number
MAX_N = 16


class ProxyError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


# ---- request shapes (unknown fields are ignored, as OpenAI's server does for most) ------------------------------


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = None
    user: str | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class ChatRequest(_Common, kw_only=True):
    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream_options: dict | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # str | list[str] | list[int] | list[list[int]], checked in _completion_prompts
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class RewardRequest(msgspec.Struct, kw_only=True):
    reward: float
    call_id: str | None = None


# ---- tool calls --------------------------------------------------------------------------------------------------


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Split Qwen-format tool calls out of `text`: (remaining content or None, OpenAI tool_calls).

    A block whose body is not a JSON object with a "name" stays in the content, untouched: the agent sees what the
    model wrote rather than a silently dropped call.
    """
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name = obj["name"]
            if not isinstance(name, str) or not name:
                raise ValueError("tool name must be a non-empty string")
            args = obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name,
                                   "arguments": args if isinstance(args, str) else json.dumps(args,
                                                                                              ensure_ascii=False)}})
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


# ---- message normalisation ------------------------------------------------------------------------------------


def _flatten_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in ("text", "input_text"):
                parts.append(str(p.get("text", "")))
            elif isinstance(p, str):
                parts.append(p)
            else:
                raise ProxyError("only text content parts are supported", param="messages")
        return "".join(parts)
    raise ProxyError(f"message content must be a string or a list of parts, got {type(content).__name__}",
                     param="messages")


def _args_obj(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: text content, tool-call arguments as objects (Qwen's template
    applies `tojson` to them, so a JSON string would be encoded twice)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ProxyError(f"messages[{i}] must be an object with a role", param="messages")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = _flatten_content(m.get("content"))
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = dict(tc.get("function") or {})
                fn["arguments"] = _args_obj(fn.get("arguments", {}))
                calls.append({**tc, "function": fn})
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _same_message(a: dict, b: dict) -> bool:
    """Equal as far as the model is concerned: role, text, tool call names and arguments, tool_call_id."""
    def key(m: dict) -> tuple:
        calls = tuple((tc.get("function", {}).get("name"), json.dumps(_args_obj(tc.get("function", {})
                                                                                 .get("arguments")), sort_keys=True))
                      for tc in (m.get("tool_calls") or []))
        return (m.get("role"), _flatten_content(m.get("content")).strip(), calls, m.get("tool_call_id"))

    try:
        return key(a) == key(b)
    except ProxyError:
        return False


# ---- the proxy -------------------------------------------------------------------------------------------------


class _EpisodeState:
    def __init__(self, episode: Episode, generator: Generator | None) -> None:
        self.episode = episode
        self.generator = generator


class OpenAIProxy:
    """OpenAI-compatible HTTP front for a `Generator` (usually the controller's InferenceClient)."""

    def __init__(self, generator: Generator | None, tokenizer: Tokenizer, *, model_name: str = "areal-policy",
                 default_max_tokens: int = 512, max_context_tokens: int | None = None,
                 require_known_episodes: bool = True, token_continuity: bool = True) -> None:
        self.generator = generator
        self.tok = tokenizer
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.max_context_tokens = max_context_tokens
        self.require_known_episodes = require_known_episodes
        self.token_continuity = token_continuity
        self._episodes: dict[str, _EpisodeState] = {}
        self._chat_tokens: ChatTokens | None = None
        self._runner: web.AppRunner | None = None
        self.url: str | None = None
        self._created = int(time.time())

    # ---- episodes (Python API) ---------------------------------------------------------------------------------

    def start_episode(self, episode_id: str | None = None, *, generator: Generator | None = None,
                      group_id: int = 0, meta: dict | None = None) -> str:
        """Open an episode and return its id (the API key the agent uses). `generator` overrides the proxy's own
        for this episode's calls (a workflow passes the controller's client here)."""
        eid = episode_id or "ep-" + secrets.token_urlsafe(18)
        if eid in self._episodes:
            raise ValueError(f"episode {eid!r} already exists")
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,200}", eid):
            raise ValueError("episode ids are 1-200 characters of [A-Za-z0-9_.:-]")
        self._episodes[eid] = _EpisodeState(Episode(eid, group_id=group_id, meta=meta), generator)
        return eid

    def episode(self, episode_id: str) -> Episode:
        try:
            return self._episodes[episode_id].episode
        except KeyError:
            raise KeyError(f"unknown episode {episode_id!r}") from None

    def set_reward(self, episode_id: str, reward: float, call_id: str | None = None) -> None:
        self.episode(episode_id).set_reward(reward, call_id)

    def finish_episode(self, episode_id: str, *, discount: float = 1.0, mode: ExportMode = "auto"
                       ) -> list[Trajectory]:
        """Close the episode and export it (see episode.py). Later calls with its id are refused."""
        ep = self.episode(episode_id)
        trajs = ep.to_trajectories(discount, mode)
        del self._episodes[episode_id]
        return trajs

    def discard_episode(self, episode_id: str) -> None:
        self._episodes.pop(episode_id, None)

    @property
    def num_episodes(self) -> int:
        return len(self._episodes)

    # ---- HTTP server --------------------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[self._errors])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/reward", self.reward)
        app.router.add_get("/v1/episode", self.episode_summary)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0: any free port); returns the base URL for OpenAI clients (ends in /v1)."""
        # a client that hangs up cancels its handler, and with it the generation (the client aborts it on the
        # server); the call is then not recorded, since the agent never saw it
        self._runner = web.AppRunner(self.build_app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        self.url = f"http://{host}:{bound}"
        return self.base_url

    @property
    def base_url(self) -> str:
        if self.url is None:
            raise RuntimeError("the proxy is not started")
        return self.url + "/v1"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self.url = None

    async def __aenter__(self) -> "OpenAIProxy":
        if self._runner is None:
            await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ProxyError as e:
            return _error(str(e), e.status, e.param)
        except web.HTTPException:
            raise
        except asyncio.CancelledError:
            raise
        except InferenceError as e:  # the servers refused (4xx: the request's fault) or could not serve
            if isinstance(e.status, int) and 400 <= e.status < 500:
                return _error(str(e), 400)
            log.warning("proxy: %s %s: inference failed: %s", request.method, request.path, e)
            return _error(f"inference failed: {e}", 502)
        except ValueError as e:  # the client's own input checks
            return _error(str(e), 400)
        except Exception as e:  # never a traceback to the agent; keep serving
            log.exception("proxy: %s %s failed", request.method, request.path)
            return _error(f"{type(e).__name__}: {e}", 500)

    def _state(self, request: web.Request) -> _EpisodeState:
        eid = request.headers.get("X-Episode-Id")
        if not eid:
            auth = request.headers.get("Authorization", "")
            if auth.lower().startswith("bearer "):
                eid = auth[7:].strip()
        if not eid:
            raise ProxyError("no episode: send the episode id as the API key or an X-Episode-Id header", 401)
        st = self._episodes.get(eid)
        if st is None:
            if self.require_known_episodes:
                raise ProxyError("unknown or finished episode id", 401)
            self.start_episode(eid)
            st = self._episodes[eid]
        return st

    @staticmethod
    async def _body(request: web.Request, typ: type) -> Any:
        raw = await request.read()
        try:
            return msgspec.json.decode(raw, type=typ)
        except msgspec.ValidationError as e:
            raise ProxyError(f"invalid request: {e}") from None
        except msgspec.DecodeError as e:
            raise ProxyError(f"body is not valid JSON: {e}") from None

    # ---- sampling -----------------------------------------------------------------------------------------------

    def _sampling(self, req: _Common, max_new: int | None) -> SamplingParams:
        if not 1 <= req.n <= MAX_N:
            raise ProxyError(f"n must be in [1, {MAX_N}]", param="n")
        max_new = self.default_max_tokens if max_new is None else max_new
        if max_new < 1:
            raise ProxyError("max_tokens must be >= 1", param="max_tokens")
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        if temperature < 0 or not 0 < top_p <= 1:
            raise ProxyError("temperature must be >= 0 and top_p in (0, 1]")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=top_p,
                              top_k=-1 if req.top_k is None else req.top_k,
                              min_p=0.0 if req.min_p is None else req.min_p, stop=stop or None,
                              stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos)

    def _check_context(self, prompt_ids: list[int], sp: SamplingParams) -> SamplingParams:
        if self.max_context_tokens is None:
            return sp
        room = self.max_context_tokens - len(prompt_ids)
        if room < 1:
            raise ProxyError(f"the prompt has {len(prompt_ids)} tokens; the context limit is "
                             f"{self.max_context_tokens}", param="messages")
        return msgspec.structs.replace(sp, max_new_tokens=min(sp.max_new_tokens, room))

    async def _generate(self, st: _EpisodeState, prompt_ids: list[int], sp: SamplingParams, n: int
                        ) -> list[GenerationResult]:
        gen = st.generator or self.generator
        if gen is None:
            raise ProxyError("the proxy has no generator for this episode", 500)
        return list(await asyncio.gather(*(gen.agenerate(list(prompt_ids), sp, session_key=st.episode.id)
                                           for _ in range(n))))

    def _text(self, g: GenerationResult) -> str:
        """The output as text, cut at a matched stop string (the ids keep every generated token)."""
        text = self.tok.decode(g.output_ids)
        if g.finish_reason == "stop" and isinstance(g.matched_stop, str) and g.matched_stop:
            cut = text.find(g.matched_stop)
            if cut >= 0:
                text = text[:cut]
        return text

    @staticmethod
    def _finish(g: GenerationResult) -> str:
        return {"stop": "stop", "length": "length"}.get(g.finish_reason, "abort")

    def _token_texts(self, ids: list[int]) -> list[str]:
        return [self.tok.decode([t], skip_special_tokens=False) for t in ids]

    # ---- /v1/chat/completions -----------------------------------------------------------------------------------

    @property
    def chat_tokens(self) -> ChatTokens:
        if self._chat_tokens is None:
            self._chat_tokens = ChatTokens(self.tok)
        return self._chat_tokens

    def _chat_prompt(self, ep: Episode, messages: list[dict], tools: list[dict] | None, tools_json: str | None
                     ) -> tuple[list[int], str | None]:
        """(prompt ids, id of the call continued or None)."""
        if self.token_continuity:
            for call in reversed(ep.calls):
                if call.kind != "chat" or call.messages is None or call.response_message is None \
                        or call.tools_json != tools_json:
                    continue
                prefix = call.messages + [call.response_message]
                if len(messages) > len(prefix) and all(_same_message(a, b) for a, b in zip(messages, prefix)):
                    try:
                        tail = self.chat_tokens.delta_ids(template_messages(messages[len(prefix):]))
                    except ValueError:
                        break  # this template cannot append: render from scratch
                    ids = (call.prompt_ids + call.output_ids + self.chat_tokens.close_turn_ids(call.output_ids)
                           + tail)
                    return ids, call.call_id
        ids = self.tok.apply_chat_template(template_messages(messages), tools=tools, add_generation_prompt=True)
        assert isinstance(ids, list)
        return ids, None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        st = self._state(request)
        req: ChatRequest = await self._body(request, ChatRequest)
        if not req.messages:
            raise ProxyError("messages must not be empty", param="messages")
        sp = self._sampling(req, req.max_completion_tokens or req.max_tokens)
        tools = req.tools or None
        tools_json = json.dumps(tools, sort_keys=True) if tools else None
        try:
            prompt_ids, continued = self._chat_prompt(st.episode, req.messages, tools, tools_json)
        except ValueError as e:  # the template refused these messages (raise_exception in Jinja)
            raise ProxyError(f"chat template: {e}", param="messages") from None
        sp = self._check_context(prompt_ids, sp)
        gens = await self._generate(st, prompt_ids, sp, req.n)
        rid = "chatcmpl-" + uuid.uuid4().hex
        parse_tools = tools is not None and req.tool_choice != "none"
        choices = []
        for i, g in enumerate(gens):
            text = self._text(g)
            content, calls = parse_tool_calls(text) if parse_tools else (text, [])
            finish = "tool_calls" if calls else self._finish(g)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice: dict[str, Any] = {"index": i, "message": message, "finish_reason": finish,
                                      "logprobs": None, "token_ids": g.output_ids}
            if req.logprobs:
                choice["logprobs"] = {"content": [
                    {"token": t, "logprob": _lp(lp), "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(self._token_texts(g.output_ids), g.output_logprobs)]}
            choices.append(choice)
            st.episode.add(CallRecord(
                call_id=rid if req.n == 1 else f"{rid}/{i}", kind="chat", prompt_ids=list(prompt_ids),
                output_ids=list(g.output_ids), output_logprobs=list(g.output_logprobs),
                output_versions=list(g.output_versions), finish_reason=finish, created=time.time(),
                messages=[dict(m) for m in req.messages], response_message=message, tools_json=tools_json))
        body = {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": req.model or self.model_name, "choices": choices, "usage": _usage(prompt_ids, gens),
                "prompt_token_ids": prompt_ids,
                "areal": {"weight_versions": sorted({v for g in gens for v in g.output_versions}),
                             "continued_call": continued}}
        if req.stream:
            return await self._stream_chat(request, body, include_usage=bool((req.stream_options or {})
                                                                              .get("include_usage")))
        return _json(body)

    async def _stream_chat(self, request: web.Request, body: dict, include_usage: bool) -> web.StreamResponse:
        resp = await _open_sse(request)
        base = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                "model": body["model"]}
        for ch in body["choices"]:
            delta: dict[str, Any] = {"role": "assistant", "content": ch["message"]["content"]}
            if ch["message"].get("tool_calls"):
                delta["tool_calls"] = [{**tc, "index": j} for j, tc in enumerate(ch["message"]["tool_calls"])]
            await _sse(resp, {**base, "choices": [{"index": ch["index"], "delta": delta, "logprobs": ch["logprobs"],
                                                   "finish_reason": None}]})
            await _sse(resp, {**base, "choices": [{"index": ch["index"], "delta": {}, "logprobs": None,
                                                   "finish_reason": ch["finish_reason"]}]})
        if include_usage:
            await _sse(resp, {**base, "choices": [], "usage": body["usage"]})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ---- /v1/completions --------------------------------------------------------------------------------------

    def _completion_prompts(self, ep: Episode, prompt: Any) -> list[tuple[list[int], str | None]]:
        """[(prompt ids, prompt text or None)] for str | list[str] | list[int] | list[list[int]]."""
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            items = [list(prompt)]
        else:
            items = list(prompt)
        if not items:
            raise ProxyError("prompt must not be empty", param="prompt")
        out = []
        for it in items:
            if isinstance(it, str):
                if not it:
                    raise ProxyError("text prompts must not be empty", param="prompt")
                out.append((self._continue_text(ep, it), it))
            else:
                if not isinstance(it, list) or not it or not all(
                        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.tok.vocab_size for t in it):
                    raise ProxyError("token prompts must be non-empty lists of valid token ids", param="prompt")
                out.append((list(it), None))
        return out

    def _continue_text(self, ep: Episode, text: str) -> list[int]:
        if self.token_continuity:
            for call in reversed(ep.calls):
                if call.kind == "completion" and call.text is not None and len(text) > len(call.text) \
                        and text.startswith(call.text):
                    return call.prompt_ids + call.output_ids + self.tok.encode(text[len(call.text):])
        return self.tok.encode(text)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        st = self._state(request)
        req: CompletionRequest = await self._body(request, CompletionRequest)
        if req.echo or req.suffix is not None or (req.best_of or 1) > 1:
            raise ProxyError("echo, suffix and best_of are not supported")
        sp = self._sampling(req, 16 if req.max_tokens is None else req.max_tokens)
        prompts = self._completion_prompts(st.episode, req.prompt)
        rid = "cmpl-" + uuid.uuid4().hex
        all_gens: list[GenerationResult] = []
        choices = []
        for p_idx, (ids, ptext) in enumerate(prompts):
            sp_p = self._check_context(ids, sp)
            gens = await self._generate(st, ids, sp_p, req.n)
            for j, g in enumerate(gens):
                idx = p_idx * req.n + j
                text = self._text(g)
                finish = self._finish(g)
                choice: dict[str, Any] = {"index": idx, "text": text, "finish_reason": finish, "logprobs": None,
                                          "token_ids": g.output_ids}
                if req.logprobs is not None:
                    toks = self._token_texts(g.output_ids)
                    offsets, pos = [], 0
                    for t in toks:
                        offsets.append(pos)
                        pos += len(t)
                    choice["logprobs"] = {"tokens": toks, "token_logprobs": [_lp(x) for x in g.output_logprobs],
                                          "text_offset": offsets, "top_logprobs": None}
                choices.append(choice)
                exact = ptext is not None and self.tok.decode(g.output_ids, skip_special_tokens=False) == text
                st.episode.add(CallRecord(
                    call_id=rid if len(prompts) * req.n == 1 else f"{rid}/{idx}", kind="completion",
                    prompt_ids=list(ids), output_ids=list(g.output_ids), output_logprobs=list(g.output_logprobs),
                    output_versions=list(g.output_versions), finish_reason=finish, created=time.time(),
                    text=(ptext + text) if exact else None))
            all_gens += gens
        body = {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": req.model or self.model_name, "choices": choices,
                "usage": {"prompt_tokens": sum(len(ids) for ids, _ in prompts) * req.n,
                          "completion_tokens": sum(len(g.output_ids) for g in all_gens),
                          "total_tokens": sum(len(ids) for ids, _ in prompts) * req.n
                          + sum(len(g.output_ids) for g in all_gens)}}
        if req.stream:
            resp = await _open_sse(request)
            for ch in choices:
                await _sse(resp, {**body, "choices": [{**ch, "finish_reason": None}], "usage": None})
                await _sse(resp, {**body, "choices": [{**ch, "text": "", "logprobs": None}], "usage": None})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        return _json(body)

    # ---- models, rewards, episode --------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                  "created": self._created, "owned_by": "areal_async"}]})

    async def reward(self, request: web.Request) -> web.Response:
        st = self._state(request)
        req: RewardRequest = await self._body(request, RewardRequest)
        try:
            st.episode.set_reward(req.reward, req.call_id)
        except KeyError as e:
            raise ProxyError(str(e.args[0]), 404, "call_id") from None
        except ValueError as e:
            raise ProxyError(str(e), param="reward") from None
        return _json({"ok": True, "episode": st.episode.id, "call_id": req.call_id})

    async def episode_summary(self, request: web.Request) -> web.Response:
        return _json(self._state(request).episode.summary())


def _lp(x: float) -> float:
    return x if x > _NEG_INF_LOGPROB else _NEG_INF_LOGPROB


def _usage(prompt_ids: list[int], gens: list[GenerationResult]) -> dict[str, int]:
    comp = sum(len(g.output_ids) for g in gens)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": comp, "total_tokens": len(prompt_ids) + comp}


_enc = msgspec.json.Encoder()


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_enc.encode(obj), status=status, content_type="application/json")


def _error(message: str, status: int, param: str | None = None) -> web.Response:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status,
                                                                                                  "server_error")
    return _json({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


async def _open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _sse(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + _enc.encode(obj) + b"\n\n")


# ---- a workflow that trains an agent through the proxy ----------------------------------------------------------


@dataclass
class AgentContext:
    """What an agent function gets for one episode: where to send OpenAI requests and with which key."""

    base_url: str
    api_key: str  # the episode id
    sample: Sample
    proxy: OpenAIProxy


AgentFn = Callable[[AgentContext], Awaitable["float | None"]]


class AgentWorkflow:
    """Run `agent(ctx)` `group_size` times per sample against a started proxy; each run is an episode whose
    recorded calls become trajectories. The agent returns the episode reward (or sets rewards itself through
    the proxy and returns None). A failing agent loses only its own episode."""

    def __init__(self, proxy: OpenAIProxy, agent: AgentFn, group_size: int, *, discount: float = 1.0,
                 export: ExportMode = "auto") -> None:
        self.proxy = proxy
        self.agent = agent
        self.group_size = group_size
        self.discount = discount
        self.export = export
        self._starting = asyncio.Lock()

    async def _one(self, client: Generator, sample: Sample) -> list[Trajectory]:
        eid = self.proxy.start_episode(generator=client, meta={"sample": sample.id})
        try:
            reward = await self.agent(AgentContext(self.proxy.base_url, eid, sample, self.proxy))
            if reward is not None:
                self.proxy.set_reward(eid, reward)
            return self.proxy.finish_episode(eid, discount=self.discount, mode=self.export)
        except asyncio.CancelledError:
            self.proxy.discard_episode(eid)
            raise
        except Exception as e:
            log.warning("agent episode on sample %s failed: %s: %s", sample.id, type(e).__name__, e)
            self.proxy.discard_episode(eid)
            return []

    async def run(self, client: Generator, sample: Sample) -> list[Trajectory] | None:
        if self.proxy.url is None:  # a workflow built by a sync factory starts its proxy on first use
            async with self._starting:
                if self.proxy.url is None:
                    await self.proxy.start()
        eps = await asyncio.gather(*(self._one(client, sample) for _ in range(self.group_size)))
        trajs = [t for ep in eps for t in ep]
        return trajs or None

"""An OpenAI-compatible endpoint in front of the policy, recording every call for training.

Agents written against the official `openai` SDK run unchanged: point them at the proxy,

    client = AsyncOpenAI(base_url=proxy.base_url, api_key=episode_id)     # base_url ends in /v1

and every request goes through `InferenceClient.agenerate` with token ids (so interruption and resumption,
routing with the episode as the sticky session key, and per-token policy versions all apply). Requests are parsed
and answers shaped by the same OpenAI wire code as the embedded server's (protocol/openai_requests.py and
protocol/openai_responses.py): the same fields, limits, errors, logprobs objects and tool-call parsing
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks become OpenAI `tool_calls`; invalid blocks stay
in the content as the model wrote them).

Episodes. The episode id travels as the API key (`Authorization: Bearer <id>`, what the SDK sends) or, taking
precedence, as an `X-Episode-Id` header. Ids come from `start_episode()`: random, unguessable, and by default the
only ones accepted (401 otherwise), so the ids double as capabilities; `require_known_episodes=False` creates
episodes on first use instead. Each call's prompt ids, output ids, logprobs, versions and sampling settings are
recorded in the episode (see episode.py for rewards, discounting and export).

Sampling of trainable calls. The trainer computes logprobs at the run's rollout sampling (temperature, top-p,
top-k): a call sampled otherwise would be trained with biased importance weights. So a trainable episode's calls
are sampled with `policy` (a `PolicySampling`, the run's rollout settings) whatever the agent asks. With
`sampling="enforce"` (the default) the agent's temperature, top_p, top_k, min_p and penalties are overridden, and
the answer says so (`areal.sampling`, `areal.overridden`); with `sampling="reject"` a request that asks for other
values is a 400 naming the setting. Episodes started with `trainable=False` (evaluation) are sampled as asked.

Token continuity: a chat request whose messages start with an earlier call's messages plus the assistant message
that call returned (the usual agent loop) is NOT re-rendered from text: its prompt is the earlier call's prompt +
its output ids + the template's end-of-turn + the new messages rendered as a delta. So the tokens trained are the
tokens sampled, and the episode exports as one concatenated trajectory. Completions get the same treatment when a
prompt text extends an earlier prompt + its returned text exactly.

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /v1/reward
(`{"reward": float, "call_id": optional}`, episode from the key), GET /v1/episode (what was recorded).
Streaming is answered in OpenAI's SSE format, as one chunk per choice after generation finishes. Not supported
(400): `echo`, `suffix`, `best_of`, n above 16; `top_logprobs` is answered with empty lists.

Messages are compared and rendered by chat_messages.py; answers, errors and streams go out through proxy_http.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from typing import Any, Literal

import msgspec
from aiohttp import web

from areal_async.agent.chat_messages import same_message, template_messages
from areal_async.agent.episode import CallRecord, Episode, ExportMode
from areal_async.agent.proxy_http import ProxyError, answer, error_response, json_response
from areal_async.inference.transport import InferenceError
from areal_async.protocol import openai_requests, openai_responses
from areal_async.protocol.engine_api import EngineSampling
from areal_async.protocol.sglang import Limits
from areal_async.rollout.chat import ChatTokens
from areal_async.rollout.workflow_api import Generator
from areal_async.tokenizer import Tokenizer
from areal_async.types import GenerationResult, SamplingParams, Trajectory

log = logging.getLogger(__name__)

MAX_N = 16
_NO_CONTEXT_LIMIT = 1 << 31  # without max_context_tokens the servers enforce the model's context length
SamplingMode = Literal["enforce", "reject"]


class PolicySampling(msgspec.Struct, frozen=True, kw_only=True):
    """How trainable calls are sampled: the run's rollout settings, at which the trainer computes logprobs."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0


# the keys an agent may send that change the sampling distribution, and their neutral values
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


class _AskedSampling(msgspec.Struct, kw_only=True):
    """What the request itself set (None: not given), to tell an explicit value from a default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None


class RewardRequest(msgspec.Struct, kw_only=True):
    reward: float
    call_id: str | None = None


# re-exported: the one tool-call parser (see protocol/openai_responses.py)
parse_tool_calls = openai_responses.parse_tool_calls


# ---- the proxy -------------------------------------------------------------------------------------------------


class _EpisodeState:
    def __init__(self, episode: Episode, generator: Generator | None, trainable: bool) -> None:
        self.episode = episode
        self.generator = generator
        self.trainable = trainable


class OpenAIProxy:
    """OpenAI-compatible HTTP front for a `Generator` (usually the controller's InferenceClient)."""

    def __init__(
        self,
        generator: Generator | None,
        tokenizer: Tokenizer,
        *,
        model_name: str = "areal-policy",
        default_max_tokens: int = 512,
        max_context_tokens: int | None = None,
        require_known_episodes: bool = True,
        token_continuity: bool = True,
        policy: PolicySampling | None = None,
        sampling: SamplingMode = "enforce",
    ) -> None:
        if sampling not in ("enforce", "reject"):
            raise ValueError(f"sampling must be 'enforce' or 'reject', got {sampling!r}")
        self.generator = generator
        self.tok = tokenizer
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.max_context_tokens = max_context_tokens
        self.require_known_episodes = require_known_episodes
        self.token_continuity = token_continuity
        self.policy = policy or PolicySampling()
        self.sampling_mode: SamplingMode = sampling
        self.limits = Limits(vocab_size=tokenizer.vocab_size, context_len=max_context_tokens or _NO_CONTEXT_LIMIT)
        self._episodes: dict[str, _EpisodeState] = {}
        self._chat_tokens: ChatTokens | None = None
        self._token_texts: dict[int, str] = {}
        self._warned_override: set[str] = set()
        self._runner: web.AppRunner | None = None
        self.url: str | None = None
        self._created = int(time.time())

    # ---- episodes (Python API) ---------------------------------------------------------------------------------

    def start_episode(
        self,
        episode_id: str | None = None,
        *,
        generator: Generator | None = None,
        group_id: int = 0,
        meta: dict | None = None,
        trainable: bool = True,
    ) -> str:
        """Open an episode and return its id (the API key the agent uses). `generator` overrides the proxy's own
        for this episode's calls (a workflow passes the controller's client here). A `trainable` episode is
        sampled with the proxy's `policy` settings (see the module docstring); others as the agent asks, and
        cannot be exported for training."""
        eid = episode_id or "ep-" + secrets.token_urlsafe(18)
        if eid in self._episodes:
            raise ValueError(f"episode {eid!r} already exists")
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,200}", eid):
            raise ValueError("episode ids are 1-200 characters of [A-Za-z0-9_.:-]")
        self._episodes[eid] = _EpisodeState(Episode(eid, group_id=group_id, meta=meta), generator, trainable)
        return eid

    def episode(self, episode_id: str) -> Episode:
        try:
            return self._episodes[episode_id].episode
        except KeyError:
            raise KeyError(f"unknown episode {episode_id!r}") from None

    def set_reward(self, episode_id: str, reward: float, call_id: str | None = None) -> None:
        self.episode(episode_id).set_reward(reward, call_id)

    def finish_episode(self, episode_id: str, *, discount: float = 1.0, mode: ExportMode = "auto") -> list[Trajectory]:
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

    async def __aenter__(self) -> OpenAIProxy:
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
            return error_response(str(e), e.status, e.param)
        except web.HTTPException:
            raise
        except asyncio.CancelledError:
            raise
        except InferenceError as e:  # the servers refused (4xx: the request's fault) or could not serve
            if isinstance(e.status, int) and 400 <= e.status < 500:
                return error_response(str(e), 400)
            log.warning("proxy: %s %s: inference failed: %s", request.method, request.path, e)
            return error_response(f"inference failed: {e}", 502)
        except ValueError as e:  # bad input: the shared parser's ProtocolError, the client's own checks
            return error_response(str(e), 400)
        except Exception as e:  # never a traceback to the agent; keep serving
            log.exception("proxy: %s %s failed", request.method, request.path)
            return error_response(f"{type(e).__name__}: {e}", 500)

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

    def _sampling(self, raw: bytes, s: EngineSampling, n: int, trainable: bool) -> tuple[SamplingParams, list[str]]:
        """The SamplingParams to generate with, and the keys the agent set that were overridden."""
        if not 1 <= n <= MAX_N:
            raise ProxyError(f"n must be in [1, {MAX_N}]", param="n")
        try:
            asked = msgspec.json.decode(raw, type=_AskedSampling)
        except msgspec.MsgspecError:
            asked = _AskedSampling()  # the shared parser already accepted the body
        p = self.policy
        overridden: list[str] = []
        if trainable:
            want = {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p, **_NEUTRAL}
            for key, value in want.items():
                got = getattr(asked, key)
                if got is not None and got != value:
                    if self.sampling_mode == "reject":
                        raise ProxyError(
                            f"{key}={got} differs from the policy's {key}={value}: trainable calls are "
                            "sampled as the trainer computes their logprobs",
                            param=key,
                        )
                    overridden.append(key)
            for key in overridden:
                if key not in self._warned_override:
                    self._warned_override.add(key)
                    log.warning(
                        "proxy: an agent asked for %s=%s; trainable calls are sampled with %s=%s",
                        key,
                        getattr(asked, key),
                        key,
                        want[key],
                    )
            temperature, top_p, top_k, min_p = p.temperature, p.top_p, p.top_k, p.min_p
        else:
            for key, neutral in _NEUTRAL.items():
                if getattr(s, key) != neutral:
                    raise ProxyError(f"{key} is not supported by the proxy", param=key)
            temperature, top_p, top_k, min_p = s.temperature, s.top_p, s.top_k, s.min_p
        return SamplingParams(
            max_new_tokens=s.max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None,
            ignore_eos=s.ignore_eos,
            min_new_tokens=s.min_new_tokens,
            skip_special_tokens=s.skip_special_tokens,
        ), overridden

    async def _generate(
        self, st: _EpisodeState, prompts: list[list[int]], sp: SamplingParams
    ) -> list[GenerationResult]:
        gen = st.generator or self.generator
        if gen is None:
            raise ProxyError("the proxy has no generator for this episode", 500)
        return list(await asyncio.gather(*(gen.agenerate(list(p), sp, session_key=st.episode.id) for p in prompts)))

    def _views(self, gens: list[GenerationResult], s: EngineSampling) -> list[openai_responses.GenerationChoice]:
        return [
            openai_responses.GenerationChoice(
                g,
                self.tok,
                skip_special_tokens=s.skip_special_tokens,
                no_stop_trim=s.no_stop_trim,
                token_texts=self._token_texts,
            )
            for g in gens
        ]

    def _extras(
        self,
        body: dict,
        gens: list[GenerationResult],
        sp: SamplingParams,
        overridden: list[str],
        trainable: bool,
        continued: str | None = None,
    ) -> None:
        areal: dict[str, Any] = {
            "weight_versions": sorted({v for g in gens for v in g.output_versions}),
            "trainable": trainable,
            "overridden": overridden,
            "sampling": {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "min_p": sp.min_p},
        }
        if continued is not None or body["object"] == "chat.completion":
            areal["continued_call"] = continued
        body["areal"] = areal

    # ---- /v1/chat/completions -----------------------------------------------------------------------------------

    @property
    def chat_tokens(self) -> ChatTokens:
        if self._chat_tokens is None:
            self._chat_tokens = ChatTokens(self.tok)
        return self._chat_tokens

    def _chat_prompt(
        self, ep: Episode, messages: list[dict], tools: list[dict] | None, tools_json: str | None
    ) -> tuple[list[int], str | None]:
        """(prompt ids, id of the call continued or None)."""
        if self.token_continuity:
            for call in reversed(ep.calls):
                if (
                    call.kind != "chat"
                    or call.messages is None
                    or call.response_message is None
                    or call.tools_json != tools_json
                ):
                    continue
                prefix = call.messages + [call.response_message]
                if len(messages) > len(prefix) and all(same_message(a, b) for a, b in zip(messages, prefix)):
                    try:
                        tail = self.chat_tokens.delta_ids(template_messages(messages[len(prefix) :]))
                    except ValueError:
                        break  # this template cannot append: render from scratch
                    ids = call.prompt_ids + call.output_ids + self.chat_tokens.close_turn_ids(call.output_ids) + tail
                    return ids, call.call_id
        ids = self.tok.apply_chat_template(template_messages(messages), tools=tools, add_generation_prompt=True)
        assert isinstance(ids, list)
        return ids, None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        st = self._state(request)
        raw = await request.read()
        seen: dict[str, Any] = {}

        def render(messages: list[dict], tools: list[dict] | None) -> list[int]:
            seen["messages"], seen["tools_json"] = messages, json.dumps(tools, sort_keys=True) if tools else None
            ids, seen["continued"] = self._chat_prompt(st.episode, messages, tools, seen["tools_json"])
            return ids

        plan = openai_requests.parse_chat(
            raw, self.tok, self.limits, render, default_max_tokens=self.default_max_tokens
        )
        plan.return_token_ids = True
        s = plan.requests[0].sampling
        sp, overridden = self._sampling(raw, s, plan.n, st.trainable)
        prompt_ids = plan.prompts[0]
        gens = await self._generate(st, [prompt_ids] * plan.n, sp)
        views = self._views(gens, s)
        rid = "chatcmpl-" + uuid.uuid4().hex
        body = openai_responses.chat_response(plan, views, self.model_name, rid, int(time.time()))
        for i, (g, choice) in enumerate(zip(gens, body["choices"])):
            st.episode.add(
                CallRecord(
                    call_id=rid if plan.n == 1 else f"{rid}/{i}",
                    kind="chat",
                    prompt_ids=list(prompt_ids),
                    output_ids=list(g.output_ids),
                    output_logprobs=list(g.output_logprobs),
                    output_versions=list(g.output_versions),
                    finish_reason=choice["finish_reason"],
                    created=time.time(),
                    messages=[dict(m) for m in seen["messages"]],
                    response_message=choice["message"],
                    tools_json=seen["tools_json"],
                    temperature=sp.temperature,
                    top_p=sp.top_p,
                    top_k=sp.top_k,
                    trainable=st.trainable,
                )
            )
        self._extras(body, gens, sp, overridden, st.trainable, seen["continued"])
        return await answer(request, plan, body, views)

    # ---- /v1/completions --------------------------------------------------------------------------------------

    def _continue_text(self, ep: Episode, text: str) -> list[int]:
        if self.token_continuity:
            for call in reversed(ep.calls):
                if (
                    call.kind == "completion"
                    and call.text is not None
                    and len(text) > len(call.text)
                    and text.startswith(call.text)
                ):
                    return call.prompt_ids + call.output_ids + self.tok.encode(text[len(call.text) :])
        return self.tok.encode(text)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        st = self._state(request)
        raw = await request.read()
        texts: list[str] = []

        def encode(text: str) -> list[int]:
            texts.append(text)
            return self._continue_text(st.episode, text)

        plan = openai_requests.parse_completion(raw, self.tok, self.limits, encode=encode)
        if plan.echo_texts is not None:
            raise ProxyError("echo is not supported", param="echo")
        plan.return_token_ids = True
        s = plan.requests[0].sampling
        sp, overridden = self._sampling(raw, s, plan.n, st.trainable)
        gens = await self._generate(st, [r.input_ids for r in plan.requests], sp)
        views = self._views(gens, s)
        rid = "cmpl-" + uuid.uuid4().hex
        body = openai_responses.completion_response(plan, views, self.model_name, rid, int(time.time()))
        for idx, (g, view, choice) in enumerate(zip(gens, views, body["choices"])):
            ptext = texts[idx // plan.n] if texts else None
            text = view.text()
            exact = ptext is not None and self.tok.decode(g.output_ids, skip_special_tokens=False) == text
            st.episode.add(
                CallRecord(
                    call_id=rid if len(gens) == 1 else f"{rid}/{idx}",
                    kind="completion",
                    prompt_ids=list(plan.requests[idx].input_ids),
                    output_ids=list(g.output_ids),
                    output_logprobs=list(g.output_logprobs),
                    output_versions=list(g.output_versions),
                    finish_reason=choice["finish_reason"],
                    created=time.time(),
                    text=(ptext + text) if exact else None,
                    temperature=sp.temperature,
                    top_p=sp.top_p,
                    top_k=sp.top_k,
                    trainable=st.trainable,
                )
            )
        self._extras(body, gens, sp, overridden, st.trainable)
        return await answer(request, plan, body, views)

    # ---- models, rewards, episode --------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.model_name, "object": "model", "created": self._created, "owned_by": "areal_async"}
                ],
            }
        )

    async def reward(self, request: web.Request) -> web.Response:
        st = self._state(request)
        req: RewardRequest = await self._body(request, RewardRequest)
        try:
            st.episode.set_reward(req.reward, req.call_id)
        except KeyError as e:
            raise ProxyError(str(e.args[0]), 404, "call_id") from None
        except ValueError as e:
            raise ProxyError(str(e), param="reward") from None
        return json_response({"ok": True, "episode": st.episode.id, "call_id": req.call_id})

    async def episode_summary(self, request: web.Request) -> web.Response:
        return json_response(self._state(request).episode.summary())

"""OpenAI's /v1/completions and /v1/chat/completions requests, as pure functions: the one implementation that both
the embedded server (server/app.py) and the agent proxy (agent/openai_proxy.py) parse with. The answers are built by
openai_responses.py.

Why apart from sglang.py: the OpenAI wire format (messages, tools, logprobs objects, streamed chunks) is a second
protocol with its own rules; it shares the limits and the sampling checks with the SGLang endpoints and adds
SGLang's and vLLM's extras (`rid`, `top_k`, `return_token_ids`). Parsing failures raise `ProtocolError` (a 400),
as in sglang.py. No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from areal_async.protocol.engine_api import EngineRequest, EngineSampling
from areal_async.protocol.sglang import (
    Limits,
    ProtocolError,
    Tokenizer,
    check_prompt,
    check_request_count,
    check_sampling,
    check_unique_rids,
    decode_body,
    new_rid,
    sample_rids,
    stop_list,
)

# ---- OpenAI-compatible requests -----------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False


class _OpenAIIn(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then SGLang's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    no_stop_trim: bool | None = False
    skip_special_tokens: bool | None = True
    rid: str | list[str] | None = None
    return_token_ids: bool | None = False
    regex: Any = None
    ebnf: Any = None
    json_schema: Any = None


class CompletionIn(_OpenAIIn, kw_only=True):
    prompt: str | list[str | int | list[int]] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None  # refused when set: insertion is not supported
    best_of: int | None = None  # refused above 1


class ChatIn(_OpenAIIn, kw_only=True):
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def _sampling_from_openai(o: _OpenAIIn, max_tokens: int | None, prompt_len: int, limits: Limits) -> EngineSampling:
    for key in ("regex", "ebnf", "json_schema"):
        if getattr(o, key) not in (None, "", {}):
            raise ProtocolError(f"{key} (constrained decoding) is not supported by this server")

    def opt(v: Any, default: Any) -> Any:
        return default if v is None else v

    s = EngineSampling(
        max_new_tokens=limits.context_len - prompt_len if max_tokens is None else max_tokens,
        temperature=opt(o.temperature, 1.0),
        top_p=opt(o.top_p, 1.0),
        top_k=opt(o.top_k, -1),
        min_p=opt(o.min_p, 0.0),
        stop=stop_list(o.stop),
        stop_token_ids=list(o.stop_token_ids or []),
        ignore_eos=bool(o.ignore_eos),
        min_new_tokens=opt(o.min_tokens, 0),
        no_stop_trim=bool(o.no_stop_trim),
        skip_special_tokens=opt(o.skip_special_tokens, True),
        frequency_penalty=opt(o.frequency_penalty, 0.0),
        presence_penalty=opt(o.presence_penalty, 0.0),
        repetition_penalty=opt(o.repetition_penalty, 1.0),
        seed=o.seed,
    )
    check_sampling(s, prompt_len, limits, n=opt(o.n, 1), names=_OPENAI_NAMES)
    return s


@dataclass
class OpenAIPlan:
    """An OpenAI call expanded into engine requests: prompt-major, then sample; choice index = position."""

    kind: Literal["completion", "chat"]
    requests: list[EngineRequest]
    prompts: list[list[int]]  # one per prompt; requests[i] uses prompts[i // n]
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: int | None = None  # completions: top-N (0 = only the sampled token); chat: top_logprobs when enabled
    echo_texts: list[str] | None = None  # completions with echo: the prompt text to prepend
    tools: list[dict] = field(default_factory=list)  # chat: tools offered (tool-call parsing is on when non-empty)


def _openai_rids(rid: str | list[str] | None, num_prompts: int, n: int, prefix: str) -> list[str]:
    if isinstance(rid, list):
        if len(rid) != num_prompts:
            raise ProtocolError(f"rid has {len(rid)} entries but there are {num_prompts} prompts")
        bases = list(rid)
    elif rid is not None:
        bases = [rid] if num_prompts == 1 else [f"{rid}_{i}" for i in range(num_prompts)]
    else:
        bases = [f"{prefix}{new_rid()}" for _ in range(num_prompts)]
    rids = [r for b in bases for r in sample_rids(b, n)]
    check_unique_rids(rids)
    return rids


def parse_completion(
    body: bytes, tok: Tokenizer, limits: Limits, *, encode: Callable[[str], list[int]] | None = None
) -> OpenAIPlan:
    """`encode` turns a text prompt into ids (default `tok.encode`; the proxy continues earlier calls' tokens)."""
    c: CompletionIn = decode_body(body, CompletionIn)
    if c.prompt is None:
        raise ProtocolError("missing `prompt`")
    if c.suffix is not None:
        raise ProtocolError("suffix (insertion) is not supported")
    if c.best_of is not None and c.best_of > 1:
        raise ProtocolError("best_of > 1 is not supported; use n")
    encode = encode or tok.encode
    p = c.prompt
    if isinstance(p, str):
        prompts, texts = [encode(p)], [p]
    else:
        kinds = {type(x) for x in p}
        if not p:
            raise ProtocolError("prompt is an empty list")
        if len(kinds) > 1:
            raise ProtocolError(
                "prompt must be a string, a list of strings, a list of ints or a list of lists of ints, not a mix"
            )
        if kinds != {int}:
            check_request_count(len(p))
        if kinds == {str}:
            texts = list(p)
            prompts = [encode(t) for t in texts]
        elif kinds == {int}:
            prompts, texts = [list(p)], None
        else:
            prompts, texts = [list(x) for x in p], None
    for i, ids in enumerate(prompts):
        check_prompt(ids, limits, "prompt" if len(prompts) == 1 else f"prompt {i}")
    n = 1 if c.n is None else c.n
    if c.logprobs is not None and not 0 <= c.logprobs <= limits.vocab_size:
        raise ProtocolError(f"logprobs must be in [0, {limits.vocab_size}], got {c.logprobs}")
    echo = bool(c.echo)
    want_lp = c.logprobs is not None
    samplings = [_sampling_from_openai(c, c.max_tokens, len(ids), limits) for ids in prompts]
    check_request_count(len(prompts) * n)
    rids = _openai_rids(c.rid, len(prompts), n, "cmpl-")
    reqs = [
        EngineRequest(
            rid=rids[i * n + j],
            input_ids=ids,
            sampling=samplings[i],
            return_logprob=want_lp,
            logprob_start_len=0 if (want_lp and echo) else -1,
            top_logprobs_num=c.logprobs or 0,
            stream=bool(c.stream),
        )
        for i, ids in enumerate(prompts)
        for j in range(n)
    ]
    echo_texts = None
    if echo:
        echo_texts = texts if texts is not None else [tok.decode(ids, skip_special_tokens=False) for ids in prompts]
    return OpenAIPlan(
        kind="completion",
        requests=reqs,
        prompts=prompts,
        n=n,
        stream=bool(c.stream),
        include_usage=bool(c.stream_options and c.stream_options.include_usage),
        return_token_ids=bool(c.return_token_ids),
        logprobs=c.logprobs,
        echo_texts=echo_texts,
    )


_ROLES = {"system", "developer", "user", "assistant", "tool"}


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check chat messages and flatten text content parts into one string (what chat templates expect)."""
    if not messages:
        raise ProtocolError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise ProtocolError(f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ProtocolError(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            if role != "assistant":
                raise ProtocolError(f"messages[{i}].content is required for role {role!r}")
            content = ""
        elif not isinstance(content, str):
            raise ProtocolError(f"messages[{i}].content must be a string or a list of text parts")
        msg = dict(m)
        msg["role"] = role
        msg["content"] = content
        out.append(msg)
    return out


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]]:
    """Validate OpenAI `tools`; returns the tools to offer ([] when none or tool_choice == "none")."""
    tools = tools or []
    for i, t in enumerate(tools):
        fn = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ProtocolError(f'tools[{i}] must be {{"type": "function", "function": {{"name": str, ...}}}}')
    if tool_choice is None or tool_choice in ("auto", "required", "none"):
        pass
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise ProtocolError(f"tool_choice names function {name!r}, which is not in tools")
    else:
        raise ProtocolError(f"tool_choice must be 'none', 'auto', 'required' or a function object, got {tool_choice!r}")
    return [] if tool_choice == "none" else tools


def parse_chat(
    body: bytes,
    tok: Tokenizer,
    limits: Limits,
    apply_chat_template: Callable[[list[dict], list[dict] | None], list[int]],
    *,
    default_max_tokens: int | None = None,
) -> OpenAIPlan:
    """Without max_tokens a chat answer may fill the context (SGLang), or take `default_max_tokens` when given."""
    c: ChatIn = decode_body(body, ChatIn)
    if c.messages is None:
        raise ProtocolError("missing `messages`")
    messages = normalize_messages(c.messages)
    tools = check_tools(c.tools, c.tool_choice)
    if c.response_format and c.response_format.get("type", "text") != "text":
        raise ProtocolError("response_format other than text (constrained decoding) is not supported")
    try:
        ids = apply_chat_template(messages, tools or None)
    except Exception as e:  # a template raising on these messages is the client's input problem
        raise ProtocolError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None
    check_prompt(ids, limits)
    n = 1 if c.n is None else c.n
    top = c.top_logprobs
    if top is not None and not c.logprobs:
        raise ProtocolError("top_logprobs requires logprobs: true")
    if top is not None and not 0 <= top <= min(20, limits.vocab_size):
        raise ProtocolError(f"top_logprobs must be in [0, 20], got {top}")
    max_tokens = c.max_completion_tokens if c.max_completion_tokens is not None else c.max_tokens
    if max_tokens is None and default_max_tokens is not None:
        max_tokens = max(0, min(default_max_tokens, limits.context_len - len(ids)))
    s = _sampling_from_openai(c, max_tokens, len(ids), limits)
    if isinstance(c.rid, list) and len(c.rid) == n and n > 1:
        rids = list(c.rid)  # one rid per sample
        check_unique_rids(rids)
    else:
        rids = _openai_rids(c.rid, 1, n, "chatcmpl-")
    want_lp = bool(c.logprobs)
    reqs = [
        EngineRequest(
            rid=r,
            input_ids=ids,
            sampling=s,
            return_logprob=want_lp,
            top_logprobs_num=(top or 0) if want_lp else 0,
            stream=bool(c.stream),
        )
        for r in rids
    ]
    return OpenAIPlan(
        kind="chat",
        requests=reqs,
        prompts=[ids],
        n=n,
        stream=bool(c.stream),
        include_usage=bool(c.stream_options and c.stream_options.include_usage),
        return_token_ids=bool(c.return_token_ids),
        logprobs=(top or 0) if want_lp else None,
        tools=tools,
    )

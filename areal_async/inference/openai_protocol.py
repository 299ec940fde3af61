"""OpenAI's /v1/completions and /v1/chat/completions on top of SGLang's protocol, as pure functions.

Why apart from protocol.py: the OpenAI wire format (messages, tools, logprobs objects, streamed chunks) is a second
protocol with its own rules; it shares the limits, the sampling checks and the response `Accumulator` with the
SGLang endpoints and adds SGLang's and vLLM's extras (`rid`, `top_k`, `return_token_ids`,
`metadata.weight_version`). Parsing failures raise `ProtocolError` (a 400), as in protocol.py.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import msgspec

from areal_async.inference.engine_api import EngineRequest, EngineSampling
from areal_async.inference.protocol import (Accumulator, Limits, ProtocolError, Tokenizer, check_prompt,
                                           check_sampling, check_unique_rids, decode_body, new_rid, sample_rids,
                                           stop_hold, stop_list)


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
        temperature=opt(o.temperature, 1.0), top_p=opt(o.top_p, 1.0), top_k=opt(o.top_k, -1), min_p=opt(o.min_p, 0.0),
        stop=stop_list(o.stop), stop_token_ids=list(o.stop_token_ids or []), ignore_eos=bool(o.ignore_eos),
        min_new_tokens=opt(o.min_tokens, 0), no_stop_trim=bool(o.no_stop_trim),
        skip_special_tokens=opt(o.skip_special_tokens, True), frequency_penalty=opt(o.frequency_penalty, 0.0),
        presence_penalty=opt(o.presence_penalty, 0.0), repetition_penalty=opt(o.repetition_penalty, 1.0),
        seed=o.seed)
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


def parse_completion(body: bytes, tok: Tokenizer, limits: Limits) -> OpenAIPlan:
    c: CompletionIn = decode_body(body, CompletionIn)
    if c.prompt is None:
        raise ProtocolError("missing `prompt`")
    p = c.prompt
    if isinstance(p, str):
        prompts, texts = [tok.encode(p)], [p]
    else:
        kinds = {type(x) for x in p}
        if not p:
            raise ProtocolError("prompt is an empty list")
        if len(kinds) > 1:
            raise ProtocolError("prompt must be a string, a list of strings, a list of ints or a list of lists of "
                                "ints, not a mix")
        if kinds == {str}:
            texts = list(p)
            prompts = [tok.encode(t) for t in texts]
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
    rids = _openai_rids(c.rid, len(prompts), n, "cmpl-")
    reqs = [EngineRequest(rid=rids[i * n + j], input_ids=ids, sampling=samplings[i], return_logprob=want_lp,
                          logprob_start_len=0 if (want_lp and echo) else -1,
                          top_logprobs_num=c.logprobs or 0)
            for i, ids in enumerate(prompts) for j in range(n)]
    echo_texts = None
    if echo:
        echo_texts = texts if texts is not None else [tok.decode(ids, skip_special_tokens=False) for ids in prompts]
    return OpenAIPlan(kind="completion", requests=reqs, prompts=prompts, n=n, stream=bool(c.stream),
                      include_usage=bool(c.stream_options and c.stream_options.include_usage),
                      return_token_ids=bool(c.return_token_ids), logprobs=c.logprobs, echo_texts=echo_texts)


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
            raise ProtocolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": str, ...}}}}")
    if tool_choice is None or tool_choice in ("auto", "required", "none"):
        pass
    elif isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in {t["function"]["name"] for t in tools}:
            raise ProtocolError(f"tool_choice names function {name!r}, which is not in tools")
    else:
        raise ProtocolError(f"tool_choice must be 'none', 'auto', 'required' or a function object, got {tool_choice!r}")
    return [] if tool_choice == "none" else tools


def parse_chat(body: bytes, tok: Tokenizer, limits: Limits,
               apply_chat_template: Callable[[list[dict], list[dict] | None], list[int]]) -> OpenAIPlan:
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
    s = _sampling_from_openai(c, max_tokens, len(ids), limits)
    if isinstance(c.rid, list) and len(c.rid) == n and n > 1:
        rids = list(c.rid)  # one rid per sample
        check_unique_rids(rids)
    else:
        rids = _openai_rids(c.rid, 1, n, "chatcmpl-")
    want_lp = bool(c.logprobs)
    reqs = [EngineRequest(rid=r, input_ids=ids, sampling=s, return_logprob=want_lp,
                          top_logprobs_num=(top or 0) if want_lp else 0) for r in rids]
    return OpenAIPlan(kind="chat", requests=reqs, prompts=[ids], n=n, stream=bool(c.stream),
                      include_usage=bool(c.stream_options and c.stream_options.include_usage),
                      return_token_ids=bool(c.return_token_ids), logprobs=(top or 0) if want_lp else None,
                      tools=tools)


# ---- OpenAI-compatible responses ----------------------------------------------------------------------------------


def openai_finish_reason(fr: dict | None) -> str | None:
    return None if fr is None else fr.get("type")


def matched_stop(fr: dict | None) -> int | str | None:
    return fr.get("matched") if fr and fr.get("type") == "stop" else None


def usage(plan: OpenAIPlan, accs: list[Accumulator]) -> dict:
    """Prompt tokens count once per prompt (its n samples share it), as SGLang reports them."""
    prompt = sum(len(p) for p in plan.prompts)
    completion = sum(len(a.output_ids) for a in accs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(acc: Accumulator, top_n: int, start: int, text_offset: int, *,
                        echo_ids: list[int] | None = None, echo_lps: list | None = None) -> dict:
    """OpenAI legacy logprobs over output tokens [start:], optionally preceded by the echoed prompt's."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    offsets: list[int] = []
    tops: list[dict[str, float] | None] = []
    off = text_offset

    def push(tid: int, lp: float | None, top: list[tuple[float, int]] | None) -> None:
        nonlocal off
        t = acc.token_text(tid)
        tokens.append(t)
        token_lps.append(lp)
        offsets.append(off)
        off += len(t)
        if top_n > 0:
            tops.append(None if top is None else {acc.token_text(i): v for v, i in top})

    if echo_ids is not None:
        lps = list(echo_lps or [])
        lps += [None] * (len(echo_ids) - len(lps))
        for tid, lp in zip(echo_ids, lps):
            push(tid, lp, None)
    for k in range(start, len(acc.output_ids)):
        top = acc.top_logprobs[k] if k < len(acc.top_logprobs) else None
        push(acc.output_ids[k], acc.logprobs[k] if k < len(acc.logprobs) else None, top)
    return {"tokens": tokens, "token_logprobs": token_lps, "text_offset": offsets, "top_logprobs": tops}


def _lp_entry(acc: Accumulator, tid: int, lp: float) -> dict:
    t = acc.token_text(tid)
    return {"token": t, "bytes": list(t.encode("utf-8")), "logprob": lp}


def chat_logprobs(acc: Accumulator, start: int, top_n: int) -> dict:
    """OpenAI chat logprobs for output tokens [start:]: content = [{token, bytes, logprob, top_logprobs}]."""
    content = []
    for k in range(start, len(acc.output_ids)):
        e = _lp_entry(acc, acc.output_ids[k], acc.logprobs[k] if k < len(acc.logprobs) else 0.0)
        tops = acc.top_logprobs[k] if (top_n > 0 and k < len(acc.top_logprobs)) else []
        e["top_logprobs"] = [_lp_entry(acc, i, v) for v, i in tops[:top_n]]
        content.append(e)
    return {"content": content}


def completion_response(plan: OpenAIPlan, accs: list[Accumulator], model: str, rid: str, created: int) -> dict:
    choices = []
    for idx, acc in enumerate(accs):
        prompt_i = idx // plan.n
        text = acc.text()
        lp = None
        echo = plan.echo_texts[prompt_i] if plan.echo_texts is not None else None
        if plan.logprobs is not None:
            lp = completion_logprobs(acc, plan.logprobs, 0, 0,
                                     echo_ids=plan.prompts[prompt_i] if echo is not None else None,
                                     echo_lps=acc.input_logprobs)
        choice = {"index": idx, "text": (echo or "") + text, "logprobs": lp,
                  "finish_reason": openai_finish_reason(acc.finish_reason),
                  "matched_stop": matched_stop(acc.finish_reason)}
        if plan.return_token_ids:
            choice["prompt_token_ids"] = plan.prompts[prompt_i]
            choice["token_ids"] = list(acc.output_ids)
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(plan, accs), "metadata": {"weight_version": _version(accs)}}


def _version(accs: list[Accumulator]) -> str:
    return next((a.weight_version for a in reversed(accs) if a.weight_version), "")


# Qwen's tool-call format: a JSON object {"name": ..., "arguments": ...} between <tool_call> tags.
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
TOOL_CALL_START = "<tool_call>"


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str | None, list[dict]]:
    """Split model output into (content before the first tool call, OpenAI tool_calls).

    Blocks that are not a JSON object naming an offered tool are dropped, as SGLang's Qwen parser drops them;
    if no block is valid the text is returned unchanged as plain content.
    """
    start = text.find(TOOL_CALL_START)
    if start == -1:
        return text, []
    calls = []
    for m in _TOOL_CALL_RE.finditer(text, start):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in tool_names:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not calls:
        return text, []
    content = text[:start].strip()
    return (content or None), calls


def chat_message(plan: OpenAIPlan, acc: Accumulator) -> tuple[dict, str | None]:
    """The assistant message and its finish_reason ("tool_calls" when a tool call was parsed)."""
    text = acc.text()
    finish = openai_finish_reason(acc.finish_reason)
    msg: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
    if plan.tools and acc.finish_reason and acc.finish_reason.get("type") != "abort":
        content, calls = parse_tool_calls(text, {t["function"]["name"] for t in plan.tools})
        if calls:
            msg["content"] = content
            msg["tool_calls"] = calls
            finish = "tool_calls"
    return msg, finish


def chat_response(plan: OpenAIPlan, accs: list[Accumulator], model: str, rid: str, created: int) -> dict:
    choices = []
    for idx, acc in enumerate(accs):
        msg, finish = chat_message(plan, acc)
        choice = {"index": idx, "message": msg,
                  "logprobs": chat_logprobs(acc, 0, plan.logprobs or 0) if plan.logprobs is not None else None,
                  "finish_reason": finish, "matched_stop": matched_stop(acc.finish_reason)}
        if plan.return_token_ids:
            choice["token_ids"] = list(acc.output_ids)
        choices.append(choice)
    out = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
           "usage": usage(plan, accs), "metadata": {"weight_version": _version(accs)}}
    if plan.return_token_ids:
        out["prompt_token_ids"] = plan.prompts[0]
    return out


class StreamDelta:
    """Per-choice bookkeeping for OpenAI streams: what text and how many tokens were already sent.

    OpenAI chunks carry deltas, so each call returns only what is new since the last one. With tools offered,
    text from a `<tool_call>` tag on is withheld (it may become a tool call, decided at the end).
    """

    def __init__(self, hold_tool_calls: bool = False):
        self.sent_text = ""
        self.sent_tokens = 0
        self.text_offset = 0  # completions logprobs: where the next token's text starts in the full text
        self.hold_tool_calls = hold_tool_calls
        self.started = False  # chat: the first delta carries the role

    def new_text(self, text: str, final: bool) -> str:
        if self.hold_tool_calls and not final:
            cut = text.find(TOOL_CALL_START)
            if cut == -1:
                cut = len(text) - stop_hold(text, [TOOL_CALL_START])
            text = text[:cut]
        # Decoding more tokens only appends to an already-sent prefix (partial characters and possible stop
        # strings are withheld upstream), so the delta is the tail past what the client already has.
        delta = text[len(self.sent_text):]
        self.sent_text += delta
        return delta

    def new_tokens(self, acc: Accumulator) -> int:
        """The index of the first token not yet sent; advances the cursor to the end."""
        start = self.sent_tokens
        self.sent_tokens = len(acc.output_ids)
        return start


def completion_chunk(plan: OpenAIPlan, idx: int, acc: Accumulator, st: StreamDelta, model: str, rid: str,
                     created: int) -> dict | None:
    """The next streamed /v1/completions chunk for choice `idx`, or None when nothing is new."""
    final = acc.finished
    prefix = ""
    lp = None
    if plan.echo_texts is not None and not st.started:
        prefix = plan.echo_texts[idx // plan.n]
    text = st.new_text(acc.text(), final)
    start = st.new_tokens(acc)
    if plan.logprobs is not None:
        echo = plan.echo_texts is not None and not st.started
        lp = completion_logprobs(acc, plan.logprobs, start, st.text_offset,
                                 echo_ids=plan.prompts[idx // plan.n] if echo else None,
                                 echo_lps=acc.input_logprobs)
        if lp["tokens"]:
            st.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
    if not (prefix or text or final or (lp and lp["tokens"])):
        return None
    st.started = True
    choice = {"index": idx, "text": prefix + text, "logprobs": lp,
              "finish_reason": openai_finish_reason(acc.finish_reason), "matched_stop": matched_stop(acc.finish_reason)}
    if plan.return_token_ids:
        choice["token_ids"] = acc.output_ids[start:]
        if prefix or start == 0:
            choice["prompt_token_ids"] = plan.prompts[idx // plan.n]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(plan: OpenAIPlan, idx: int, acc: Accumulator, st: StreamDelta, model: str, rid: str,
               created: int) -> dict | None:
    """The next streamed chat.completion.chunk for choice `idx`, or None when nothing is new."""
    final = acc.finished
    delta: dict[str, Any] = {}
    if not st.started:
        delta["role"] = "assistant"
        delta["content"] = ""
    finish = openai_finish_reason(acc.finish_reason)
    if final:
        msg, finish = chat_message(plan, acc)
        if msg["tool_calls"]:
            content = msg["content"] or ""
            text = content[len(st.sent_text):] if content.startswith(st.sent_text) else ""
            delta["tool_calls"] = [dict(c, index=k) for k, c in enumerate(msg["tool_calls"])]
        else:
            text = st.new_text(acc.text(), True)
    else:
        text = st.new_text(acc.text(), False)
    if text:
        delta["content"] = text
    start = st.new_tokens(acc)
    lp = chat_logprobs(acc, start, plan.logprobs or 0) if plan.logprobs is not None else None
    if not (delta or final or (lp and lp["content"])):
        return None
    st.started = True
    choice = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": finish if final else None,
              "matched_stop": matched_stop(acc.finish_reason)}
    if plan.return_token_ids:
        choice["token_ids"] = acc.output_ids[start:]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    if plan.return_token_ids and start == 0:
        out["prompt_token_ids"] = plan.prompts[0]
    return out


def usage_chunk(plan: OpenAIPlan, accs: list[Accumulator], model: str, rid: str, created: int) -> dict:
    obj = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(plan, accs)}

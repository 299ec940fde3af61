"""OpenAI's /v1/completions and /v1/chat/completions answers, as pure functions: response bodies, streamed chunks,
logprobs objects and tool calls, shared by the embedded server (server/app.py) and the agent proxy
(agent/openai_proxy.py). Requests are parsed by openai_requests.py.

Answers are built from `ChoiceView`s: the server's `Accumulator` (one engine request, possibly unfinished while
streaming) is one; `GenerationChoice` (a finished `GenerationResult` from the inference client) is the other.
Logprobs are always JSON numbers: -inf (and NaN) become -9999.0, as OpenAI clients expect a number.

Tool calls (Qwen's format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`): a block becomes an OpenAI
tool call only when it is complete and valid (see `parse_tool_calls`); anything else stays in the content verbatim,
so an agent (and its reward) sees exactly what the model wrote, and the conversation it sends back still matches the
sampled tokens. No torch here.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from typing import Any, Protocol

from areal_async.protocol.openai_requests import OpenAIPlan
from areal_async.protocol.sglang import Tokenizer, stop_hold
from areal_async.types import GenerationResult


class ChoiceView(Protocol):
    """What the response builders read of one choice (the server's `Accumulator` is one)."""

    output_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]]  # per token, when asked for; may be shorter (empty: none)
    input_logprobs: list[float | None] | None
    finish_reason: dict | None  # SGLang's shape; None while unfinished
    weight_version: str

    @property
    def finished(self) -> bool: ...

    def text(self) -> str: ...

    def token_text(self, tid: int) -> str: ...


class GenerationChoice:
    """A finished `GenerationResult` (the inference client's answer) as a `ChoiceView`. Its text is decoded here,
    trimmed of a matched stop string, as the server trims it; top logprobs are not available (empty)."""

    def __init__(
        self,
        gen: GenerationResult,
        tok: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        no_stop_trim: bool = False,
        token_texts: dict[int, str] | None = None,
    ):
        self.gen = gen
        self.tok = tok
        self.output_ids = gen.output_ids
        self.logprobs = gen.output_logprobs
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.input_logprobs = None
        if gen.finish_reason == "stop":
            self.finish_reason: dict | None = {"type": "stop", "matched": gen.matched_stop}
        elif gen.finish_reason == "length":
            self.finish_reason = {"type": "length", "length": len(gen.output_ids)}
        else:
            self.finish_reason = {"type": "abort", "message": "aborted", "status_code": None, "err_type": None}
        self.weight_version = str(max(gen.output_versions)) if gen.output_versions else ""
        self._skip = skip_special_tokens
        self._trim = not no_stop_trim
        self._tok_text = token_texts if token_texts is not None else {}
        self._text: str | None = None

    @property
    def finished(self) -> bool:
        return True

    def text(self) -> str:
        if self._text is None:
            ids, matched = self.output_ids, self.gen.matched_stop if self.gen.finish_reason == "stop" else None
            if isinstance(matched, int) and self._trim and ids and ids[-1] == matched:
                ids = ids[:-1]
            text = self.tok.decode(ids, skip_special_tokens=self._skip)
            if isinstance(matched, str) and matched and self._trim:
                pos = text.find(matched)
                if pos != -1:
                    text = text[:pos]
            self._text = text
        return self._text

    def token_text(self, tid: int) -> str:
        t = self._tok_text.get(tid)
        if t is None:
            t = self._tok_text[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return t


_MIN_LOGPROB = -9999.0  # JSON has no -inf, and OpenAI clients expect a number


def _num(x: float) -> float:
    """A logprob fit for JSON: -inf and NaN become the most negative value we report."""
    return x if x >= _MIN_LOGPROB else _MIN_LOGPROB


def openai_finish_reason(fr: dict | None) -> str | None:
    return None if fr is None else fr.get("type")


def matched_stop(fr: dict | None) -> int | str | None:
    return fr.get("matched") if fr and fr.get("type") == "stop" else None


def usage(plan: OpenAIPlan, accs: list[ChoiceView]) -> dict:
    """Prompt tokens count once per prompt (its n samples share it), as SGLang and OpenAI report them."""
    prompt = sum(len(p) for p in plan.prompts)
    completion = sum(len(a.output_ids) for a in accs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(
    acc: ChoiceView,
    top_n: int,
    start: int,
    text_offset: int,
    *,
    echo_ids: list[int] | None = None,
    echo_lps: list | None = None,
) -> dict:
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
        token_lps.append(None if lp is None else _num(lp))
        offsets.append(off)
        off += len(t)
        if top_n > 0:
            tops.append(None if top is None else {acc.token_text(i): _num(v) for v, i in top})

    if echo_ids is not None:
        lps = list(echo_lps or [])
        lps += [None] * (len(echo_ids) - len(lps))
        for tid, lp in zip(echo_ids, lps):
            push(tid, lp, None)
    for k in range(start, len(acc.output_ids)):
        top = acc.top_logprobs[k] if k < len(acc.top_logprobs) else None
        push(acc.output_ids[k], acc.logprobs[k] if k < len(acc.logprobs) else None, top)
    return {"tokens": tokens, "token_logprobs": token_lps, "text_offset": offsets, "top_logprobs": tops}


def _lp_entry(acc: ChoiceView, tid: int, lp: float) -> dict:
    t = acc.token_text(tid)
    return {"token": t, "bytes": list(t.encode("utf-8")), "logprob": _num(lp)}


def chat_logprobs(acc: ChoiceView, start: int, top_n: int) -> dict:
    """OpenAI chat logprobs for output tokens [start:]: content = [{token, bytes, logprob, top_logprobs}]."""
    content = []
    for k in range(start, len(acc.output_ids)):
        e = _lp_entry(acc, acc.output_ids[k], acc.logprobs[k] if k < len(acc.logprobs) else 0.0)
        tops = acc.top_logprobs[k] if (top_n > 0 and k < len(acc.top_logprobs)) else []
        e["top_logprobs"] = [_lp_entry(acc, i, v) for v, i in tops[:top_n]]
        content.append(e)
    return {"content": content}


def completion_response(plan: OpenAIPlan, accs: list[ChoiceView], model: str, rid: str, created: int) -> dict:
    choices = []
    for idx, acc in enumerate(accs):
        prompt_i = idx // plan.n
        text = acc.text()
        lp = None
        echo = plan.echo_texts[prompt_i] if plan.echo_texts is not None else None
        if plan.logprobs is not None:
            lp = completion_logprobs(
                acc,
                plan.logprobs,
                0,
                0,
                echo_ids=plan.prompts[prompt_i] if echo is not None else None,
                echo_lps=acc.input_logprobs,
            )
        choice = {
            "index": idx,
            "text": (echo or "") + text,
            "logprobs": lp,
            "finish_reason": openai_finish_reason(acc.finish_reason),
            "matched_stop": matched_stop(acc.finish_reason),
        }
        if plan.return_token_ids:
            choice["prompt_token_ids"] = plan.prompts[prompt_i]
            choice["token_ids"] = list(acc.output_ids)
        choices.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(plan, accs),
        "metadata": {"weight_version": _version(accs)},
    }


def _version(accs: list[ChoiceView]) -> str:
    return next((a.weight_version for a in reversed(accs) if a.weight_version), "")


_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CALL_START = "<tool_call>"


def parse_tool_calls(text: str, tool_names: Collection[str] | None = None) -> tuple[str | None, list[dict]]:
    """Split Qwen-format tool calls out of model output: (the rest as content, None when empty; OpenAI tool_calls).

    A block becomes a call only when it is closed by `</tool_call>` and its body is a JSON object whose "name" is a
    non-empty string (one of `tool_names` when given) and whose "arguments" (or "parameters") is an object or a
    string. Every other block (not JSON, an unknown tool, cut off by the length limit) stays in the content as the
    model wrote it: dropping it would hide a malformed call from the agent and its reward, and the messages the
    agent sends back would no longer match the tokens that were sampled. Text around the calls stays too.
    """
    if TOOL_CALL_START not in text:
        return text, []
    calls: list[dict] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if (
            not isinstance(name, str)
            or not name
            or (tool_names is not None and name not in tool_names)
            or not isinstance(args, (dict, str))
        ):
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    if not calls:
        return text, []
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def chat_message(plan: OpenAIPlan, acc: ChoiceView) -> tuple[dict, str | None]:
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


def chat_response(plan: OpenAIPlan, accs: list[ChoiceView], model: str, rid: str, created: int) -> dict:
    choices = []
    for idx, acc in enumerate(accs):
        msg, finish = chat_message(plan, acc)
        choice = {
            "index": idx,
            "message": msg,
            "logprobs": chat_logprobs(acc, 0, plan.logprobs or 0) if plan.logprobs is not None else None,
            "finish_reason": finish,
            "matched_stop": matched_stop(acc.finish_reason),
        }
        if plan.return_token_ids:
            choice["token_ids"] = list(acc.output_ids)
        choices.append(choice)
    out = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(plan, accs),
        "metadata": {"weight_version": _version(accs)},
    }
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
        delta = text[len(self.sent_text) :]
        self.sent_text += delta
        return delta

    def rest_of(self, content: str) -> str:
        """The final content minus what was already sent (tool calls cut out of it may end the shared prefix)."""
        k = 0
        while k < min(len(content), len(self.sent_text)) and content[k] == self.sent_text[k]:
            k += 1
        rest = content[k:]
        self.sent_text += rest
        return rest

    def new_tokens(self, acc: ChoiceView) -> int:
        """The index of the first token not yet sent; advances the cursor to the end."""
        start = self.sent_tokens
        self.sent_tokens = len(acc.output_ids)
        return start


def completion_chunk(
    plan: OpenAIPlan, idx: int, acc: ChoiceView, st: StreamDelta, model: str, rid: str, created: int
) -> dict | None:
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
        lp = completion_logprobs(
            acc,
            plan.logprobs,
            start,
            st.text_offset,
            echo_ids=plan.prompts[idx // plan.n] if echo else None,
            echo_lps=acc.input_logprobs,
        )
        if lp["tokens"]:
            st.text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
    if not (prefix or text or final or (lp and lp["tokens"])):
        return None
    st.started = True
    choice = {
        "index": idx,
        "text": prefix + text,
        "logprobs": lp,
        "finish_reason": openai_finish_reason(acc.finish_reason),
        "matched_stop": matched_stop(acc.finish_reason),
    }
    if plan.return_token_ids:
        choice["token_ids"] = acc.output_ids[start:]
        if prefix or start == 0:
            choice["prompt_token_ids"] = plan.prompts[idx // plan.n]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(
    plan: OpenAIPlan, idx: int, acc: ChoiceView, st: StreamDelta, model: str, rid: str, created: int
) -> dict | None:
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
            text = st.rest_of(msg["content"] or "")
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
    choice = {
        "index": idx,
        "delta": delta,
        "logprobs": lp,
        "finish_reason": finish if final else None,
        "matched_stop": matched_stop(acc.finish_reason),
    }
    if plan.return_token_ids:
        choice["token_ids"] = acc.output_ids[start:]
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    if plan.return_token_ids and start == 0:
        out["prompt_token_ids"] = plan.prompts[0]
    return out


def usage_chunk(plan: OpenAIPlan, accs: list[ChoiceView], model: str, rid: str, created: int) -> dict:
    obj = "chat.completion.chunk" if plan.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(plan, accs)}

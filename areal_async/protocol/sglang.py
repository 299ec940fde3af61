"""SGLang's HTTP protocol, as pure functions: parse and validate request bodies, shape responses.

Why a module of its own: every rule about what a client may send and what it gets back lives here, testable without
a model, a socket or torch. server/app.py only moves bytes between this module and the engine. Field names, defaults
and shapes follow SGLang 0.5's HTTP server (its `GenerateReqInput` and `SamplingParams`); the OpenAI endpoints
follow OpenAI's wire format, with SGLang's and vLLM's extras (`rid`, `top_k`, `return_token_ids`,
`metadata.weight_version`); those live in openai_requests.py, which builds on the shared parts here (limits,
sampling checks, `Accumulator`).

Bodies are decoded by msgspec into typed structs, so a wrong type is a 400 naming the JSON path; unknown keys are
ignored, as SGLang does. Range checks mirror SGLang's `SamplingParams.verify`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from areal_async.protocol.engine_api import EngineChunk, EngineRequest, EngineSampling, PauseMode


class ProtocolError(ValueError):
    """Bad client input. The server answers HTTP `status` with `{"error": {"message": str(self)}}`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Tokenizer(Protocol):
    """The slice of the engine this module needs (the engine satisfies it)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


MAX_REQUESTS_PER_CALL = 4096  # prompts x n of one HTTP call: a bigger ask would only exhaust the server's memory


@dataclass(frozen=True)
class Limits:
    vocab_size: int  # token ids must lie in [0, vocab_size)
    context_len: int  # prompt + max_new_tokens may not exceed it


def decode_body(body: bytes, typ: type, *, empty_ok: bool = False) -> Any:
    """JSON bytes -> `typ`, or ProtocolError naming what is wrong (malformed JSON, or the path of a bad field)."""
    if not body.strip():
        if empty_ok:
            body = b"{}"
        else:
            raise ProtocolError("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"invalid JSON: {e}") from None
    except RecursionError:  # msgspec's nesting limit (not a DecodeError)
        raise ProtocolError("invalid JSON: nested too deeply") from None


def new_rid() -> str:
    return uuid.uuid4().hex


# ---- /generate request -------------------------------------------------------------------------------------------


class SamplingIn(msgspec.Struct, kw_only=True):
    """SGLang's `sampling_params`. Constrained-decoding keys are accepted only when empty (null or [])."""

    max_new_tokens: int | None = 128  # null: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_new_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    sampling_seed: int | None = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    stop_regex: Any = None
    structural_tag: Any = None


class GenerateIn(msgspec.Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None  # list[int] or list[list[int]]; checked below
    sampling_params: SamplingIn | list[SamplingIn] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    priority: int | list[int] | None = None  # larger first in the queue (SGLang's priority scheduling)


@dataclass
class GeneratePlan:
    """What one /generate call asks for: engine requests in response order (prompt-major, then sample)."""

    requests: list[EngineRequest]
    batched: bool  # respond with a JSON list (a batch, or n > 1)
    stream: bool
    return_text_in_logprobs: bool


def check_prompt(ids: list[int], limits: Limits, where: str = "prompt") -> None:
    if not ids:
        raise ProtocolError(f"{where} is empty: at least one token is required")
    bad = next((t for t in ids if t < 0 or t >= limits.vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"{where} has token id {bad} outside the vocabulary [0, {limits.vocab_size})")
    if len(ids) >= limits.context_len:
        raise ProtocolError(f"{where} has {len(ids)} tokens; the model's context length is {limits.context_len}")


def check_sampling(
    s: EngineSampling, prompt_len: int, limits: Limits, *, n: int = 1, names: dict[str, str] | None = None
) -> None:
    """SGLang's range rules; `names` maps our field names to the ones the client used (OpenAI's max_tokens...)."""

    def name(k: str) -> str:
        return (names or {}).get(k, k)

    def need(cond: bool, key: str, msg: str) -> None:
        if not cond:
            raise ProtocolError(f"{name(key)} {msg}")

    need(s.max_new_tokens >= 0, "max_new_tokens", f"must be >= 0, got {s.max_new_tokens}")
    need(s.temperature >= 0.0, "temperature", f"must be >= 0, got {s.temperature}")
    need(0.0 < s.top_p <= 1.0, "top_p", f"must be in (0, 1], got {s.top_p}")
    need(s.top_k == -1 or s.top_k >= 1, "top_k", f"must be -1 (disabled) or >= 1, got {s.top_k}")
    need(0.0 <= s.min_p <= 1.0, "min_p", f"must be in [0, 1], got {s.min_p}")
    need(
        0 <= s.min_new_tokens <= s.max_new_tokens,
        "min_new_tokens",
        f"must be in [0, {name('max_new_tokens')}={s.max_new_tokens}], got {s.min_new_tokens}",
    )
    need(-2.0 <= s.frequency_penalty <= 2.0, "frequency_penalty", f"must be in [-2, 2], got {s.frequency_penalty}")
    need(-2.0 <= s.presence_penalty <= 2.0, "presence_penalty", f"must be in [-2, 2], got {s.presence_penalty}")
    need(0.0 < s.repetition_penalty <= 2.0, "repetition_penalty", f"must be in (0, 2], got {s.repetition_penalty}")
    need(1 <= n <= MAX_REQUESTS_PER_CALL, "n", f"must be in [1, {MAX_REQUESTS_PER_CALL}], got {n}")
    need(all(isinstance(x, str) and x for x in s.stop), "stop", "strings must be non-empty")
    bad = next((t for t in s.stop_token_ids if t < 0 or t >= limits.vocab_size), None)
    need(bad is None, "stop_token_ids", f"has id {bad} outside the vocabulary [0, {limits.vocab_size})")
    if prompt_len + s.max_new_tokens > limits.context_len:
        raise ProtocolError(
            f"requested {prompt_len + s.max_new_tokens} tokens ({prompt_len} in the prompt + "
            f"{s.max_new_tokens} {name('max_new_tokens')}); the model's context length is {limits.context_len}"
        )


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _unsupported_constraints(sp: SamplingIn) -> None:
    for key in ("regex", "json_schema", "ebnf", "stop_regex", "structural_tag"):
        v = getattr(sp, key)
        if v not in (None, [], "", {}):
            raise ProtocolError(f"sampling_params.{key} (constrained decoding) is not supported by this server")


def _sampling_from_sglang(sp: SamplingIn, prompt_len: int, limits: Limits) -> EngineSampling:
    _unsupported_constraints(sp)
    max_new = limits.context_len - prompt_len if sp.max_new_tokens is None else sp.max_new_tokens
    s = EngineSampling(
        max_new_tokens=max_new,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        stop=stop_list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids or []),
        ignore_eos=sp.ignore_eos,
        min_new_tokens=sp.min_new_tokens,
        no_stop_trim=sp.no_stop_trim,
        skip_special_tokens=sp.skip_special_tokens,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty,
        seed=sp.sampling_seed,
    )
    check_sampling(s, prompt_len, limits, n=sp.n)
    return s


def _per_item(value: Any, size: int, key: str) -> list:
    """SGLang lets batch fields be one value for all items or a list with one per item."""
    if isinstance(value, list):
        if len(value) != size:
            raise ProtocolError(f"{key} has {len(value)} entries but the batch has {size} prompts")
        return value
    return [value] * size


def sample_rids(base: str, n: int) -> list[str]:
    """n > 1: every sample gets its own rid, derived from the prompt's so that a prefix abort reaches them all."""
    return [base] if n == 1 else [f"{base}_{j}" for j in range(n)]


def parse_generate(body: bytes, tok: Tokenizer, limits: Limits) -> GeneratePlan:
    """Validate a /generate body and expand it into engine requests (batch x n), in the order of the response."""
    g: GenerateIn = decode_body(body, GenerateIn)
    if (g.text is None) == (g.input_ids is None):
        raise ProtocolError(
            "exactly one of `text` or `input_ids` must be given"
            if g.text is not None
            else "missing prompt: give `text` or `input_ids`"
        )
    if g.text is not None:
        batched = isinstance(g.text, list)
        texts = g.text if batched else [g.text]
        check_request_count(len(texts))
        prompts = [tok.encode(t) for t in texts]
    else:
        ids = g.input_ids
        kinds = {type(x) for x in ids}
        if len(kinds) > 1:
            raise ProtocolError("input_ids must be a list of ints or a list of lists of ints, not a mix")
        batched = kinds == {list}
        prompts = [list(p) for p in ids] if batched else [list(ids)]
    if batched and not prompts:
        raise ProtocolError("empty batch: `text` / `input_ids` is an empty list")
    size = len(prompts)
    check_request_count(size)
    for i, p in enumerate(prompts):
        check_prompt(p, limits, f"prompt {i}" if batched else "prompt")

    sps = _per_item(g.sampling_params if g.sampling_params is not None else SamplingIn(), size, "sampling_params")
    if isinstance(g.sampling_params, list) and not batched:
        raise ProtocolError("sampling_params is a list but the request is not a batch")
    ret_lp = _per_item(g.return_logprob, size, "return_logprob")
    starts = _per_item(g.logprob_start_len, size, "logprob_start_len")
    tops = _per_item(g.top_logprobs_num, size, "top_logprobs_num")
    prios = _per_item(g.priority if g.priority is not None else 0, size, "priority")

    if isinstance(g.rid, list):
        if not batched:
            raise ProtocolError("rid is a list but the request is not a batch")
        if len(g.rid) != size:
            raise ProtocolError(f"rid has {len(g.rid)} entries but the batch has {size} prompts")
        bases = list(g.rid)
    elif g.rid is not None:
        bases = [f"{g.rid}_{i}" for i in range(size)] if batched else [g.rid]
    else:
        bases = [new_rid() for _ in range(size)]

    requests: list[EngineRequest] = []
    any_n = False
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        s = _sampling_from_sglang(sp, len(p), limits)
        start, top = starts[i], tops[i]
        if ret_lp[i] and (start < -1 or start >= len(p)):
            raise ProtocolError(
                f"logprob_start_len must be -1 or in [0, {len(p) - 1}] (the prompt has {len(p)} tokens), got {start}"
            )
        if ret_lp[i] and (top < 0 or top > limits.vocab_size):
            raise ProtocolError(f"top_logprobs_num must be in [0, {limits.vocab_size}], got {top}")
        any_n |= sp.n > 1
        check_request_count(len(requests) + sp.n)
        for rid in sample_rids(bases[i], sp.n):
            requests.append(
                EngineRequest(
                    rid=rid,
                    input_ids=p,
                    sampling=s,
                    return_logprob=ret_lp[i],
                    logprob_start_len=start if ret_lp[i] else -1,
                    top_logprobs_num=top if ret_lp[i] else 0,
                    priority=prios[i],
                    stream=g.stream,
                )
            )
    check_unique_rids([r.rid for r in requests])
    return GeneratePlan(
        requests=requests, batched=batched or any_n, stream=g.stream, return_text_in_logprobs=g.return_text_in_logprobs
    )


def check_request_count(count: int) -> None:
    if count > MAX_REQUESTS_PER_CALL:
        raise ProtocolError(
            f"one call may ask for at most {MAX_REQUESTS_PER_CALL} generations (prompts x n), this one asks for {count}"
        )


def check_unique_rids(rids: list[str]) -> None:
    seen: set[str] = set()
    for r in rids:
        if r in seen:
            raise ProtocolError(f"duplicate rid {r!r} in one request")
        seen.add(r)


# ---- response accumulation ----------------------------------------------------------------------------------------


def stop_hold(text: str, stops: list[str]) -> int:
    """How many trailing chars could be the start of a stop string (withheld from a stream until decided)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class Accumulator:
    """Folds one engine request's chunks (new tokens each) into SGLang's cumulative view of it.

    Besides SGLang's fields, `meta_info.weight_version_spans` says which weights made which output tokens:
    `[[offset, version], ...]`, offsets into this response's `output_ids`, ascending, the first at 0, a new entry
    wherever the version changed (an in-flight weight update), empty while there is no output. Token i was made by
    the version of the last span with offset <= i. `weight_version` stays SGLang's: the server's version now.

    While unfinished, the text grows incrementally (only a short window of recent ids is decoded per call, so a
    long stream costs linear, not quadratic, time) and a trailing partial character or a possible stop-string
    prefix is withheld, which keeps each streamed text a prefix of the final one. The final text is one full
    decode, trimmed of the matched stop.
    """

    def __init__(
        self, req: EngineRequest, tok: Tokenizer, *, text_in_logprobs: bool = False, started: float | None = None
    ):
        self.req = req
        self.tok = tok
        self.text_in_logprobs = text_in_logprobs
        self.started = time.perf_counter() if started is None else started
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[float | None] | None = None
        self.finish_reason: dict | None = None
        self.prompt_tokens = len(req.input_ids)
        self.cached_tokens = 0
        self.weight_version = ""  # the server's version as of the last chunk (SGLang's meta_info.weight_version)
        # [offset into output_ids, version] where the version of the weights that made the tokens changes
        self.version_spans: list[list] = []
        self.e2e_latency = 0.0
        self._tok_text: dict[int, str] = {}
        # incremental detokenisation: text of output_ids[:_read] is _text; ids from _prefix on are re-decoded
        self._text = ""
        self._prefix = 0
        self._read = 0

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, ch: EngineChunk) -> None:
        if ch.new_ids and (not self.version_spans or self.version_spans[-1][1] != ch.weight_version):
            self.version_spans.append([len(self.output_ids), ch.weight_version])
        self.output_ids.extend(ch.new_ids)
        self.logprobs.extend(ch.new_logprobs)
        self.top_logprobs.extend(ch.new_top_logprobs)
        if ch.input_logprobs is not None:
            self.input_logprobs = list(ch.input_logprobs)
        if ch.prompt_tokens:
            self.prompt_tokens = ch.prompt_tokens
        self.cached_tokens = ch.cached_tokens
        self.weight_version = ch.weight_version
        if ch.finish_reason is not None:
            self.finish(ch.finish_reason)

    def finish(self, reason: dict) -> None:
        self.finish_reason = reason
        self.e2e_latency = time.perf_counter() - self.started

    def abort_reason(self, message: str) -> None:
        """Mark finished by abort (the engine ended without saying why, or the server gave up on it)."""
        self.finish({"type": "abort", "message": message, "status_code": None, "err_type": None})

    def token_text(self, tid: int) -> str:
        """One token's text, special tokens included (as SGLang's logprob texts are)."""
        t = self._tok_text.get(tid)
        if t is None:
            t = self._tok_text[tid] = self.tok.decode([tid], skip_special_tokens=False)
        return t

    def text(self) -> str:
        """SGLang's `text`: trimmed of a matched stop (unless no_stop_trim) once finished; stream-safe before."""
        s = self.req.sampling
        ids = self.output_ids
        fr = self.finish_reason
        matched = fr.get("matched") if fr and fr.get("type") == "stop" else None
        if isinstance(matched, int) and not s.no_stop_trim and ids and ids[-1] == matched:
            ids = ids[:-1]
        if fr is None:
            text = self._decode_more()
            return text[: len(text) - stop_hold(text, s.stop)]
        text = self.tok.decode(ids, skip_special_tokens=s.skip_special_tokens)
        if isinstance(matched, str) and not s.no_stop_trim:
            pos = text.find(matched)
            if pos != -1:
                text = text[:pos]
        return text

    def _decode_more(self) -> str:
        """Extend the streamed text by the ids that arrived since the last call.

        Decoding [prefix:] against [prefix:read] (a few ids of left context) gets word-boundary spaces right for
        tokenizers that drop a leading space at the start of a decode; a trailing U+FFFD means the last ids end
        inside a multi-byte character, so they wait for the next call.
        """
        ids = self.output_ids
        if self._read == len(ids):
            return self._text
        skip = self.req.sampling.skip_special_tokens
        before = self.tok.decode(ids[self._prefix : self._read], skip_special_tokens=skip)
        after = self.tok.decode(ids[self._prefix :], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(ids)
        return self._text

    def _triples(self, lps: list, ids: list[int]) -> list[list]:
        if self.text_in_logprobs:
            return [[lp, t, self.token_text(t)] for lp, t in zip(lps, ids)]
        return [[lp, t, None] for lp, t in zip(lps, ids)]

    def meta_info(self) -> dict:
        m: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "weight_version": self.weight_version,
            "weight_version_spans": [list(span) for span in self.version_spans],
            "e2e_latency": self.e2e_latency if self.finished else time.perf_counter() - self.started,
        }
        req = self.req
        if req.return_logprob:
            m["output_token_logprobs"] = self._triples(self.logprobs, self.output_ids)
            if req.logprob_start_len >= 0:
                ids = req.input_ids[req.logprob_start_len :]
                lps = self.input_logprobs if self.input_logprobs is not None else []
                m["input_token_logprobs"] = self._triples(lps, ids)
            if req.top_logprobs_num > 0:
                m["output_top_logprobs"] = [
                    self._triples([lp for lp, _ in top], [t for _, t in top]) for top in self.top_logprobs
                ]
        return m

    def generate_response(self) -> dict:
        """One /generate response object (also each streamed chunk: everything cumulative)."""
        return {"text": self.text(), "output_ids": list(self.output_ids), "meta_info": self.meta_info()}


# ---- control endpoints --------------------------------------------------------------------------------------------


class PauseIn(msgspec.Struct, kw_only=True):
    mode: str = "abort"


def parse_pause(body: bytes) -> PauseMode:
    mode = decode_body(body, PauseIn, empty_ok=True).mode
    if mode not in ("abort", "retract", "in_place"):
        raise ProtocolError(f"unknown pause mode {mode!r}; expected 'abort', 'retract' or 'in_place'")
    return mode  # type: ignore[return-value]


class AbortIn(msgspec.Struct, kw_only=True):
    rid: str = ""
    abort_all: bool = False


class UpdateFromDiskIn(msgspec.Struct, kw_only=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    flush_cache: bool = True


class InitGroupIn(msgspec.Struct, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyGroupIn(msgspec.Struct, kw_only=True):
    group_name: str = "weight_update_group"


class DeltaIn(msgspec.Struct, kw_only=True):
    dtype: str  # the served dtype the XOR is of
    base: str  # protocol/weight_identity.combine of the weights it applies to
    result: str  # ... and of the weights it gives


class LoraIn(msgspec.Struct, kw_only=True):
    r: int  # the adapters' rank
    lora_alpha: float  # W = W0 + lora_alpha / r * B @ A


class UpdateFromDistributedIn(msgspec.Struct, kw_only=True):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    # ours, not SGLang's: the tensors are a delta's payloads (uint8, deflated XOR of the served bits), applied to
    # weights whose identity is `base` and checked to give `result` (server/delta_load.py)
    delta: DeltaIn | None = None
    # ours too: the tensors are LoRA adapters under peft's names (fp32 A and B), merged into the base the server
    # keeps (server/lora_load.py)
    lora: LoraIn | None = None

    def check(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ProtocolError(
                f"names, dtypes and shapes must have equal lengths, got {len(self.names)}, "
                f"{len(self.dtypes)}, {len(self.shapes)}"
            )
        if any(d < 0 for s in self.shapes for d in s):
            raise ProtocolError("shapes must be non-negative")


class UpdateWeightVersionIn(msgspec.Struct, kw_only=True):
    new_version: str | int
    abort_all_requests: bool = True


class GetWeightsByNameIn(msgspec.Struct, kw_only=True):
    """SGLang's /get_weights_by_name body: the answer is `param[:truncate_size]` as nested lists of floats."""

    name: str
    truncate_size: int = 100


def version_str(v: str | int | None) -> str | None:
    return None if v is None else str(v)


def error_body(message: str, status: int = 400) -> dict:
    """The error object every endpoint returns (OpenAI's shape, which SGLang's OpenAI routes use too)."""
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError" if status >= 500 else "Error")
    return {"error": {"message": message, "type": kind, "code": status}}

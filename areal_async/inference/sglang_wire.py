"""SGLang's POST /generate as the client speaks it: one segment's request body, and its answers (JSON or either kind
of streamed event) read into a `ResumeState` (resume.py) token by token, each with the version that made it.

The fields relied on, and how per-token versions are read with and without `weight_version_spans`, are listed in
docs/inference.md, "What the client relies on in SGLang's /generate". No torch here.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import msgspec

from areal_async.inference.fleet import parse_weight_version
from areal_async.inference.resume import ResumeState, SegmentEnd
from areal_async.inference.transport import InferenceError, StreamError


class FinishReason(msgspec.Struct):
    type: str
    matched: int | str | None = None
    message: str | None = None
    status_code: Any = None
    length: int | None = None


class MetaInfo(msgspec.Struct):
    id: str = ""
    finish_reason: FinishReason | None = None
    weight_version: Any = None
    weight_version_spans: list[tuple[int, Any]] | None = None
    # SGLang 0.5.19+: [{"version", "start", "end"}] over the output tokens, on the answer that finishes a request
    weight_versions: list[dict[str, Any]] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # [logprob, token_id, token_text]; orjson (SGLang's encoder) writes -inf as null
    output_token_logprobs: list[tuple[float | None, int, str | None]] | None = None


class GenerateResponse(msgspec.Struct):
    meta_info: MetaInfo
    text: str | None = ""


class _ErrorEvent(msgspec.Struct):
    error: dict[str, Any] | str


_decode_response = msgspec.json.Decoder(GenerateResponse).decode
_decode_error = msgspec.json.Decoder(_ErrorEvent).decode


def segment_payload(state: ResumeState, rid: str, base: dict, *, stream: bool, priority: int | None) -> dict:
    """The /generate body that continues `state`: prompt + tokens so far, with what is left of the budget."""
    sp = dict(base)
    sp["max_new_tokens"] = state.remaining
    sp["min_new_tokens"] = state.min_remaining
    payload: dict[str, Any] = {
        "input_ids": state.segment_input(),
        "sampling_params": sp,
        "return_logprob": True,
        "stream": stream,
        "rid": rid,
    }
    if state.stops:  # per-token text lets the client honour a stop string that spans a resubmission boundary
        payload["return_text_in_logprobs"] = True
    if priority is not None:
        payload["priority"] = priority
    return payload


def span_versions(spans: list[tuple[int, Any]], n: int, start: int, where: str) -> list[int]:
    """Versions of tokens [start, n) of an answer with `n` output tokens, from its weight_version_spans."""
    if n == 0:
        if spans:
            raise InferenceError(f"{where}: weight_version_spans {spans!r} for an answer without tokens")
        return []
    if not spans:
        raise InferenceError(f"{where}: empty weight_version_spans for an answer with {n} tokens")
    prev = -1
    for off, _ in spans:
        if not isinstance(off, int) or off <= prev or off >= n or (prev == -1 and off != 0):
            raise InferenceError(
                f"{where}: malformed weight_version_spans {spans!r} for {n} tokens (offsets "
                "must ascend from 0 and stay below the token count)"
            )
        prev = off
    out: list[int] = []
    for i, (off, ver) in enumerate(spans):
        end = spans[i + 1][0] if i + 1 < len(spans) else n
        lo = max(off, start)
        if end > lo:
            out.extend(itertools.repeat(parse_weight_version(ver), end - lo))
    return out


class SegmentReader:
    """Reads one submission's answer (one JSON body, or the events of a stream) into the state."""

    def __init__(self, state: ResumeState, url: str, counts: dict[str, int], *, pinned: int | None = None):
        self.state = state
        # the version of an SGLang LoRA adapter the request names (lora_window.py): its every token is that
        # version's, whatever weight_version (the server's label) says
        self.pinned = pinned
        self.url = url
        self.where = url + "/generate"
        self.counts = counts
        self.received = 0  # tokens of this submission taken so far
        self.finish: FinishReason | None = None

    def feed(self, data: bytes) -> None:
        if data.startswith(b'{"error"'):
            try:
                err = _decode_error(data).error
            except msgspec.DecodeError:
                err = data[:300].decode("utf-8", "replace")
            msg = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            code = err.get("code") if isinstance(err, dict) else None
            raise StreamError(msg, code if isinstance(code, int) and code >= 400 else 500)
        try:
            resp = _decode_response(data)
        except msgspec.DecodeError as e:
            raise InferenceError(f"{self.where}: malformed response: {e}") from e
        meta = resp.meta_info
        triples = meta.output_token_logprobs
        if triples is None:
            raise InferenceError(f"{self.where}: no output_token_logprobs (return_logprob ignored?)")
        n, total, have = len(triples), meta.completion_tokens, self.received
        if have == 0 or n == total or total == 0:  # cumulative (or the first answer): skip what we have
            if n < have:
                raise InferenceError(f"{self.where}: a cumulative event has {n} tokens after {have}")
            start, cumulative = have, True
        elif total == have + n:  # incremental stream: only the new tokens
            start, cumulative = 0, False
        else:
            raise InferenceError(
                f"{self.where}: an event with {n} tokens fits neither a cumulative nor an "
                f"incremental stream ({have} received, completion_tokens {total})"
            )
        if n > start:
            new = triples[start:] if start else triples
            if self.pinned is not None:
                versions = [self.pinned] * (n - start)
            elif meta.weight_version_spans is not None:
                versions = span_versions(meta.weight_version_spans, n, start, self.where)
            else:
                versions = [parse_weight_version(meta.weight_version)] * (n - start)
            lps, ids, texts = zip(*new)  # column-wise in C: long answers make a per-token Python loop the hot spot
            if None in lps:
                lps = tuple(-math.inf if lp is None else lp for lp in lps)
            self.state.add_tokens(ids, lps, versions, texts)
            self.received += n - start
            self.counts["tokens"] += n - start
        if meta.weight_versions and self.pinned is None and self.received:
            self._exact_versions(meta.weight_versions, n if cumulative else self.received)
        if resp.text is not None:
            self.state.set_segment_text(resp.text, cumulative)
        if meta.finish_reason is not None:
            self.finish = meta.finish_reason

    def _exact_versions(self, spans: list[dict[str, Any]], n: int) -> None:
        """SGLang 0.5.19+ says which version made each token only when the request finishes (its streamed events
        carry the label of the moment): the finishing answer's spans overwrite the segment's versions."""
        try:
            pairs = [(int(sp["start"]), sp["version"]) for sp in spans]
        except (KeyError, TypeError, ValueError) as e:
            raise InferenceError(f"{self.where}: malformed weight_versions {spans!r}") from e
        versions = span_versions(pairs, n, 0, self.where)
        first = self.state.segment_starts[-1] if self.state.segment_starts else 0
        if len(versions) != len(self.state.out_versions) - first:
            raise InferenceError(
                f"{self.where}: weight_versions cover {len(versions)} tokens, the segment has "
                f"{len(self.state.out_versions) - first}"
            )
        self.state.out_versions[first:] = versions

    def end(self) -> SegmentEnd:
        fr = self.finish
        if fr is None:
            raise InferenceError(f"{self.where}: response without finish_reason")
        code = fr.status_code if isinstance(fr.status_code, int) else None
        return SegmentEnd(fr.type, fr.matched, code, fr.message, self.url)

"""Interruptible generation as a state machine that any token-in/token-out backend can drive through its `submit`.

A generation is a run of segments (prompt + tokens so far, the remaining budget); each segment's end (stop, length,
our pause, a foreign abort, our abort, a refusal) decides the next, every token keeps the weight version that made
it, and stop strings spanning segments are found here. The table of transitions is in docs/inference.md,
"Interruptible generation". No HTTP and no torch here.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple, Protocol

from areal_async.types import GenerationResult, SamplingParams

log = logging.getLogger(__name__)


class SegmentRejected(Exception):
    """A segment came back aborted with a 4xx status: the request is bad, resubmitting cannot help."""

    def __init__(self, message: str, status: int, server: str):
        super().__init__(message)
        self.status = status
        self.server = server


class SegmentEnd(NamedTuple):
    """How one submission ended (after any failover inside it)."""

    finish: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token id or stop string
    status_code: int | None = None  # an abort may carry an HTTP-like status; 4xx means the request was refused
    message: str | None = None
    server: str = ""  # who answered


def find_stop(token_texts: list[str], stops: list[str], min_tokens: int) -> tuple[int, str, int] | None:
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


_warned_no_text = False


class ResumeState:
    """One logical generation across segments: what was asked, and every token received so far."""

    def __init__(self, rid: str, input_ids: list[int], sampling: SamplingParams):
        self.rid = rid
        self.prompt = list(input_ids)
        self.sampling = sampling
        self.stops = [s for s in (sampling.stop or []) if s]
        self.out_ids: list[int] = []
        self.out_logprobs: list[float] = []
        self.out_versions: list[int] = []
        self.token_texts: list[str | None] = []  # kept only with stop strings
        self.segment_texts: list[str] = []
        self.segment_starts: list[int] = []  # len(out_ids) when each segment was submitted
        self.interruptions = 0
        self.server = ""
        self.started = time.perf_counter()

    # ---- what the backend reads and writes ----------------------------------------------------------------------

    @property
    def remaining(self) -> int:
        return self.sampling.max_new_tokens - len(self.out_ids)

    @property
    def min_remaining(self) -> int:
        return max(0, self.sampling.min_new_tokens - len(self.out_ids))

    def segment_input(self) -> list[int]:
        return self.prompt + self.out_ids if self.out_ids else self.prompt

    def begin_segment(self) -> None:
        """A body for a new submission is being sent (a resumption, or a failover mid-segment)."""
        self.segment_starts.append(len(self.out_ids))
        self.segment_texts.append("")

    def add_tokens(
        self,
        ids: list[int] | tuple[int, ...],
        logprobs: list[float] | tuple[float, ...],
        versions: list[int],
        texts: list[str | None] | tuple[str | None, ...] | None = None,
    ) -> None:
        """New output tokens, in order; `versions[i]` is the weight version that made `ids[i]`."""
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError("ids, logprobs and versions must have equal lengths")
        self.out_ids.extend(ids)
        self.out_logprobs.extend(logprobs)
        self.out_versions.extend(versions)
        if self.stops:
            self.token_texts.extend(texts if texts is not None else [None] * len(ids))

    def set_segment_text(self, text: str, cumulative: bool = True) -> None:
        """The current segment's text so far: the whole of it (`cumulative`) or the piece since the last call."""
        if not self.segment_texts:
            self.segment_texts.append("")
        self.segment_texts[-1] = text if cumulative else self.segment_texts[-1] + text

    # ---- the machine's own steps --------------------------------------------------------------------------------

    def stop_across_boundaries(self) -> tuple[int, str, int] | None:
        """A stop string completed across a segment boundary, if any (needs per-token text)."""
        global _warned_no_text
        if not self.stops or not any(s > 0 for s in self.segment_starts):
            return None
        if any(t is None for t in self.token_texts):
            if not _warned_no_text:
                _warned_no_text = True
                log.warning("server returned no per-token text; stop strings across interruptions are not checked")
            return None
        return find_stop(self.token_texts, self.stops, self.sampling.min_new_tokens)  # type: ignore[arg-type]

    def result(
        self, finish: str, matched: int | str | None, *, return_text: bool, text_override: str | None = None
    ) -> GenerationResult:
        if not return_text:
            text = ""
        elif text_override is not None:
            text = text_override
        else:
            text = "".join(self.segment_texts)
        return GenerationResult(
            input_ids=self.prompt,
            output_ids=self.out_ids,
            output_logprobs=self.out_logprobs,
            output_versions=self.out_versions,
            finish_reason=finish,  # type: ignore[arg-type]
            text=text,
            matched_stop=matched if finish == "stop" else None,
            num_interruptions=self.interruptions,
            latency_s=time.perf_counter() - self.started,
            server=self.server,
        )


class ResumeControl(Protocol):
    """What the machine needs from the client that drives it."""

    def is_paused(self) -> bool:
        """The client paused the servers itself (pause()), so an abort now means: wait for resume()."""
        ...

    async def wait_resumed(self) -> None: ...

    def cancelled(self, rid: str) -> bool:
        """The caller aborted this request (abort(rid)): it ends with its tokens so far."""
        ...


Submit = Callable[[ResumeState], Awaitable["SegmentEnd | None"]]


async def generate_resumable(
    state: ResumeState,
    submit: Submit,
    control: ResumeControl,
    *,
    return_text: bool,
    max_idle_aborts: int = 3,
    backoff_s: float = 0.2,
    on_segment: Callable[[ResumeState], None] | None = None,
) -> GenerationResult:
    """Drive `submit` until the generation ends (docs/inference.md has the transitions); one seamless result.

    `submit(state)` sends one segment (prompt + `state.out_ids`, `state.remaining` new tokens at most, at least
    `state.min_remaining`), feeds what arrives into `state.add_tokens` / `set_segment_text`, and returns how it
    ended, or None when there was nothing left to ask (budget spent, or cancelled before sending).
    `on_segment(state)` is called after every segment that brought tokens, before any wait for a resume: the
    rollout's journal keeps the tokens of an interrupted request from there (rollout/journal.py).
    """
    idle_aborts = 0  # consecutive aborts from elsewhere that produced nothing
    while True:
        if state.segment_starts and state.remaining <= 0:
            return state.result("length", None, return_text=return_text)
        before = len(state.out_ids)
        end = await submit(state)
        if on_segment is not None and len(state.out_ids) > before:
            on_segment(state)
        if end is None:
            finish = "abort" if control.cancelled(state.rid) else "length"
            return state.result(finish, None, return_text=return_text)
        state.server = end.server or state.server
        hit = state.stop_across_boundaries()
        if hit is not None:
            tok, s, pos = hit
            del state.out_ids[tok + 1 :], state.out_logprobs[tok + 1 :], state.out_versions[tok + 1 :]
            text = "".join(state.token_texts[: tok + 1])[:pos]  # type: ignore[arg-type]
            return state.result("stop", s, return_text=return_text, text_override=text)
        if end.finish != "abort":
            return state.result(end.finish, end.matched, return_text=return_text)
        code = end.status_code
        if isinstance(code, int) and 400 <= code < 500:
            raise SegmentRejected(f"{end.server}: aborted: {end.message}", code, end.server)
        if control.cancelled(state.rid):
            return state.result("abort", None, return_text=return_text)
        if control.is_paused():  # we paused the servers: continue once they are resumed
            await control.wait_resumed()
        else:  # aborted from elsewhere (another controller, a server shutting down): back off and retry; give
            # up if it keeps happening with nothing made, since then someone means to stop it
            idle_aborts = 0 if len(state.out_ids) > before else idle_aborts + 1
            if idle_aborts > max_idle_aborts:
                return state.result("abort", None, return_text=return_text)
            await asyncio.sleep(backoff_s * 2**idle_aborts)
        if control.cancelled(state.rid):
            return state.result("abort", None, return_text=return_text)
        state.interruptions += 1

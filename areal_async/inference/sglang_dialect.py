"""SGLang's releases 0.5.6 to 0.5.23 as one dialect: what changed in its HTTP protocol, mapped in one place.

The client writes SGLang's protocol as 0.5.6-0.5.18 speak it. What later releases changed, and how it is met here
(each read from the released wheels and checked against real servers in CI: tests/test_sglang_conformance.py):

- 0.5.19: /generate answers carry exact per-token `meta_info.weight_versions` spans (read by sglang_wire.py).
- 0.5.20: GET /ready answers 503 while paused; not needed: the heartbeat's liveness path ignores pauses (below).
- 0.5.21: /update_weights_from_distributed and _from_tensor run only between POST /begin_weight_update and
  POST /end_weight_update (`weight_update_sessions`): each call is wrapped, and a session left open by a crash is
  closed first.
- 0.5.22: /generate refuses unknown sampling_params keys and integers written as floats (`strict_json`): only
  SGLang's keys are sent, integers as integers.
- A cache flush refused after an update (a request still running): up to 0.5.21 an assertion ends the
  scheduler, from 0.5.22 the update answers 400 with the weights loaded. So an update never asks SGLang to flush:
  it loads with `flush_cache` off, then POST /flush_cache is asked until it is taken.

Liveness: a real SGLang's /health is a one-token generation queued behind the running batch (on a busy CPU it takes
seconds, and while paused it waits for /continue_generation), so the heartbeat asks /model_info instead, which the
HTTP front answers at once. A hung front (SIGSTOP) answers neither. Recovery
still asks /health, which proves the scheduler generates. No torch here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from areal_async.inference.dialect import Dialect, EventSink, RawSend

log = logging.getLogger(__name__)

__all__ = ["SGLangDialect"]

FLUSH_TRIES = 100  # x 0.1 s: how long a flush after an update waits for the last requests to leave

# sampling_params keys SGLang has had throughout the window (the client sends a subset of these)
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "n",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "json_schema",
        "regex",
        "ebnf",
        "logit_bias",
        "sampling_seed",
        "custom_params",
    }
)
OLDEST = (0, 5, 6)  # the oldest release the client speaks to (each has /model_info, the liveness path)
INT_KEYS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_SESSION_PATHS = ("/update_weights_from_distributed", "/update_weights_from_tensor")


class SGLangDialect(Dialect):
    """One SGLang server of a release (None: it gave no release string; read as the oldest of the window, whose
    protocol every later release still answers but for the changes above)."""

    engine = "sglang"
    liveness_path = "/model_info"
    # its HTTP front shares the host's cores with the scheduler (and, on a small machine, with the trainers): on a
    # loaded host it can take seconds to answer. 6 x health_timeout_s: 30 s at the default, SGLang's own /health
    # gives its scheduler 20 s
    hang_timeouts = 6

    def __init__(self, version: tuple[int, ...] | None = None, info: dict[str, Any] | None = None):
        super().__init__(version, info)
        v = version or OLDEST
        self.version_spans = v >= (0, 5, 19)
        self.weight_update_sessions = v >= (0, 5, 21)
        self.strict_json = v >= (0, 5, 22)

    async def call(
        self, raw: RawSend, method: str, path: str, body: bytes | None, on_event: EventSink | None
    ) -> tuple[int, bytes]:
        if path == "/flush_cache":  # refused while a request runs, if only for the step in which it finishes
            return await _flush_when_idle(raw)
        if path == "/generate" and self.strict_json and body is not None:
            body = _strict_generate(body)
        flush = False
        if path.startswith("/update_weights_from") and body is not None:
            body, flush = _without_flush(body)
        if path in _SESSION_PATHS and self.weight_update_sessions:
            status, data = await self._in_session(raw, method, path, body, on_event)
        else:
            status, data = await raw(method, path, body, on_event)
        if status == 200 and flush:
            await _flush_when_idle(raw)
        return status, data

    async def _in_session(
        self, raw: RawSend, method: str, path: str, body: bytes | None, on_event: EventSink | None
    ) -> tuple[int, bytes]:
        """begin -> the update -> end. A begin refused because a session is open (a crash mid-update left it)
        closes that one first and begins again; end is sent whatever the update answered, so no session stays
        open behind a failed bucket."""
        status, data = await raw("POST", "/begin_weight_update", b"{}", None)
        if status != 200:
            await raw("POST", "/end_weight_update", b"{}", None)
            status, data = await raw("POST", "/begin_weight_update", b"{}", None)
            if status != 200:
                return status, data
        try:
            status, data = await raw(method, path, body, on_event)
        finally:
            end_status, end_data = await raw("POST", "/end_weight_update", b"{}", None)
        if status == 200 and end_status != 200:
            return end_status, end_data
        return status, data


def _strict_generate(body: bytes) -> bytes:
    """Only SGLang's sampling_params keys, integers as JSON integers (0.5.22 answers 400 otherwise)."""
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body  # the server's 400 says what is wrong
    sp = payload.get("sampling_params") if isinstance(payload, dict) else None
    if not isinstance(sp, dict):
        return body
    clean = {k: v for k, v in sp.items() if k in SAMPLING_KEYS}
    for k in INT_KEYS:
        v = clean.get(k)
        if isinstance(v, float) and v.is_integer():
            clean[k] = int(v)
    if clean == sp:
        return body
    payload["sampling_params"] = clean
    return msgspec.json.encode(payload)


def _without_flush(body: bytes) -> tuple[bytes, bool]:
    """The update's body with `flush_cache` off, and whether it was on. Up to 0.5.21 an update whose flush is
    refused (a request still running, if only for the moment it takes to finish) fails an assertion that ends the
    scheduler; from 0.5.22 it answers 400 with the weights loaded. Either way the flush is better asked apart."""
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body, False
    if not isinstance(payload, dict) or not payload.get("flush_cache", True):
        return body, False
    payload["flush_cache"] = False
    return msgspec.json.encode(payload), True


async def _flush_when_idle(raw: RawSend, tries: int = FLUSH_TRIES, wait_s: float = 0.1) -> tuple[int, bytes]:
    """POST /flush_cache until SGLang takes it: it refuses while a request runs, and the requests of an abort-mode
    pause take a scheduler step or two to leave. A flush still refused after `tries` is logged: the radix cache
    then holds prefixes of the old weights (the launcher turns it off where requests run across updates)."""
    status, data = 400, b""
    for _ in range(tries):
        status, data = await raw("POST", "/flush_cache", None, None)
        if status == 200:
            return status, data
        await asyncio.sleep(wait_s)
    log.error("SGLang refused to flush its cache (%s): old-weight prefixes may be reused", data[:200])
    return status, data

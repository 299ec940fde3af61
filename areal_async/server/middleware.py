"""The guards in front of every handler of the embedded server: error shapes, API key, readiness (aiohttp middlewares).

Apart from app.py because none of them knows an endpoint: they turn any failure into SGLang's JSON error body,
check `Authorization: Bearer <key>` in constant time, and answer 503 while the engine is starting or stopping. The
JSON response helpers live here too, since every answer a middleware gives is one of them (the handlers use them
as well).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Any, Protocol

import msgspec
from aiohttp import web

from areal_async.protocol import sglang as sglang_protocol

log = logging.getLogger("areal_async.server.app")  # the server's log, as before these guards had a module

_json_enc = msgspec.json.Encoder()


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_json_enc.encode(obj), status=status, content_type="application/json")


def error_response(message: str, status: int) -> web.Response:
    return json_response(sglang_protocol.error_body(message, status), status)


# Answer in every state: health reports the state itself, info only reads the engine's settings.
ALWAYS_OPEN = frozenset(
    {"/health", "/health_generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/v1/models"}
)


class HasStatus(Protocol):
    """What the readiness guard reads of the server (app.py's SGLangServer): named here, so that app.py imports this
    module and not the other way round."""

    status: str  # starting | ready | stopping


def ready_middleware(srv: HasStatus):
    """503 for generation and control while the engine is starting or stopping (it cannot act on them)."""

    @web.middleware
    async def ready(request: web.Request, handler):
        if srv.status != "ready" and request.path not in ALWAYS_OPEN:
            return error_response(f"server is {srv.status}", 503)
        return await handler(request)

    return ready


def auth_middleware(api_key: str | None):
    expected = api_key.encode() if api_key is not None else None

    @web.middleware
    async def auth(request: web.Request, handler):
        if expected is not None and not request.path.startswith("/health"):
            got = request.headers.get("Authorization", "")
            token = got[7:].encode() if got[:7].lower() == "bearer " else b""
            if not hmac.compare_digest(token, expected):
                return error_response(
                    "Unauthorized: missing or wrong API key (send 'Authorization: Bearer <key>')", 401
                )
        return await handler(request)

    return auth


@web.middleware
async def error_middleware(request: web.Request, handler):
    """Every failure becomes a JSON error; a bug in a handler is a logged 500, never a dead server."""
    try:
        return await handler(request)
    except sglang_protocol.ProtocolError as e:
        return error_response(str(e), e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = error_response(e.reason or "error", e.status)
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(f"internal server error: {type(e).__name__}: {e}", 500)

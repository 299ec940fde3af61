"""How the OpenAI proxy answers over HTTP: `ProxyError` (an OpenAI error with its status and parameter), JSON bodies,
OpenAI error objects, and answers as one JSON body or as an OpenAI event stream.

Apart from openai_proxy.py because it is the wire shape of every answer, whatever the endpoint; the proxy decides
what to answer, this module how it goes out. The stream is written after generation has finished: one chunk per
choice, then the usage chunk when asked for, then `[DONE]`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from areal_async.protocol import openai_requests, openai_responses


class ProxyError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


_enc = msgspec.json.Encoder()


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_enc.encode(obj), status=status, content_type="application/json")


def error_response(message: str, status: int, param: str | None = None) -> web.Response:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error"
    )
    return json_response({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


async def send_event(resp: web.StreamResponse, obj: Any) -> None:
    await resp.write(b"data: " + _enc.encode(obj) + b"\n\n")


async def answer(
    request: web.Request,
    plan: openai_requests.OpenAIPlan,
    body: dict,
    views: list[openai_responses.GenerationChoice],
) -> web.StreamResponse:
    if not plan.stream:
        return json_response(body)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    chunk = openai_responses.chat_chunk if plan.kind == "chat" else openai_responses.completion_chunk
    for idx, view in enumerate(views):  # generation is over: one chunk per choice carries all of it
        ev = chunk(plan, idx, view, openai_responses.StreamDelta(), body["model"], body["id"], body["created"])
        if ev is not None:
            await send_event(resp, ev)
    if plan.include_usage:
        await send_event(resp, openai_responses.usage_chunk(plan, views, body["model"], body["id"], body["created"]))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp

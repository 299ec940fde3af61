"""One HTTP exchange (inference/http_exchange.py): a request that could not be written (a kept-alive connection the
server closed as it was reused) is written once more instead of costing the server its place in rotation; other
transport errors are `ConnectionFailed` at once; the pool drops idle connections before SGLang's and vLLM's HTTP
servers (uvicorn, 5 s) would."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from areal_async.inference.errors import ConnectionFailed
from areal_async.inference.http_exchange import KEEPALIVE_S, exchange
from areal_async.inference.routing import ServerState
from areal_async.inference.transport import ServerPool


class _Answer:
    status = 200
    headers = {"Content-Type": "application/json"}

    async def read(self) -> bytes:
        return b'{"ok": true}'

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class _Session:
    """Fails the first `fails` requests with `error`, then answers."""

    def __init__(self, error: BaseException, fails: int) -> None:
        self.error, self.fails, self.calls = error, fails, 0

    def request(self, method, url, **kw):
        self.calls += 1
        if self.calls <= self.fails:
            raise self.error
        return _Answer()


def _go(session, counts):
    server = ServerState("http://127.0.0.1:9")
    return asyncio.run(exchange(session, server, "POST", "/generate", b"{}", 5.0, None, counts))


def test_an_unwritten_request_is_written_once_more():
    counts: dict[str, int] = {}
    session = _Session(aiohttp.ClientOSError(32, "Can not write request body for http://127.0.0.1:9/generate"), 1)
    assert _go(session, counts) == (200, b'{"ok": true}')
    assert session.calls == 2 and counts["rewritten_requests"] == 1


def test_only_once_and_only_for_an_unwritten_request():
    twice = _Session(aiohttp.ClientOSError(32, "Can not write request body for x"), 2)
    with pytest.raises(ConnectionFailed):
        _go(twice, {})
    assert twice.calls == 2
    for error in (aiohttp.ServerDisconnectedError(), aiohttp.ClientOSError(104, "Connection reset by peer")):
        session = _Session(error, 1)  # the server may have seen it: not repeated here (the caller decides)
        with pytest.raises(ConnectionFailed):
            _go(session, {})
        assert session.calls == 1


def test_the_pool_keeps_idle_connections_for_less_than_uvicorn():
    assert KEEPALIVE_S < 5.0

    async def go():
        pool = ServerPool(["http://127.0.0.1:9"])
        try:
            return pool.session().connector._keepalive_timeout
        finally:
            await pool.close()

    assert asyncio.run(go()) == KEEPALIVE_S

"""Test-side conveniences for the RPC channel (areal_async/net/rpc.py) that the package itself never needs: a
blocking client for code running outside an event loop, and a server listener on a Unix socket."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from areal_async.net.rpc import DEFAULT_MAX_FRAME_BYTES, RpcClient, RpcServer

__all__ = ["RpcSyncClient", "start_unix"]


class RpcSyncClient:
    """Blocking wrapper for scripts and tests: its own event loop, one call at a time. Not for use inside a loop."""

    def __init__(
        self, address: str, secret: bytes, *, timeout: float = 30.0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._client = self._loop.run_until_complete(
                RpcClient.connect(address, secret, timeout=timeout, max_frame_bytes=max_frame_bytes)
            )
        except BaseException:
            self._loop.close()
            raise
        self._thread = threading.get_ident()

    def call(self, method: str, request: Any, response_type: type, *, timeout: float | None = None) -> Any:
        """RpcClient.call, blocking; only from the thread that connected (the loop belongs to it)."""
        if threading.get_ident() != self._thread:
            raise RuntimeError("RpcSyncClient must be used from the thread that created it")
        return self._loop.run_until_complete(self._client.call(method, request, response_type, timeout=timeout))

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def __enter__(self) -> RpcSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def start_unix(server: RpcServer, path: str) -> str:
    """Serve `server` on a Unix socket at `path` too (a stale socket file there is replaced); returns
    'unix:///abs/path'. The socket file stays after server.close() (tests put it under tmp_path)."""
    path = os.path.abspath(path)
    loop = asyncio.get_running_loop()
    return await server.listen(lambda protocol: loop.create_unix_server(protocol, path), lambda _: f"unix://{path}")

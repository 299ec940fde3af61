"""The RPC client: one authenticated connection to an RpcServer, any number of concurrent typed calls on it. It runs
the client side of the handshake (net/rpc_wire.py) and turns an ERROR reply into RpcError. Never imports torch.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import mmap
import os
import socket
from typing import Any

import msgspec

from areal_async.net.rpc_connection import CLOSE_FLUSH_S, Connection, drop_when_unreachable
from areal_async.net.rpc_wire import (
    AUTH,
    AUTH_FAIL,
    AUTH_OK,
    CLIENT_LABEL,
    DEFAULT_MAX_FRAME_BYTES,
    ERROR,
    HANDSHAKE_MAX_FRAME,
    HELLO,
    PROTOCOL_VERSION,
    REQUEST,
    RESPONSE,
    SERVER_LABEL,
    Auth,
    AuthFail,
    AuthOk,
    ErrorInfo,
    Hello,
    ProtocolViolation,
    RpcAuthError,
    RpcError,
    check_secret,
    decode_control,
    decode_envelope,
    handshake_mac,
    parse_address,
)

__all__ = ["RpcClient"]

log = logging.getLogger("areal_async.net.rpc")  # one logger for the whole channel, whichever module logs


class RpcClient:
    """One authenticated connection; any number of concurrent calls. Create with `await RpcClient.connect(...)`.

    Use it from the event loop it was connected on.
    """

    def __init__(self, address: str, secret: bytes, max_frame_bytes: int) -> None:
        self.address = address
        self._secret = bytes(secret)
        self._max_frame_bytes = max_frame_bytes
        self._conn: Connection | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._decoders: dict[Any, msgspec.msgpack.Decoder] = {}
        self._handshake: asyncio.Future | None = None
        self._nonce = os.urandom(32)
        self._server_nonce = b""
        self._authed = False
        self.server_name = ""

    @classmethod
    async def connect(
        cls, address: str, secret: bytes, *, timeout: float = 30.0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> RpcClient:
        """Connect and authenticate, retrying refused connections until `timeout` (the server may be starting).

        Raises RpcAuthError if either side fails to prove it knows the secret, ConnectionError on timeout.
        """
        check_secret(secret)
        kind, target, port = parse_address(address)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.01
        while True:
            client = cls(address, secret, max_frame_bytes)
            client._handshake = loop.create_future()
            conn = Connection(client, HANDSHAKE_MAX_FRAME, f"rpc client -> {address}")
            try:
                if kind == "tcp":
                    coro = loop.create_connection(lambda: conn, target, port)
                else:
                    coro = loop.create_unix_connection(lambda: conn, target)
                await asyncio.wait_for(coro, max(deadline - loop.time(), 0.001))
                break
            except (TimeoutError, ConnectionError, FileNotFoundError) as e:
                if loop.time() + delay >= deadline:
                    raise ConnectionError(f"could not connect to {address} within {timeout}s: {e!r}") from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
        try:
            await asyncio.wait_for(client._handshake, max(deadline - loop.time(), 1.0))
        except TimeoutError:
            conn.close("handshake timed out")
            raise ConnectionError(f"{address}: no handshake from the server within {timeout}s") from None
        except BaseException:
            conn.close("handshake failed")
            raise
        return client

    # -- Connection callbacks

    def on_connect(self, conn: Connection) -> None:
        self._conn = conn

    def on_frame(self, conn: Connection, frame: bytearray | mmap.mmap) -> None:
        env, payload = decode_envelope(frame)
        if env.kind in (RESPONSE, ERROR) and self._authed:
            fut = self._pending.pop(env.id, None)
            if fut is None or fut.done():
                log.debug("%s: dropping a late reply to %r (id %d)", conn.label, env.method, env.id)
            else:
                fut.set_result((env.kind, payload))
        elif env.kind == HELLO and not self._server_nonce:
            self._on_hello(conn, payload)
        elif env.kind == AUTH_OK and self._server_nonce and not self._authed:
            ok = decode_control(payload, AuthOk, "AUTH_OK")
            expected = handshake_mac(self._secret, SERVER_LABEL, self._server_nonce, self._nonce)
            if not hmac.compare_digest(ok.mac, expected):
                self._fail_handshake(RpcAuthError(f"{self.address}: the server could not prove it knows the secret"))
                conn.close("server failed authentication", error=True)
                return
            self._authed = True
            conn.max_frame_bytes = self._max_frame_bytes
            if self._handshake is not None and not self._handshake.done():
                self._handshake.set_result(None)
        elif env.kind == AUTH_FAIL and not self._authed:
            reason = decode_control(payload, AuthFail, "AUTH_FAIL").reason
            self._fail_handshake(RpcAuthError(f"{self.address} refused the connection: {reason}"))
        else:
            raise ProtocolViolation(f"unexpected frame kind {env.kind} from the server")

    def _on_hello(self, conn: Connection, payload: memoryview) -> None:
        hello = decode_control(payload, Hello, "HELLO")
        if hello.protocol != PROTOCOL_VERSION:
            self._fail_handshake(
                ConnectionError(
                    f"{self.address} speaks rpc protocol {hello.protocol}, this client speaks {PROTOCOL_VERSION}"
                )
            )
            conn.close("protocol version mismatch", error=True)
            return
        self._server_nonce = hello.nonce
        self.server_name = hello.name
        conn.label = f"rpc client -> {hello.name} at {self.address}"
        conn.peer_max_frame_bytes = hello.max_frame_bytes
        mac = handshake_mac(self._secret, CLIENT_LABEL, hello.nonce, self._nonce)
        conn.send(AUTH, 0, "", Auth(self._nonce, mac, self._max_frame_bytes))

    def _fail_handshake(self, exc: BaseException) -> None:
        if self._handshake is not None and not self._handshake.done():
            self._handshake.set_exception(exc)

    def on_close(self, conn: Connection, reason: str) -> None:
        self._fail_handshake(ConnectionError(f"{self.address}: connection closed during the handshake: {reason}"))
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"{self.address}: {reason}"))
        if self._authed and reason != "client closed":
            log.log(
                logging.WARNING if pending else logging.INFO,
                "%s: %s (%d calls pending)",
                conn.label,
                reason,
                len(pending),
            )

    # -- public

    @property
    def closed(self) -> bool:
        return self._conn is None or self._conn.closed

    async def call(self, method: str, request: Any, response_type: type, *, timeout: float | None = None) -> Any:
        """Send `request` to `method` and return the reply decoded as `response_type`.

        Raises RpcError if the handler raised (or the method is unknown / the request failed its type on the server),
        TimeoutError after `timeout` seconds (a late reply is dropped), ConnectionError if the connection goes away.
        Memoryview fields of the reply are writable views into the received frame (no copy).
        """
        conn = self._conn
        if conn is None or not self._authed or conn.closed:
            reason = conn.close_reason if conn is not None else "not connected"
            raise ConnectionError(f"{self.address}: connection closed ({reason or 'closing'})")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        req_id = next(self._ids)
        fut = loop.create_future()
        self._pending[req_id] = fut
        try:
            if conn.write_paused():  # backpressure before encoding: concurrent big calls do not pile up in memory
                await (conn.drain() if deadline is None else asyncio.wait_for(conn.drain(), timeout))
            conn.send(REQUEST, req_id, method, request)
            if deadline is None:
                kind, payload = await fut
            else:
                kind, payload = await asyncio.wait_for(fut, max(deadline - loop.time(), 0.0))
        except TimeoutError:
            raise TimeoutError(f"rpc {method!r} to {self.address} timed out after {timeout}s") from None
        finally:
            self._pending.pop(req_id, None)
        if kind == ERROR:  # the remote exception comes back by type name (rpc_wire.type_name), never pickled
            try:
                info = msgspec.msgpack.decode(payload, type=ErrorInfo)
            except msgspec.DecodeError as e:
                info = ErrorInfo("RpcProtocolError", f"undecodable error reply: {e}", "")
            raise RpcError(info.type, info.message, info.traceback, method)
        decoder = self._decoders.get(response_type)
        if decoder is None:
            decoder = self._decoders[response_type] = msgspec.msgpack.Decoder(response_type)
        try:
            return decoder.decode(payload)
        except msgspec.DecodeError as e:
            expected = getattr(response_type, "__name__", response_type)
            raise msgspec.ValidationError(
                f"reply to {method!r} from {self.address} is not a valid {expected}: {e}"
            ) from None

    def drop_when_unreachable(self, seconds: float) -> bool:
        """Fail the pending calls (ConnectionError) once the server's host has answered nothing at the TCP level for
        `seconds` (net/rpc_connection.py): a call with no timeout to a server whose host was cut off then ends after
        that long, not after the default keepalive's two minutes (or, with a request still unacknowledged, the
        kernel's fifteen). False where it cannot be set."""
        conn = self._conn
        sock = None if conn is None or conn.transport is None else conn.transport.get_extra_info("socket")
        return (
            sock is not None
            and sock.family in (socket.AF_INET, socket.AF_INET6)
            and drop_when_unreachable(sock, seconds)
        )

    async def close(self) -> None:
        """Close the connection; calls still pending fail with ConnectionError."""
        conn = self._conn
        if conn is None:
            return
        conn.close("client closed")
        await conn.wait_closed(CLOSE_FLUSH_S)

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

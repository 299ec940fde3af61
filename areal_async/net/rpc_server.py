"""The RPC server: registered handlers served to authenticated clients. One `_Session` per connection runs the
server side of the handshake (net/rpc_wire.py) and hands requests to `RpcServer._dispatch`, which answers each call
with its handler's result or an ERROR naming the exception's type. Never imports torch.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import mmap
import os
import traceback
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import msgspec

from areal_async.net.rpc_connection import CLOSE_FLUSH_S, Connection
from areal_async.net.rpc_wire import (
    AUTH,
    AUTH_FAIL,
    AUTH_OK,
    CLIENT_LABEL,
    DEFAULT_MAX_FRAME_BYTES,
    ERROR,
    HANDSHAKE_MAX_FRAME,
    HANDSHAKE_TIMEOUT_S,
    HELLO,
    PROTOCOL_VERSION,
    REQUEST,
    RESPONSE,
    SERVER_LABEL,
    Auth,
    AuthFail,
    AuthOk,
    Envelope,
    ErrorInfo,
    Hello,
    ProtocolViolation,
    check_secret,
    decode_control,
    decode_envelope,
    handshake_mac,
    type_name,
)

__all__ = ["RpcServer"]

log = logging.getLogger("areal_async.net.rpc")  # one logger for the whole channel, whichever module logs

_MAX_INFLIGHT_PER_CONN = 256  # requests being handled on one connection before we stop reading from it


def _tcp_address(listener: asyncio.AbstractServer) -> str:
    host, port = listener.sockets[0].getsockname()[:2]
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class _Handler(NamedTuple):
    fn: Callable[[Any], Any]
    decoder: msgspec.msgpack.Decoder
    request_type: Any
    blocking: bool


class _Session:
    """Server side of one connection: handshake state, then requests."""

    def __init__(self, server: RpcServer) -> None:
        self.server = server
        self.conn: Connection | None = None
        self.authed = False
        self.inflight = 0
        self.nonce = os.urandom(32)
        self.peer = "?"
        self._timer: asyncio.TimerHandle | None = None

    def on_connect(self, conn: Connection) -> None:
        self.conn = conn
        self.peer = str(conn.transport.get_extra_info("peername") or "unix peer")
        conn.label = f"{self.server.name} <- {self.peer}"
        self.server._sessions.add(self)
        conn.send(HELLO, 0, "", Hello(PROTOCOL_VERSION, self.nonce, self.server.name, self.server.max_frame_bytes))
        self._timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, self._handshake_timeout)

    def _handshake_timeout(self) -> None:
        if not self.authed and self.conn is not None:
            self.conn.close(f"no authentication within {HANDSHAKE_TIMEOUT_S:g}s", error=True)

    def on_close(self, conn: Connection, reason: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.server._sessions.discard(self)
        log.debug("%s: connection closed: %s", conn.label, reason)

    def on_frame(self, conn: Connection, frame: bytearray | mmap.mmap) -> None:
        env, payload = decode_envelope(frame)
        if not self.authed:
            self._authenticate(conn, env, payload)
        elif env.kind == REQUEST:
            self.server._dispatch(self, env.id, env.method, payload)
        else:
            raise ProtocolViolation(f"unexpected frame kind {env.kind} from an authenticated client")

    def _authenticate(self, conn: Connection, env: Envelope, payload: memoryview) -> None:
        if env.kind != AUTH:
            raise ProtocolViolation(f"expected an AUTH frame, got kind {env.kind}")
        auth = decode_control(payload, Auth, "AUTH")
        expected = handshake_mac(self.server._secret, CLIENT_LABEL, self.nonce, auth.nonce)
        if len(auth.nonce) < 16 or not hmac.compare_digest(expected, auth.mac):
            reason = "authentication failed: wrong shared secret (HMAC mismatch)"
            conn.send(AUTH_FAIL, env.id, "", AuthFail(reason))
            conn.close(f"rejected the client: {reason}", error=True)
            return
        self.authed = True
        if self._timer is not None:
            self._timer.cancel()
        conn.max_frame_bytes = self.server.max_frame_bytes
        conn.peer_max_frame_bytes = auth.max_frame_bytes
        conn.send(AUTH_OK, env.id, "", AuthOk(handshake_mac(self.server._secret, SERVER_LABEL, self.nonce, auth.nonce)))
        log.debug("%s: client authenticated", conn.label)

    def reply(self, req_id: int, method: str, result: Any) -> None:
        conn = self.conn
        if conn is None or conn.closed:
            log.debug("%s: dropping the reply to %r (id %d): connection closed", self.server.name, method, req_id)
            return
        try:
            conn.send(RESPONSE, req_id, method, result)
        except Exception as e:  # unencodable or too big: tell the caller instead
            self.reply_error(req_id, method, e)

    def reply_error(
        self, req_id: int, method: str, exc: BaseException | None = None, *, remote_type: str = "", message: str = ""
    ) -> None:
        conn = self.conn
        if conn is None or conn.closed:
            return
        if exc is not None:
            remote_type = type_name(type(exc))
            message = str(exc)
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            log.warning("%s: %r raised %s: %s (sent to the caller)", self.server.name, method, remote_type, message)
        else:
            tb = ""
        try:
            conn.send(ERROR, req_id, method, ErrorInfo(remote_type, message, tb))
        except ValueError:  # an enormous message or traceback: send it cut down
            conn.send(ERROR, req_id, method, ErrorInfo(remote_type, message[:4096], tb[-16384:]))


class RpcServer:
    """Serves registered handlers to authenticated clients on any number of listeners (start_tcp, listen)."""

    def __init__(
        self,
        secret: bytes,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        name: str = "rpc",
        blocking_initializer: Callable[[], None] | None = None,
    ) -> None:
        """`blocking_initializer` runs once in the worker thread of blocking handlers before its first call (a
        trainer sets that thread's torch threads there: it is the one that computes)."""
        check_secret(secret)
        if max_frame_bytes < HANDSHAKE_MAX_FRAME:
            raise ValueError(f"max_frame_bytes must be at least {HANDSHAKE_MAX_FRAME}, got {max_frame_bytes}")
        self._secret = bytes(secret)
        self.max_frame_bytes = max_frame_bytes
        self.name = name
        self.addresses: list[str] = []
        self._handlers: dict[str, _Handler] = {}
        self._listeners: list[asyncio.AbstractServer] = []
        self._sessions: set[_Session] = set()
        self._tasks: set[asyncio.Task] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._blocking_initializer = blocking_initializer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._stop_requested = False
        self._inflight = 0
        self._closed = False

    def register(
        self, method: str, handler: Callable[[Any], Any], request_type: type, *, blocking: bool = False
    ) -> None:
        """Serve `method`: requests are decoded as `request_type`; `handler(request)` returns the response.

        blocking=True runs a sync handler in the server's single worker thread, in call order (torch work, collectives).
        """
        if not isinstance(method, str) or not method:
            raise ValueError(f"method must be a non-empty string, got {method!r}")
        if method in self._handlers:
            raise ValueError(f"method {method!r} is already registered")
        if not callable(handler):
            raise TypeError(f"handler for {method!r} is not callable")
        if blocking and inspect.iscoroutinefunction(handler):
            raise TypeError(f"handler for {method!r} is async; blocking=True is for sync handlers")
        decoder = msgspec.msgpack.Decoder(request_type)  # raises now for types msgspec cannot decode
        self._handlers[method] = _Handler(handler, decoder, request_type, blocking)
        if blocking and self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"{self.name}-blocking", initializer=self._blocking_initializer
            )

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError(f"{self.name}: server is closed")
        if self._loop is None:
            self._loop = loop
            self._stopped = asyncio.Event()
        elif self._loop is not loop:
            raise RuntimeError(f"{self.name}: server is bound to another event loop")
        return loop

    async def start_tcp(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on TCP; returns 'tcp://host:port' with the actual port (port=0 picks a free one)."""
        loop = self._bind_loop()
        return await self.listen(lambda protocol: loop.create_server(protocol, host, port), _tcp_address)

    async def listen(
        self,
        open_listener: Callable[[Callable[[], Connection]], Awaitable[asyncio.AbstractServer]],
        describe: Callable[[asyncio.AbstractServer], str],
    ) -> str:
        """Serve on one more listener, which `open_listener(protocol_factory)` opens on this server's loop;
        `describe(listener)` is its address (returned, and kept in `addresses`). close() closes it.

        start_tcp is the listener the package serves on; this is the seam for any other asyncio listener (the
        tests serve on a Unix socket with it), so the server does not grow one method per socket family."""
        self._bind_loop()
        listener = await open_listener(self._accept)
        self._listeners.append(listener)
        address = describe(listener)
        self.addresses.append(address)
        log.info("%s: listening on %s", self.name, address)
        return address

    def _accept(self) -> Connection:
        return Connection(_Session(self), HANDSHAKE_MAX_FRAME, self.name)

    async def serve_forever(self) -> None:
        """Serve until close() or request_stop(); then close (replies already queued are flushed first)."""
        self._bind_loop()
        assert self._stopped is not None
        if self._stop_requested and self._inflight == 0:
            self._stopped.set()
        await self._stopped.wait()
        await self.close()

    @property
    def num_clients(self) -> int:
        """Authenticated connections right now (a trainer uses it to notice that its controller is gone)."""
        return sum(1 for s in self._sessions if s.authed)

    def request_stop(self) -> None:
        """Ask serve_forever to return once the replies of the calls in flight (e.g. "shutdown") are sent.

        Safe to call from a handler on the loop, from a blocking handler's worker thread, or from another thread.
        """
        loop = self._loop
        if loop is None:
            self._stop_requested = True
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._request_stop_on_loop()
        else:
            loop.call_soon_threadsafe(self._request_stop_on_loop)

    def _request_stop_on_loop(self) -> None:
        self._stop_requested = True
        if self._inflight == 0 and self._stopped is not None:
            self._stopped.set()

    async def close(self) -> None:
        """Stop listening, flush and close every connection, cancel running async handlers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for listener in self._listeners:
            listener.close()
        sessions = [s for s in self._sessions if s.conn is not None]
        for s in sessions:
            s.conn.close("server closing")
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(s.conn.wait_closed(CLOSE_FLUSH_S) for s in sessions))
        for listener in self._listeners:
            await listener.wait_closed()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._stopped is not None:
            self._stopped.set()
        log.info("%s: closed", self.name)

    async def __aenter__(self) -> RpcServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- request handling

    # Each request carries an id; responses (RESPONSE or ERROR) go back in whatever order the handlers finish, many
    # in flight on one connection. A handler is sync (run on the loop), async (awaited), or blocking=True: run in one
    # worker thread per server, in arrival order, so torch work does not stall the loop and collectives issued by
    # successive calls stay ordered on every rank. Problems with one call (unknown method, a payload that fails its
    # type, a handler exception) answer an ERROR and keep the connection; problems with the stream itself (garbage,
    # a bad envelope, an oversized or truncated frame, a failed handshake) close that connection with a logged reason.
    def _dispatch(self, session: _Session, req_id: int, method: str, payload: memoryview) -> None:
        handler = self._handlers.get(method)
        if handler is None:
            session.reply_error(
                req_id,
                method,
                remote_type="UnknownMethodError",
                message=f"no method {method!r} on {self.name}; known: {sorted(self._handlers)}",
            )
            return
        try:
            request = handler.decoder.decode(payload)
        except msgspec.DecodeError as e:
            log.warning("%s: bad request payload for %r from %s: %s", self.name, method, session.peer, e)
            session.reply_error(
                req_id,
                method,
                remote_type=type_name(type(e)),
                message=f"request is not a valid {getattr(handler.request_type, '__name__', '?')}: {e}",
            )
            return
        self._begin(session)
        if handler.blocking:
            assert self._executor is not None and self._loop is not None
            # Submitted now, synchronously, so the worker thread sees calls in arrival order.
            fut = self._loop.run_in_executor(self._executor, handler.fn, request)
            self._spawn(self._finish(session, req_id, method, fut))
            return
        try:
            result = handler.fn(request)
        except Exception as e:
            session.reply_error(req_id, method, e)
            self._end(session)
            return
        if inspect.isawaitable(result):
            self._spawn(self._finish(session, req_id, method, result))
        else:
            session.reply(req_id, method, result)
            self._end(session)

    async def _finish(self, session: _Session, req_id: int, method: str, awaitable: Any) -> None:
        try:
            result = await awaitable
        except asyncio.CancelledError:
            session.reply_error(req_id, method, remote_type="CancelledError", message=f"{self.name} is closing")
            raise
        except Exception as e:
            session.reply_error(req_id, method, e)
        else:
            session.reply(req_id, method, result)
        finally:
            self._end(session)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _begin(self, session: _Session) -> None:
        self._inflight += 1
        session.inflight += 1
        if session.inflight >= _MAX_INFLIGHT_PER_CONN and session.conn is not None:
            session.conn.pause_reading(True)

    def _end(self, session: _Session) -> None:
        self._inflight -= 1
        session.inflight -= 1
        if session.inflight < _MAX_INFLIGHT_PER_CONN and session.conn is not None:
            session.conn.pause_reading(False)
        if self._stop_requested and self._inflight == 0 and self._stopped is not None:
            self._stopped.set()  # the reply that asked for the stop is already queued on its transport

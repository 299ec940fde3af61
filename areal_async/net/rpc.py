"""Typed RPC between the controller and the trainer processes: msgpack frames over TCP or Unix sockets.

Why our own: the controller is one asyncio event loop without torch, the trainers are torchrun processes, and what
travels between them is mostly big flat arrays (a packed `TrainBatch` is tens of MB per step). msgspec encodes a
Struct with `memoryview` fields as raw msgpack binaries and decodes them back as views into the received buffer, so a
batch crosses with one copy on the sender (into the frame) and none on the receiver beyond the kernel's. No pickle
ever touches received bytes, and no ZeroMQ.

Wire format. Every frame is an 8-byte big-endian length followed by one msgpack array
`[id, kind, method, payload]` (`_Envelope`); the payload is the last element, so the receiver decodes the envelope
with `payload: msgspec.Raw` and then the payload lazily with the type the method registered. Frames are received
straight into one writable buffer per frame (a BufferedProtocol: no stream-buffer copies), which also makes the
decoded `memoryview` fields writable: `torch.frombuffer(view)` works without a copy or a warning. Those views keep
the whole frame alive; copy out whatever small part must outlive a big message.

Handshake, before any request (the secret never travels):

    server -> HELLO(protocol, server_nonce, name, server_max_frame)
    client -> AUTH(client_nonce, HMAC(secret, "client" | server_nonce | client_nonce), client_max_frame)
    server -> AUTH_OK(HMAC(secret, "server" | server_nonce | client_nonce))      or AUTH_FAIL(reason) and close

Until AUTH is accepted the server reads frames of at most 4 KiB into an 8 KiB buffer and drops the connection
after HANDSHAKE_TIMEOUT_S, so a stranger costs next to nothing.

Calls. Each request carries an id; responses (RESPONSE or ERROR) come back in whatever order the handlers finish,
many in flight on one connection. A handler is sync (run on the loop), async (awaited), or `blocking=True`: run in
one dedicated worker thread per server, in arrival order, so torch work does not stall the loop and collectives
issued by successive calls stay ordered on every rank. Problems with one call (unknown method, a payload that fails
its type, a handler exception) answer an ERROR and keep the connection; problems with the stream itself (garbage,
a bad envelope, an oversized or truncated frame, a failed handshake) close that connection with a logged reason.

Leaf module: imports nothing of the package and never torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import itertools
import logging
import mmap
import os
import socket
import stat
import struct
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import msgspec

__all__ = ["RpcAuthError", "RpcClient", "RpcError", "RpcServer", "RpcSyncClient"]

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 4 << 30
HANDSHAKE_TIMEOUT_S = 10.0  # a peer that has not authenticated by then is dropped
_HANDSHAKE_MAX_FRAME = 4096  # frame size limit before authentication
_SCRATCH_BYTES = 256 << 10  # frames up to this size are parsed out of one reusable receive buffer
_HANDSHAKE_SCRATCH_BYTES = 2 * _HANDSHAKE_MAX_FRAME  # until authenticated: a stranger's connection costs little
_HEAP_FRAME_BYTES = 32 << 20  # bigger frames are received into an anonymous mmap (see _parse_scratch)
_MAX_INFLIGHT_PER_CONN = 256  # requests being handled on one connection before we stop reading from it
_CLOSE_FLUSH_S = 2.0  # how long close() lets queued replies drain before aborting a connection

_HEADER = struct.Struct(">Q")
# Frame kinds.
_HELLO, _AUTH, _AUTH_OK, _AUTH_FAIL, _REQUEST, _RESPONSE, _ERROR = range(7)
_CLIENT_LABEL = b"areal_async.net.rpc/1 client"
_SERVER_LABEL = b"areal_async.net.rpc/1 server"


class RpcError(Exception):
    """The remote handler raised; carries the remote exception's type name, message and formatted traceback."""

    def __init__(self, remote_type: str, remote_message: str, remote_traceback: str = "", method: str = "") -> None:
        super().__init__(remote_type, remote_message, remote_traceback, method)  # args kept whole: picklable
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.method = method

    def __str__(self) -> str:
        text = f"rpc {self.method!r} failed remotely with {self.remote_type}: {self.remote_message}"
        if self.remote_traceback:
            text += "\n\nRemote traceback:\n" + self.remote_traceback.rstrip()
        return text


class RpcAuthError(ConnectionError):
    """The handshake failed: the peer does not know the shared secret (or we do not)."""


# ---- wire structs -------------------------------------------------------------------------------------------------


class _Envelope(msgspec.Struct, array_like=True):
    id: int
    kind: int
    method: str
    payload: msgspec.Raw  # must stay last: the payload's bytes are appended after the encoded prefix


class _Hello(msgspec.Struct, array_like=True):
    protocol: int
    nonce: bytes
    name: str
    max_frame_bytes: int


class _Auth(msgspec.Struct, array_like=True):
    nonce: bytes
    mac: bytes
    max_frame_bytes: int


class _AuthOk(msgspec.Struct, array_like=True):
    mac: bytes


class _AuthFail(msgspec.Struct, array_like=True):
    reason: str


class _ErrorInfo(msgspec.Struct, array_like=True):
    type: str
    message: str
    traceback: str


_EMPTY_RAW = msgspec.Raw(b"")
_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope)


class _ProtocolViolation(Exception):
    """The byte stream itself is wrong: the connection is closed with this reason."""


def _mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if not secret:
        raise ValueError("secret must not be empty")


def _tune_tcp(sock: socket.socket) -> None:
    """TCP_NODELAY: a small call must not wait for Nagle. Keepalive: a call with no timeout to a trainer whose machine
    died (no FIN, no RST) fails within about two minutes instead of hanging forever."""
    options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1), (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 6)):
        if hasattr(socket, name):  # Linux; macOS has only some of them
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in options:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:
            pass


def _decode_control(payload: memoryview, type_: type, what: str) -> Any:
    try:
        return msgspec.msgpack.decode(payload, type=type_)
    except msgspec.DecodeError as e:
        raise _ProtocolViolation(f"malformed {what} frame: {e}") from None


def _type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _decode_envelope(frame: bytearray | mmap.mmap) -> tuple[_Envelope, memoryview]:
    """Decode the envelope and return it with a view of its payload inside `frame` (writable, no copy)."""
    try:
        env = _ENVELOPE_DECODER.decode(frame)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise _ProtocolViolation(f"malformed frame ({len(frame)} bytes): {e}") from None
    # The payload is the envelope's last element, so it ends where the frame ends. Decoding from a view of the
    # frame (rather than from the Raw) makes memoryview fields of the payload writable views of the frame.
    return env, memoryview(frame)[len(frame) - len(memoryview(env.payload)):]


def _parse_address(address: str) -> tuple[str, str, int]:
    """'tcp://host:port' -> ('tcp', host, port); 'unix:///abs/path' -> ('unix', path, 0)."""
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://"):].rpartition(":")
        if sep and host and port.isdigit():
            return "tcp", host.strip("[]"), int(port)
    elif address.startswith("unix://") and len(address) > len("unix://"):
        return "unix", address[len("unix://"):], 0
    raise ValueError(f"rpc address must look like tcp://host:port or unix:///path, got {address!r}")


# ---- one connection: framing, flow control --------------------------------------------------------------------------


class _Connection(asyncio.BufferedProtocol):
    """Frames in and out of one socket; the owner (server session or client) interprets them.

    Small frames are cut out of a reusable scratch buffer; a frame that does not fit gets its own buffer and the
    kernel writes the rest of it straight there (recv_into), so a 200 MB batch is never copied on receipt.
    """

    def __init__(self, owner: "_Session | RpcClient", max_frame_bytes: int, label: str) -> None:
        self.owner = owner
        self.max_frame_bytes = max_frame_bytes  # what we accept; raised after the handshake
        self.peer_max_frame_bytes = _HANDSHAKE_MAX_FRAME  # what the peer accepts; learnt in the handshake
        self.label = label
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.close_reason = ""
        self._closing = False
        self._scratch = bytearray(_HANDSHAKE_SCRATCH_BYTES)  # grown once the peer is authenticated
        self._start = 0  # unparsed bytes are scratch[start:end]
        self._end = 0
        self._big: bytearray | mmap.mmap | None = None  # a big frame being received directly, without its header
        self._big_filled = 0
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._lost_waiter: asyncio.Future | None = None
        self._reading_paused = False

    # -- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            _tune_tcp(sock)
        self.owner._connection_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._big_filled:]
        return memoryview(self._scratch)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._big is not None:
                self._big_filled += nbytes
                if self._big_filled == len(self._big):
                    frame, self._big = self._big, None
                    self.owner._frame_received(self, frame)
                return
            self._end += nbytes
            self._parse_scratch()
        except _ProtocolViolation as e:
            self.close(str(e), error=True)
        except Exception as e:  # a bug on our side must cost one connection, never the process
            log.exception("%s: error handling a frame", self.label)
            self.close(f"internal error: {e!r}", error=True)

    def _parse_scratch(self) -> None:
        buf = self._scratch
        while not self._closing and self._end - self._start >= _HEADER.size:
            (n,) = _HEADER.unpack_from(buf, self._start)
            if n > self.max_frame_bytes:
                raise _ProtocolViolation(f"frame of {n} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
            body = self._start + _HEADER.size
            if self._end - body >= n:
                self._start = body + n
                self.owner._frame_received(self, buf[body:self._start])
                continue
            if _HEADER.size + n > len(buf):  # will not fit: receive the rest directly into the frame's own buffer
                # Up to malloc's mmap threshold a bytearray reuses warm heap pages; above it both would map fresh
                # pages, and an anonymous mmap skips bytearray's memset, so the frame is touched once, by recv_into.
                big = bytearray(n) if n <= _HEAP_FRAME_BYTES else mmap.mmap(-1, n)
                big[: self._end - body] = buf[body:self._end]
                self._big, self._big_filled = big, self._end - body
                self._start = self._end = 0
                return
            break
        if self.max_frame_bytes > _HANDSHAKE_MAX_FRAME and len(buf) < _SCRATCH_BYTES:  # just authenticated
            self._scratch = bytearray(_SCRATCH_BYTES)
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > 0 or self._scratch is not buf:  # keep the partial frame at the front, so the next fits
            rest = self._end - self._start
            self._scratch[:rest] = buf[self._start:self._end]
            self._start, self._end = 0, rest

    def eof_received(self) -> bool:
        pending = self._end - self._start
        if self._big is not None:
            what = f"{self._big_filled} of {len(self._big)} body bytes"
        elif pending >= _HEADER.size:
            what = f"{pending - _HEADER.size} of {_HEADER.unpack_from(self._scratch, self._start)[0]} body bytes"
        else:
            what = f"{pending} of {_HEADER.size} header bytes"
        if self._big is not None or pending:
            self.close_reason = self.close_reason or f"peer closed mid-frame (truncated frame: {what})"
            log.warning("%s: %s", self.label, self.close_reason)
        return False  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._big = None
        if not self.close_reason:
            self.close_reason = f"connection lost: {exc!r}" if exc else "peer closed the connection"
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()
        if self._lost_waiter is not None and not self._lost_waiter.done():
            self._lost_waiter.set_result(None)
        self.owner._connection_lost(self, self.close_reason)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()

    # -- used by the owner

    def send(self, kind: int, req_id: int, method: str, payload: Any) -> None:
        """Encode and queue one frame (header, envelope prefix, payload) with a single write."""
        if self.lost or self._closing or self.transport is None:
            raise ConnectionError(f"{self.label}: connection closed ({self.close_reason or 'closing'})")
        buf = bytearray(_HEADER.size)
        _ENCODER.encode_into(_Envelope(req_id, kind, method, _EMPTY_RAW), buf, _HEADER.size)
        _ENCODER.encode_into(payload, buf, -1)  # appended after the prefix: the envelope's last element
        n = len(buf) - _HEADER.size
        if n > self.peer_max_frame_bytes:
            raise ValueError(f"{self.label}: a {n}-byte frame for {method!r} exceeds the peer's "
                             f"max_frame_bytes={self.peer_max_frame_bytes}")
        _HEADER.pack_into(buf, 0, n)
        # uvloop keeps a reference to the view until it is sent (no copy); the stdlib loop copies what the socket
        # does not take at once. Either way `buf` is never touched again.
        self.transport.write(memoryview(buf))

    def write_paused(self) -> bool:
        return self._write_paused

    async def drain(self) -> None:
        """Wait while the transport's write buffer is above its high-water mark (backpressure)."""
        while self._write_paused and not self.lost:
            w = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(w)
            await w
        if self.lost:
            raise ConnectionError(f"{self.label}: connection lost ({self.close_reason})")

    def pause_reading(self, paused: bool) -> None:
        if self.transport is None or self.lost or paused == self._reading_paused:
            return
        self._reading_paused = paused
        if paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def close(self, reason: str, *, error: bool = False) -> None:
        """Stop reading and close after queued writes are flushed; `error` logs the reason as a warning."""
        if self._closing or self.lost:
            return
        self._closing = True
        self.close_reason = reason
        if error:
            log.warning("%s: closing connection: %s", self.label, reason)
        else:
            log.debug("%s: closing connection: %s", self.label, reason)
        if self.transport is not None:
            self.transport.close()

    async def wait_closed(self, timeout: float) -> None:
        """After close(): wait for queued writes to flush and the socket to close; abort if it takes too long."""
        if self.lost or self.transport is None:
            return
        self._lost_waiter = self._lost_waiter or asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._lost_waiter), timeout)
        except asyncio.TimeoutError:
            self.transport.abort()


# ---- server -------------------------------------------------------------------------------------------------------


class _Handler(NamedTuple):
    fn: Callable[[Any], Any]
    decoder: msgspec.msgpack.Decoder
    request_type: Any
    blocking: bool


class _Session:
    """Server side of one connection: handshake state, then requests."""

    def __init__(self, server: "RpcServer") -> None:
        self.server = server
        self.conn: _Connection | None = None
        self.authed = False
        self.inflight = 0
        self.nonce = os.urandom(32)
        self.peer = "?"
        self._timer: asyncio.TimerHandle | None = None

    def _connection_made(self, conn: _Connection) -> None:
        self.conn = conn
        self.peer = str(conn.transport.get_extra_info("peername") or "unix peer")
        conn.label = f"{self.server.name} <- {self.peer}"
        self.server._sessions.add(self)
        conn.send(_HELLO, 0, "", _Hello(PROTOCOL_VERSION, self.nonce, self.server.name, self.server.max_frame_bytes))
        self._timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S, self._handshake_timeout)

    def _handshake_timeout(self) -> None:
        if not self.authed and self.conn is not None:
            self.conn.close(f"no authentication within {HANDSHAKE_TIMEOUT_S:g}s", error=True)

    def _connection_lost(self, conn: _Connection, reason: str) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.server._sessions.discard(self)
        log.debug("%s: connection closed: %s", conn.label, reason)

    def _frame_received(self, conn: _Connection, frame: bytearray | mmap.mmap) -> None:
        env, payload = _decode_envelope(frame)
        if not self.authed:
            self._authenticate(conn, env, payload)
        elif env.kind == _REQUEST:
            self.server._dispatch(self, env.id, env.method, payload)
        else:
            raise _ProtocolViolation(f"unexpected frame kind {env.kind} from an authenticated client")

    def _authenticate(self, conn: _Connection, env: _Envelope, payload: memoryview) -> None:
        if env.kind != _AUTH:
            raise _ProtocolViolation(f"expected an AUTH frame, got kind {env.kind}")
        auth = _decode_control(payload, _Auth, "AUTH")
        expected = _mac(self.server._secret, _CLIENT_LABEL, self.nonce, auth.nonce)
        if len(auth.nonce) < 16 or not hmac.compare_digest(expected, auth.mac):
            reason = "authentication failed: wrong shared secret (HMAC mismatch)"
            conn.send(_AUTH_FAIL, env.id, "", _AuthFail(reason))
            conn.close(f"rejected the client: {reason}", error=True)
            return
        self.authed = True
        if self._timer is not None:
            self._timer.cancel()
        conn.max_frame_bytes = self.server.max_frame_bytes
        conn.peer_max_frame_bytes = auth.max_frame_bytes
        conn.send(_AUTH_OK, env.id, "", _AuthOk(_mac(self.server._secret, _SERVER_LABEL, self.nonce, auth.nonce)))
        log.debug("%s: client authenticated", conn.label)

    def reply(self, req_id: int, method: str, result: Any) -> None:
        conn = self.conn
        if conn is None or conn.lost or conn._closing:
            log.debug("%s: dropping the reply to %r (id %d): connection closed", self.server.name, method, req_id)
            return
        try:
            conn.send(_RESPONSE, req_id, method, result)
        except Exception as e:  # unencodable or too big: tell the caller instead
            self.reply_error(req_id, method, e)

    def reply_error(self, req_id: int, method: str, exc: BaseException | None = None, *,
                    remote_type: str = "", message: str = "") -> None:
        conn = self.conn
        if conn is None or conn.lost or conn._closing:
            return
        if exc is not None:
            remote_type = _type_name(type(exc))
            message = str(exc)
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            log.warning("%s: %r raised %s: %s (sent to the caller)", self.server.name, method, remote_type, message)
        else:
            tb = ""
        try:
            conn.send(_ERROR, req_id, method, _ErrorInfo(remote_type, message, tb))
        except ValueError:  # an enormous message or traceback: send it cut down
            conn.send(_ERROR, req_id, method, _ErrorInfo(remote_type, message[:4096], tb[-16384:]))


class RpcServer:
    """Serves registered handlers to authenticated clients on any number of TCP and Unix listeners."""

    def __init__(self, secret: bytes, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, name: str = "rpc",
                 blocking_initializer: Callable[[], None] | None = None) -> None:
        """`blocking_initializer` runs once in the worker thread of blocking handlers before its first call (a
        trainer sets that thread's torch threads there: it is the one that computes)."""
        _check_secret(secret)
        if max_frame_bytes < _HANDSHAKE_MAX_FRAME:
            raise ValueError(f"max_frame_bytes must be at least {_HANDSHAKE_MAX_FRAME}, got {max_frame_bytes}")
        self._secret = bytes(secret)
        self.max_frame_bytes = max_frame_bytes
        self.name = name
        self.addresses: list[str] = []
        self._handlers: dict[str, _Handler] = {}
        self._listeners: list[asyncio.AbstractServer] = []
        self._unix_paths: list[str] = []
        self._sessions: set[_Session] = set()
        self._tasks: set[asyncio.Task] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._blocking_initializer = blocking_initializer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._stop_requested = False
        self._inflight = 0
        self._closed = False

    def register(self, method: str, handler: Callable[[Any], Any], request_type: type, *,
                 blocking: bool = False) -> None:
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
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-blocking",
                                                initializer=self._blocking_initializer)

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
        listener = await loop.create_server(lambda: _Connection(_Session(self), _HANDSHAKE_MAX_FRAME, self.name),
                                            host, port)
        self._listeners.append(listener)
        bound_host, bound_port = listener.sockets[0].getsockname()[:2]
        address = f"tcp://[{bound_host}]:{bound_port}" if ":" in bound_host else f"tcp://{bound_host}:{bound_port}"
        self.addresses.append(address)
        log.info("%s: listening on %s", self.name, address)
        return address

    async def start_unix(self, path: str) -> str:
        """Listen on a Unix socket at `path` (a stale socket file there is replaced); returns 'unix:///abs/path'."""
        loop = self._bind_loop()
        path = os.path.abspath(path)
        listener = await loop.create_unix_server(lambda: _Connection(_Session(self), _HANDSHAKE_MAX_FRAME, self.name),
                                                 path)
        self._listeners.append(listener)
        self._unix_paths.append(path)
        address = f"unix://{path}"
        self.addresses.append(address)
        log.info("%s: listening on %s", self.name, address)
        return address

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
        await asyncio.gather(*(s.conn.wait_closed(_CLOSE_FLUSH_S) for s in sessions))
        for listener in self._listeners:
            await listener.wait_closed()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        for path in self._unix_paths:
            try:
                if stat.S_ISSOCK(os.stat(path).st_mode):
                    os.unlink(path)
            except OSError:
                pass
        if self._stopped is not None:
            self._stopped.set()
        log.info("%s: closed", self.name)

    async def __aenter__(self) -> "RpcServer":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- request handling

    def _dispatch(self, session: _Session, req_id: int, method: str, payload: memoryview) -> None:
        handler = self._handlers.get(method)
        if handler is None:
            session.reply_error(req_id, method, remote_type="UnknownMethodError",
                                message=f"no method {method!r} on {self.name}; known: {sorted(self._handlers)}")
            return
        try:
            request = handler.decoder.decode(payload)
        except msgspec.DecodeError as e:
            log.warning("%s: bad request payload for %r from %s: %s", self.name, method, session.peer, e)
            session.reply_error(req_id, method, remote_type=_type_name(type(e)),
                                message=f"request is not a valid {getattr(handler.request_type, '__name__', '?')}: {e}")
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


# ---- client -------------------------------------------------------------------------------------------------------


class RpcClient:
    """One authenticated connection; any number of concurrent calls. Create with `await RpcClient.connect(...)`.

    Use it from the event loop it was connected on (RpcSyncClient wraps one for scripts).
    """

    def __init__(self, address: str, secret: bytes, max_frame_bytes: int) -> None:
        self.address = address
        self._secret = bytes(secret)
        self._max_frame_bytes = max_frame_bytes
        self._conn: _Connection | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._decoders: dict[Any, msgspec.msgpack.Decoder] = {}
        self._handshake: asyncio.Future | None = None
        self._nonce = os.urandom(32)
        self._server_nonce = b""
        self._authed = False
        self.server_name = ""

    @classmethod
    async def connect(cls, address: str, secret: bytes, *, timeout: float = 30.0,
                      max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> "RpcClient":
        """Connect and authenticate, retrying refused connections until `timeout` (the server may be starting).

        Raises RpcAuthError if either side fails to prove it knows the secret, ConnectionError on timeout.
        """
        _check_secret(secret)
        kind, target, port = _parse_address(address)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.01
        while True:
            client = cls(address, secret, max_frame_bytes)
            client._handshake = loop.create_future()
            conn = _Connection(client, _HANDSHAKE_MAX_FRAME, f"rpc client -> {address}")
            try:
                if kind == "tcp":
                    coro = loop.create_connection(lambda: conn, target, port)
                else:
                    coro = loop.create_unix_connection(lambda: conn, target)
                await asyncio.wait_for(coro, max(deadline - loop.time(), 0.001))
                break
            except (ConnectionError, FileNotFoundError, asyncio.TimeoutError) as e:
                if loop.time() + delay >= deadline:
                    raise ConnectionError(f"could not connect to {address} within {timeout}s: {e!r}") from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.25)
        try:
            await asyncio.wait_for(client._handshake, max(deadline - loop.time(), 1.0))
        except asyncio.TimeoutError:
            conn.close("handshake timed out")
            raise ConnectionError(f"{address}: no handshake from the server within {timeout}s") from None
        except BaseException:
            conn.close("handshake failed")
            raise
        return client

    # -- _Connection callbacks

    def _connection_made(self, conn: _Connection) -> None:
        self._conn = conn

    def _frame_received(self, conn: _Connection, frame: bytearray | mmap.mmap) -> None:
        env, payload = _decode_envelope(frame)
        if env.kind in (_RESPONSE, _ERROR) and self._authed:
            fut = self._pending.pop(env.id, None)
            if fut is None or fut.done():
                log.debug("%s: dropping a late reply to %r (id %d)", conn.label, env.method, env.id)
            else:
                fut.set_result((env.kind, payload))
        elif env.kind == _HELLO and not self._server_nonce:
            self._on_hello(conn, payload)
        elif env.kind == _AUTH_OK and self._server_nonce and not self._authed:
            ok = _decode_control(payload, _AuthOk, "AUTH_OK")
            if not hmac.compare_digest(ok.mac, _mac(self._secret, _SERVER_LABEL, self._server_nonce, self._nonce)):
                self._fail_handshake(RpcAuthError(f"{self.address}: the server could not prove it knows the secret"))
                conn.close("server failed authentication", error=True)
                return
            self._authed = True
            conn.max_frame_bytes = self._max_frame_bytes
            if self._handshake is not None and not self._handshake.done():
                self._handshake.set_result(None)
        elif env.kind == _AUTH_FAIL and not self._authed:
            reason = _decode_control(payload, _AuthFail, "AUTH_FAIL").reason
            self._fail_handshake(RpcAuthError(f"{self.address} refused the connection: {reason}"))
        else:
            raise _ProtocolViolation(f"unexpected frame kind {env.kind} from the server")

    def _on_hello(self, conn: _Connection, payload: memoryview) -> None:
        hello = _decode_control(payload, _Hello, "HELLO")
        if hello.protocol != PROTOCOL_VERSION:
            self._fail_handshake(ConnectionError(
                f"{self.address} speaks rpc protocol {hello.protocol}, this client speaks {PROTOCOL_VERSION}"))
            conn.close("protocol version mismatch", error=True)
            return
        self._server_nonce = hello.nonce
        self.server_name = hello.name
        conn.label = f"rpc client -> {hello.name} at {self.address}"
        conn.peer_max_frame_bytes = hello.max_frame_bytes
        mac = _mac(self._secret, _CLIENT_LABEL, hello.nonce, self._nonce)
        conn.send(_AUTH, 0, "", _Auth(self._nonce, mac, self._max_frame_bytes))

    def _fail_handshake(self, exc: BaseException) -> None:
        if self._handshake is not None and not self._handshake.done():
            self._handshake.set_exception(exc)

    def _connection_lost(self, conn: _Connection, reason: str) -> None:
        self._fail_handshake(ConnectionError(f"{self.address}: connection closed during the handshake: {reason}"))
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(f"{self.address}: {reason}"))
        if self._authed and reason != "client closed":
            log.log(logging.WARNING if pending else logging.INFO, "%s: %s (%d calls pending)", conn.label, reason,
                    len(pending))

    # -- public

    @property
    def closed(self) -> bool:
        return self._conn is None or self._conn.lost or self._conn._closing

    async def call(self, method: str, request: Any, response_type: type, *, timeout: float | None = None) -> Any:
        """Send `request` to `method` and return the reply decoded as `response_type`.

        Raises RpcError if the handler raised (or the method is unknown / the request failed its type on the server),
        TimeoutError after `timeout` seconds (a late reply is dropped), ConnectionError if the connection goes away.
        Memoryview fields of the reply are writable views into the received frame (no copy).
        """
        conn = self._conn
        if conn is None or not self._authed or conn.lost or conn._closing:
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
            conn.send(_REQUEST, req_id, method, request)
            if deadline is None:
                kind, payload = await fut
            else:
                kind, payload = await asyncio.wait_for(fut, max(deadline - loop.time(), 0.0))
        except asyncio.TimeoutError:
            raise TimeoutError(f"rpc {method!r} to {self.address} timed out after {timeout}s") from None
        finally:
            self._pending.pop(req_id, None)
        if kind == _ERROR:
            try:
                info = msgspec.msgpack.decode(payload, type=_ErrorInfo)
            except msgspec.DecodeError as e:
                info = _ErrorInfo("RpcProtocolError", f"undecodable error reply: {e}", "")
            raise RpcError(info.type, info.message, info.traceback, method)
        decoder = self._decoders.get(response_type)
        if decoder is None:
            decoder = self._decoders[response_type] = msgspec.msgpack.Decoder(response_type)
        try:
            return decoder.decode(payload)
        except msgspec.DecodeError as e:
            expected = getattr(response_type, "__name__", response_type)
            raise msgspec.ValidationError(
                f"reply to {method!r} from {self.address} is not a valid {expected}: {e}") from None

    async def close(self) -> None:
        """Close the connection; calls still pending fail with ConnectionError."""
        conn = self._conn
        if conn is None:
            return
        conn.close("client closed")
        await conn.wait_closed(_CLOSE_FLUSH_S)

    async def __aenter__(self) -> "RpcClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class RpcSyncClient:
    """Blocking wrapper for scripts and tests: its own event loop, one call at a time. Not for use inside a loop."""

    def __init__(self, address: str, secret: bytes, *, timeout: float = 30.0,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._client = self._loop.run_until_complete(
                RpcClient.connect(address, secret, timeout=timeout, max_frame_bytes=max_frame_bytes))
        except BaseException:
            self._loop.close()
            raise
        self._thread = threading.get_ident()

    def call(self, method: str, request: Any, response_type: type, *, timeout: float | None = None) -> Any:
        if threading.get_ident() != self._thread:
            raise RuntimeError("RpcSyncClient must be used from the thread that created it")
        return self._loop.run_until_complete(self._client.call(method, request, response_type, timeout=timeout))

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._client.close())
            self._loop.close()

    def __enter__(self) -> "RpcSyncClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

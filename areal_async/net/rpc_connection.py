"""One RPC connection: an asyncio BufferedProtocol that cuts the byte stream into frames and hands them to its owner
(a server session or a client), and sends frames with backpressure. It knows the frame header and envelope
(net/rpc_wire.py), not what the frames mean.

Frames are received straight into one writable buffer per frame (no stream-buffer copies), which also makes the
decoded `memoryview` fields writable: `torch.frombuffer(view)` works without a copy or a warning. Those views keep the
whole frame alive; copy out whatever small part must outlive a big message. Never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import socket
from typing import Any, Protocol

import msgspec

from areal_async.net.rpc_wire import HANDSHAKE_MAX_FRAME, HEADER, Envelope, ProtocolViolation

__all__ = ["CLOSE_FLUSH_S", "Connection", "ConnectionOwner", "drop_when_unreachable"]

log = logging.getLogger("areal_async.net.rpc")  # one logger for the whole channel, whichever module logs

_SCRATCH_BYTES = 256 << 10  # frames up to this size are parsed out of one reusable receive buffer
_HANDSHAKE_SCRATCH_BYTES = 2 * HANDSHAKE_MAX_FRAME  # until authenticated: a stranger's connection costs little
_HEAP_FRAME_BYTES = 32 << 20  # bigger frames are received into an anonymous mmap (see _parse_scratch)
CLOSE_FLUSH_S = 2.0  # how long an owner's close() lets queued replies drain before aborting a connection

_EMPTY_RAW = msgspec.Raw(b"")
_ENCODER = msgspec.msgpack.Encoder()


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


def drop_when_unreachable(sock: Any, seconds: float) -> bool:
    """Make the kernel drop this TCP connection once the peer's host has acknowledged nothing for `seconds`: data
    sent and not acknowledged (TCP_USER_TIMEOUT), or, on an idle connection, keepalive probes unanswered (probing
    starts after a quarter of it). A peer that is alive but busy or stopped (SIGSTOP) still has its kernel answer, so
    only a host that went away trips it: its link cut, its power lost. A cut of less than about half of `seconds`
    rides through (retransmissions back off, so the link's return is noticed up to the cut's length again later).
    The pending calls then fail with ConnectionError, as for a closed connection. Linux; returns False where the
    options do not exist (the default keepalive stays)."""
    if not all(hasattr(socket, n) for n in ("TCP_USER_TIMEOUT", "TCP_KEEPIDLE", "TCP_KEEPINTVL")):
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, max(1, int(seconds / 4)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, max(1, int(seconds / 8)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(seconds * 1000)))
    except OSError:
        return False
    return True


class ConnectionOwner(Protocol):
    """What interprets a connection's frames: the server's session for one client, or the client itself."""

    def on_connect(self, conn: Connection) -> None: ...

    def on_frame(self, conn: Connection, frame: bytearray | mmap.mmap) -> None: ...

    def on_close(self, conn: Connection, reason: str) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """Frames in and out of one socket; the owner (server session or client) interprets them.

    Small frames are cut out of a reusable scratch buffer; a frame that does not fit gets its own buffer and the
    kernel writes the rest of it straight there (recv_into), so a 200 MB batch is never copied on receipt.
    """

    def __init__(self, owner: ConnectionOwner, max_frame_bytes: int, label: str) -> None:
        self.owner = owner
        self.max_frame_bytes = max_frame_bytes  # what we accept; raised after the handshake
        self.peer_max_frame_bytes = HANDSHAKE_MAX_FRAME  # what the peer accepts; learnt in the handshake
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
        self.owner.on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._big_filled :]
        return memoryview(self._scratch)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._big is not None:
                self._big_filled += nbytes
                if self._big_filled == len(self._big):
                    frame, self._big = self._big, None
                    self.owner.on_frame(self, frame)
                return
            self._end += nbytes
            self._parse_scratch()
        except ProtocolViolation as e:
            self.close(str(e), error=True)
        except Exception as e:  # a bug on our side must cost one connection, never the process
            log.exception("%s: error handling a frame", self.label)
            self.close(f"internal error: {e!r}", error=True)

    def _parse_scratch(self) -> None:
        buf = self._scratch
        while not self._closing and self._end - self._start >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, self._start)
            if n > self.max_frame_bytes:
                raise ProtocolViolation(f"frame of {n} bytes exceeds max_frame_bytes={self.max_frame_bytes}")
            body = self._start + HEADER.size
            if self._end - body >= n:
                self._start = body + n
                self.owner.on_frame(self, buf[body : self._start])
                continue
            if HEADER.size + n > len(buf):  # will not fit: receive the rest directly into the frame's own buffer
                # Up to malloc's mmap threshold a bytearray reuses warm heap pages; above it both would map fresh
                # pages, and an anonymous mmap skips bytearray's memset, so the frame is touched once, by recv_into.
                big = bytearray(n) if n <= _HEAP_FRAME_BYTES else mmap.mmap(-1, n)
                big[: self._end - body] = buf[body : self._end]
                self._big, self._big_filled = big, self._end - body
                self._start = self._end = 0
                return
            break
        if self.max_frame_bytes > HANDSHAKE_MAX_FRAME and len(buf) < _SCRATCH_BYTES:  # just authenticated
            self._scratch = bytearray(_SCRATCH_BYTES)
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start > 0 or self._scratch is not buf:  # keep the partial frame at the front, so the next fits
            rest = self._end - self._start
            self._scratch[:rest] = buf[self._start : self._end]
            self._start, self._end = 0, rest

    def eof_received(self) -> bool:
        pending = self._end - self._start
        if self._big is not None:
            what = f"{self._big_filled} of {len(self._big)} body bytes"
        elif pending >= HEADER.size:
            what = f"{pending - HEADER.size} of {HEADER.unpack_from(self._scratch, self._start)[0]} body bytes"
        else:
            what = f"{pending} of {HEADER.size} header bytes"
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
        self.owner.on_close(self, self.close_reason)

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
        buf = bytearray(HEADER.size)
        _ENCODER.encode_into(Envelope(req_id, kind, method, _EMPTY_RAW), buf, HEADER.size)
        _ENCODER.encode_into(payload, buf, -1)  # appended after the prefix: the envelope's last element
        n = len(buf) - HEADER.size
        if n > self.peer_max_frame_bytes:
            raise ValueError(
                f"{self.label}: a {n}-byte frame for {method!r} exceeds the peer's "
                f"max_frame_bytes={self.peer_max_frame_bytes}"
            )
        HEADER.pack_into(buf, 0, n)
        # uvloop keeps a reference to the view until it is sent (no copy); the stdlib loop copies what the socket
        # does not take at once. Either way `buf` is never touched again.
        self.transport.write(memoryview(buf))

    @property
    def closed(self) -> bool:
        """Closing or gone: nothing more can be sent."""
        return self.lost or self._closing

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
        except TimeoutError:
            self.transport.abort()

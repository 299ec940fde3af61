"""The RPC channel's wire format: frame header and envelope, frame kinds, the handshake messages and its HMAC, the
error reply, and the errors a caller sees (RpcError, RpcAuthError). Shared by the connection, the server and the
client (net/rpc_connection.py, net/rpc_server.py, net/rpc_client.py); net/rpc.py is the channel's public face.

Leaf module: imports nothing of the package and never torch.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import struct
from typing import Any

import msgspec

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_FRAME_BYTES",
    "HANDSHAKE_TIMEOUT_S",
    "HANDSHAKE_MAX_FRAME",
    "HEADER",
    "HELLO",
    "AUTH",
    "AUTH_OK",
    "AUTH_FAIL",
    "REQUEST",
    "RESPONSE",
    "ERROR",
    "CLIENT_LABEL",
    "SERVER_LABEL",
    "RpcError",
    "RpcAuthError",
    "Envelope",
    "Hello",
    "Auth",
    "AuthOk",
    "AuthFail",
    "ErrorInfo",
    "ProtocolViolation",
    "handshake_mac",
    "check_secret",
    "decode_control",
    "type_name",
    "decode_envelope",
    "parse_address",
]

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 4 << 30
HANDSHAKE_TIMEOUT_S = 10.0  # a peer that has not authenticated by then is dropped
HANDSHAKE_MAX_FRAME = 4096  # frame size limit before authentication

HEADER = struct.Struct(">Q")
# Frame kinds.
HELLO, AUTH, AUTH_OK, AUTH_FAIL, REQUEST, RESPONSE, ERROR = range(7)
# The HMAC labels are part of the protocol (both ends must agree), not derived from a module's name.
CLIENT_LABEL = b"areal_async.net.rpc/1 client"
SERVER_LABEL = b"areal_async.net.rpc/1 server"


class RpcError(Exception):
    """The remote handler raised; carries the remote exception's type name, message and formatted traceback."""

    # Named by its public home, whichever module defines it: type_name() (what a handler that lets an RpcError out
    # sends as remote_type) and pickle keep reading areal_async.net.rpc.RpcError.
    __module__ = "areal_async.net.rpc"

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

    __module__ = "areal_async.net.rpc"  # named by its public home, as RpcError is


# Every frame is an 8-byte big-endian length (HEADER) followed by one msgpack array [id, kind, method, payload]: the
# payload is the last element, so the receiver decodes the envelope with `payload: msgspec.Raw` and then the payload
# lazily, with the type its method registered (decode_envelope).
class Envelope(msgspec.Struct, array_like=True):
    id: int
    kind: int
    method: str
    payload: msgspec.Raw  # must stay last: the payload's bytes are appended after the encoded prefix


# The handshake, before any request (the secret never travels):
#
#     server -> HELLO(protocol, server_nonce, name, server_max_frame)
#     client -> AUTH(client_nonce, HMAC(secret, CLIENT_LABEL | server_nonce | client_nonce), client_max_frame)
#     server -> AUTH_OK(HMAC(secret, SERVER_LABEL | server_nonce | client_nonce))   or AUTH_FAIL(reason) and close
#
# Until AUTH is accepted the server reads frames of at most HANDSHAKE_MAX_FRAME and drops the connection after
# HANDSHAKE_TIMEOUT_S, so a stranger costs next to nothing.
class Hello(msgspec.Struct, array_like=True):
    protocol: int
    nonce: bytes
    name: str
    max_frame_bytes: int


class Auth(msgspec.Struct, array_like=True):
    nonce: bytes
    mac: bytes
    max_frame_bytes: int


class AuthOk(msgspec.Struct, array_like=True):
    mac: bytes


class AuthFail(msgspec.Struct, array_like=True):
    reason: str


class ErrorInfo(msgspec.Struct, array_like=True):
    """An ERROR reply's payload: what RpcError is rebuilt from on the caller's side."""

    type: str  # type_name() of the remote exception: what train/errors.py's kind_of maps back to a type
    message: str
    traceback: str


_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)


class ProtocolViolation(Exception):
    """The byte stream itself is wrong: the connection is closed with this reason."""


def handshake_mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """The proof of knowing the secret that one side sends; the label makes the two directions' proofs differ."""
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def check_secret(secret: bytes) -> None:
    """Refuse a secret that is not bytes or is empty before anything listens or connects with it."""
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if not secret:
        raise ValueError("secret must not be empty")


def decode_control(payload: memoryview, type_: type, what: str) -> Any:
    """Decode a handshake frame's payload; a malformed one is the stream's fault and closes the connection."""
    try:
        return msgspec.msgpack.decode(payload, type=type_)
    except msgspec.DecodeError as e:
        raise ProtocolViolation(f"malformed {what} frame: {e}") from None


def type_name(t: type) -> str:
    """`module.QualName` (bare for builtins): how an exception's type travels in ErrorInfo.type, so the caller can
    map it back to a type it knows (train/errors.py's kind_of) without pickle."""
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def decode_envelope(frame: bytearray | mmap.mmap) -> tuple[Envelope, memoryview]:
    """Decode the envelope and return it with a view of its payload inside `frame` (writable, no copy)."""
    try:
        env = _ENVELOPE_DECODER.decode(frame)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise ProtocolViolation(f"malformed frame ({len(frame)} bytes): {e}") from None
    # The payload is the envelope's last element, so it ends where the frame ends. Decoding from a view of the
    # frame (rather than from the Raw) makes memoryview fields of the payload writable views of the frame.
    return env, memoryview(frame)[len(frame) - len(memoryview(env.payload)) :]


def parse_address(address: str) -> tuple[str, str, int]:
    """'tcp://host:port' -> ('tcp', host, port); 'unix:///abs/path' -> ('unix', path, 0)."""
    if address.startswith("tcp://"):
        host, sep, port = address[len("tcp://") :].rpartition(":")
        if sep and host and port.isdigit():
            return "tcp", host.strip("[]"), int(port)
    elif address.startswith("unix://") and len(address) > len("unix://"):
        return "unix", address[len("unix://") :], 0
    raise ValueError(f"rpc address must look like tcp://host:port or unix:///path, got {address!r}")

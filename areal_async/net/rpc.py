"""Typed RPC between the controller and the trainer processes: msgpack frames over TCP, authenticated with a shared
secret. This module is the channel's public face; the parts live beside it: the wire format and errors
(net/rpc_wire.py), one connection's framing (net/rpc_connection.py), the server (net/rpc_server.py) and the client
(net/rpc_client.py).

Leaf of the package (it imports only its own rpc_* modules) and never imports torch.
"""

# Why our own: the controller is one asyncio event loop without torch, the trainers are torchrun processes, and what
# travels between them is mostly big flat arrays (a packed `TrainBatch` is tens of MB per step). msgspec encodes a
# Struct with `memoryview` fields as raw msgpack binaries and decodes them back as views into the received buffer, so
# a batch crosses with one copy on the sender (into the frame) and none on the receiver beyond the kernel's. No
# pickle ever touches received bytes, and no ZeroMQ.

from __future__ import annotations

from areal_async.net.rpc_client import RpcClient
from areal_async.net.rpc_server import RpcServer
from areal_async.net.rpc_wire import DEFAULT_MAX_FRAME_BYTES, RpcAuthError, RpcError

__all__ = ["DEFAULT_MAX_FRAME_BYTES", "RpcAuthError", "RpcClient", "RpcError", "RpcServer"]

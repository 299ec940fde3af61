"""Fuzzing the RPC channel of a real trainer rank (torchrun, areal_async.train.worker) over raw TCP: garbage,
truncated and oversized frames, wrong and missing authentication, replayed handshakes and frames, pickles. The
promise: every bad stream is closed by the rank, a bad payload in a good frame is an ERROR answer, the rank lives
and still serves a real client afterwards, and nothing is ever unpickled (an audit hook in the rank records every
`pickle.find_class`, and the pickles we send would create a file if they ever ran).

Seeded; `AREAL_FUZZ_CASES` scales the random cases (default 1000 here means 300 connections of each kind).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import pickle
import random
import socket
import struct
import time

import msgspec
import pytest

from areal_async.net import rpc_wire
from areal_async.net.rpc import RpcClient

pytestmark = pytest.mark.slow

CASES = max(30, int(os.environ.get("AREAL_FUZZ_CASES", "1000")) * 3 // 10)
HEADER = struct.Struct(">Q")
HELLO, AUTH, AUTH_OK, AUTH_FAIL, REQUEST, RESPONSE, ERROR = range(7)

AUDIT_HOOK = """
import os, sys, time
_path = os.environ.get("AREAL_TEST_AUDIT_LOG")
if _path:
    def _hook(event, args, _path=_path):
        if event in ("pickle.find_class", "os.system", "subprocess.Popen") and os.environ.get("AREAL_TEST_AUDIT_ON"):
            with open(_path, "a") as f:
                f.write(f"{time.time()} {os.getpid()} {event} {args!r}\\n")
    sys.addaudithook(_hook)
    with open(_path, "a") as f:
        f.write(f"{time.time()} {os.getpid()} installed\\n")
"""


class Canary:
    """Unpickling this runs os.system(touch <path>): a file that must never appear."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def frame(kind: int, method: str, payload: bytes, req_id: int = 1) -> bytes:
    # the envelope [id, kind, method, payload]: a msgpack fixarray of 4 whose last element is the raw payload
    enc = msgspec.msgpack.encode
    body = b"\x94" + enc(req_id) + enc(kind) + enc(method) + payload
    return HEADER.pack(len(body)) + body


def read_frame(sock: socket.socket) -> tuple[int, bytes] | None:
    """(kind, payload bytes) of the next frame, or None when the peer closed."""
    head = recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    body = recv_exact(sock, n)
    if body is None:
        return None
    env = msgspec.msgpack.decode(body, type=rpc_wire.Envelope)
    return env.kind, bytes(env.payload)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except (TimeoutError, ConnectionResetError):
            return None
        if not chunk:
            return None
        buf += chunk
    return buf


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """The rank closed the connection (EOF or reset) within `timeout`; frames it sent first are skipped."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def connect(address: str) -> tuple[socket.socket, bytes]:
    """A raw connection and the server nonce of its HELLO."""
    _, host, port = rpc_wire.parse_address(address)
    sock = socket.create_connection((host, port), timeout=10)
    got = read_frame(sock)
    assert got is not None and got[0] == HELLO
    hello = msgspec.msgpack.decode(got[1], type=rpc_wire.Hello)
    return sock, hello.nonce


def auth_frame(secret: bytes, server_nonce: bytes, client_nonce: bytes, max_frame: int = 1 << 30) -> bytes:
    mac = hmac.new(secret, b"areal_async.net.rpc/1 client" + server_nonce + client_nonce, hashlib.sha256).digest()
    return frame(AUTH, "", msgspec.msgpack.encode([client_nonce, mac, max_frame]), 0)


def authenticated(address: str, secret: bytes) -> tuple[socket.socket, bytes]:
    """A raw connection past the handshake; also returns the AUTH frame that got it there (for replays)."""
    sock, nonce = connect(address)
    auth = auth_frame(secret, nonce, os.urandom(32))
    sock.sendall(auth)
    got = read_frame(sock)
    assert got is not None and got[0] == AUTH_OK, got
    return sock, auth


def garbage(rng: random.Random, canary: bytes) -> bytes:
    """A random stream: noise, headers that lie about their length, msgpack of the wrong shape, pickles."""
    r = rng.random()
    if r < 0.2:
        return rng.randbytes(rng.randint(1, 600))
    if r < 0.35:
        return HEADER.pack(rng.choice([2**63, 2**64 - 1, 5 << 30, 1 << 33])) + rng.randbytes(8)
    if r < 0.5:
        body = rng.randbytes(rng.randint(1, 200))
        return HEADER.pack(len(body)) + body
    if r < 0.6:
        body = msgspec.msgpack.encode(
            rng.choice(
                [[1, 2], [1, 99, "x", b""], {"id": 1}, "s", 3.5, None, [1, REQUEST], [True, REQUEST, 7, b"\x00"]]
            )
        )
        return HEADER.pack(len(body)) + body
    if r < 0.7:
        return HEADER.pack(len(canary)) + canary
    if r < 0.75:
        return frame(REQUEST, "train_step", canary)  # a raw pickle as the payload: not msgpack, the frame is bad
    if r < 0.85:
        return frame(rng.choice([REQUEST, RESPONSE, ERROR, AUTH_OK, 42, -1]), rng.choice(["info", "x", ""]), canary)
    body = rng.randbytes(rng.randint(10, 300))
    return HEADER.pack(len(body) + rng.randint(1, 1000)) + body  # truncated: then we close


def check_rank(address: str, secret: bytes, pid: int) -> None:
    from areal_async.types import Empty, TrainerInfo

    async def call() -> TrainerInfo:
        client = await RpcClient.connect(address, secret, timeout=30)
        try:
            return await client.call("info", Empty(), TrainerInfo, timeout=30)
        finally:
            await client.close()

    info = asyncio.run(call())
    assert info.rank == 0 and info.world_size == 1
    os.kill(pid, 0)  # alive


def test_rpc_stream_fuzz_closes_connections_and_never_unpickles(tiny_ckpt, tmp_path, monkeypatch):
    from areal_async.launch.processes import Processes

    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(AUDIT_HOOK)
    audit = tmp_path / "audit.log"
    flag = tmp_path / "pwned"
    canary = pickle.dumps(Canary(str(flag)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook_dir), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("AREAL_TEST_AUDIT_LOG", str(audit))
    monkeypatch.setenv("AREAL_TEST_AUDIT_ON", "1")
    run_dir = str(tmp_path / "run")
    secret = os.urandom(32)
    procs = Processes(run_dir)
    procs.start_trainers(model=tiny_ckpt, nproc=1, config_json="{}", seed=1, secret_hex=secret.hex(), torch_threads=1)
    try:
        rank_file = os.path.join(run_dir, "trainer", "rank0.json")
        deadline = time.monotonic() + 180
        while not os.path.exists(rank_file):
            assert not procs.exited(), open(procs.children[0].log_path).read()[-3000:]
            assert time.monotonic() < deadline, "the trainer rank did not come up"
            time.sleep(0.2)
        with open(rank_file) as f:
            meta = json.load(f)
        address, pid = meta["address"], meta["pid"]
        check_rank(address, secret, pid)
        assert f" {pid} installed" in audit.read_text()  # the audit hook watches the rank itself
        audit.write_text("")  # what the rank unpickled while loading (torch's own files) is not our concern
        rng = random.Random(1515)
        failures: list[str] = []

        # 1. before authentication: noise, lying headers, frames of the wrong kind, pickles, wrong secrets
        for i in range(CASES):
            sock, nonce = connect(address)
            with sock:
                r = rng.random()
                if r < 0.2:
                    data = auth_frame(os.urandom(32), nonce, os.urandom(32))  # wrong secret
                elif r < 0.3:
                    data = auth_frame(secret, nonce, os.urandom(8))  # right secret, nonce too short
                elif r < 0.4:
                    data = frame(REQUEST, "info", msgspec.msgpack.encode([]))  # no authentication at all
                elif r < 0.45:
                    data = frame(AUTH, "", msgspec.msgpack.encode([os.urandom(32)]), 0)  # AUTH missing fields
                else:
                    data = garbage(rng, canary)
                try:
                    sock.sendall(data)
                    sock.shutdown(socket.SHUT_WR)  # a truncated frame stays truncated
                except (BrokenPipeError, ConnectionResetError):
                    continue  # closed on us already
                if not closed_by_peer(sock):
                    failures.append(f"pre-auth case {i}: connection left open after {data[:80]!r}")

        # 2. replays: a recorded AUTH on a new connection (new server nonce), a second AUTH on a live one
        live, recorded = authenticated(address, secret)
        with live:
            for _ in range(20):
                sock, _ = connect(address)
                with sock:
                    sock.sendall(recorded)
                    got = read_frame(sock)
                    if got is not None and got[0] == AUTH_OK:
                        failures.append("a replayed AUTH frame was accepted on a new connection")
                    elif not closed_by_peer(sock):
                        failures.append("a replayed AUTH frame left the connection open")
            live.sendall(recorded)
            if not closed_by_peer(live):
                failures.append("a second AUTH on an authenticated connection was not refused")

        # 3. after authentication: a well-formed frame whose payload is not the method's type (a pickle inside a
        # msgpack bin included) is an ERROR answer on a connection that stays up; a bad stream (a raw pickle or
        # invalid msgpack as the payload, noise, lying headers) closes the connection
        enc = msgspec.msgpack.encode
        wrong = [enc([1, "x"]), enc(canary), enc({"path": 5, "batch": canary}), enc(None), enc(2**64 - 1)]
        for i in range(CASES):
            sock, _ = authenticated(address, secret)
            with sock:
                method = rng.choice(
                    ["train_step", "save_checkpoint", "publish", "load_checkpoint", "info", "no_such_method"]
                )
                # (info takes Empty, which any map is: unknown keys are ignored)
                payload = rng.choice(wrong[:2] + wrong[3:] if method == "info" else wrong)
                sock.sendall(frame(REQUEST, method, payload, req_id=7))
                got = read_frame(sock)
                if got is None or got[0] != ERROR:
                    failures.append(f"post-auth case {i}: {method} with a bad payload got {got!r}, not an ERROR")
                    continue
                data = garbage(rng, canary)
                try:
                    sock.sendall(data)
                    sock.shutdown(socket.SHUT_WR)
                except (BrokenPipeError, ConnectionResetError):
                    continue
                if not closed_by_peer(sock):
                    failures.append(f"post-auth case {i}: connection left open after {data[:80]!r}")

        # 4. a stranger who connects and says nothing is dropped after the handshake timeout
        sock, _ = connect(address)
        with sock:
            if not closed_by_peer(sock, rpc_wire.HANDSHAKE_TIMEOUT_S + 5):
                failures.append("a silent connection was not dropped after the handshake timeout")

        assert not failures, f"{len(failures)} failures, e.g.:\n" + "\n".join(failures[:15])
        check_rank(address, secret, pid)  # the rank lives and serves a real client
        assert not flag.exists(), "a pickle sent over the channel was executed"
        unpickled = [line for line in audit.read_text().splitlines() if line.split()[1] == str(pid)]
        assert not unpickled, unpickled[:5]
    finally:
        procs.shutdown()

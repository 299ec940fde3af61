"""The RPC channel between controller and trainers: typed calls, concurrency, errors, auth, hostile bytes."""

from __future__ import annotations

import asyncio
import json
import logging
import mmap
import os
import struct
import subprocess
import sys
import threading

import msgspec
import numpy as np
import pytest
from rpc_helpers import RpcSyncClient, start_unix

from areal_async.net import rpc_connection, rpc_server, rpc_wire
from areal_async.net.rpc import RpcAuthError, RpcClient, RpcError, RpcServer

SECRET = b"controller-and-trainers-share-this"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Echo(msgspec.Struct):
    text: str
    n: int = 0


class Gated(msgspec.Struct):
    i: int
    wait: bool = False


class Tensor(msgspec.Struct, frozen=True):
    """Like areal_async.types.Array, but with `data: memoryview`: msgspec cannot decode `memoryview | bytes`."""

    dtype: str
    shape: list[int]
    data: memoryview

    @classmethod
    def of(cls, a: np.ndarray) -> Tensor:
        return cls(a.dtype.name, list(a.shape), memoryview(np.ascontiguousarray(a)).cast("B"))

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)


class Empty(msgspec.Struct):
    pass


class MyError(RuntimeError):
    pass


def fail_deeply(req: Echo) -> Echo:
    raise MyError(f"cannot handle {req.text!r}")


class Fixture:
    """A server with a few handlers, listening on TCP, and the state the handlers share with the test."""

    def __init__(self) -> None:
        self.server = RpcServer(SECRET, name="test-trainer", max_frame_bytes=1 << 30)
        self.gate = asyncio.Event()
        self.seen: list[object] = []
        self.server.register("echo", lambda r: Echo(r.text.upper(), r.n + 1), Echo)
        self.server.register("fail", fail_deeply, Echo)
        self.server.register("gated", self._gated, Gated)
        self.server.register("tensor_echo", self._tensor_echo, Tensor)
        self.address = ""

    async def _gated(self, req: Gated) -> Gated:
        if req.wait:
            await self.gate.wait()
        return Gated(req.i)

    def _tensor_echo(self, t: Tensor) -> Tensor:
        # What the handler got: a writable view into the received frame, not a copy.
        self.seen.append((type(t.data), type(t.data.obj), t.data.readonly, len(t.data.obj)))
        return t

    async def connect(self, **kw) -> RpcClient:
        return await RpcClient.connect(self.address, SECRET, timeout=5, **kw)


@pytest.fixture
async def fx():
    f = Fixture()
    f.address = await f.server.start_tcp()
    yield f
    await f.server.close()


async def test_typed_round_trip(fx):
    assert fx.address.startswith("tcp://127.0.0.1:")
    async with await fx.connect() as client:
        assert client.server_name == "test-trainer"
        out = await client.call("echo", Echo("hello", 41), Echo)
        assert out == Echo("HELLO", 42)
        # the same connection serves call after call
        for i in range(20):
            assert (await client.call("echo", Echo("x", i), Echo)).n == i + 1


async def test_many_calls_in_flight_answer_out_of_order(fx):
    async with await fx.connect() as client:
        done: list[int] = []

        async def one(i: int, wait: bool) -> None:
            out = await client.call("gated", Gated(i, wait), Gated)
            assert out.i == i
            done.append(i)

        first = asyncio.create_task(one(0, True))  # sent first, held on the server until the rest have answered
        await asyncio.gather(*(one(i, False) for i in range(1, 50)))
        assert not first.done() and sorted(done) == list(range(1, 50))
        fx.gate.set()
        await asyncio.wait_for(first, 5)
        assert done[-1] == 0


async def test_per_call_timeout_then_connection_still_works(fx, caplog):
    caplog.set_level(logging.DEBUG, logger="areal_async.net.rpc")
    async with await fx.connect() as client:
        with pytest.raises(TimeoutError, match="'gated'.*timed out after 0.2s"):
            await client.call("gated", Gated(7, wait=True), Gated, timeout=0.2)
        fx.gate.set()  # the late reply arrives now and is dropped
        assert await client.call("gated", Gated(8, wait=True), Gated, timeout=5) == Gated(8)
        assert not client._pending
        assert "late reply" in caplog.text


async def test_remote_exception_carries_type_message_and_traceback(fx):
    async with await fx.connect() as client:
        with pytest.raises(RpcError) as ei:
            await client.call("fail", Echo("bad input"), Echo)
        e = ei.value
        assert e.remote_type == "tests.test_rpc.MyError" or e.remote_type.endswith("test_rpc.MyError")
        assert e.remote_message == "cannot handle 'bad input'"
        assert "fail_deeply" in e.remote_traceback and "MyError" in e.remote_traceback
        assert "cannot handle" in str(e) and "fail" in str(e)
        # an error answers one call; the connection stays up
        assert await client.call("echo", Echo("ok"), Echo) == Echo("OK", 1)


async def test_unknown_method_and_mistyped_request_answer_errors(fx):
    async with await fx.connect() as client:
        with pytest.raises(RpcError) as ei:
            await client.call("no_such_method", Echo("x"), Echo)
        assert ei.value.remote_type == "UnknownMethodError" and "no_such_method" in ei.value.remote_message
        with pytest.raises(RpcError) as ei:
            await client.call("echo", Gated(3), Echo)  # a Gated where an Echo is expected
        assert ei.value.remote_type == "msgspec.ValidationError" and "Echo" in ei.value.remote_message
        with pytest.raises(msgspec.ValidationError, match="not a valid Gated"):
            await client.call("echo", Echo("x"), Gated)  # the reply does not match what the caller expects
        assert await client.call("echo", Echo("still here"), Echo) == Echo("STILL HERE", 1)


@pytest.mark.slow  # about 1 GB of memory traffic: a few seconds on a shared 2-core machine
async def test_200mb_array_round_trip_is_zero_copy_on_receipt(fx):
    a = np.arange(50_000_000, dtype=np.int32)  # 200 MB
    async with await fx.connect() as client:
        out = await client.call("tensor_echo", Tensor.of(a), Tensor)
    assert fx.seen == [(memoryview, mmap.mmap, False, fx.seen[0][3])] and fx.seen[0][3] > a.nbytes
    # the reply's data is a writable view into the one buffer the frame was received into
    assert isinstance(out.data, memoryview) and isinstance(out.data.obj, mmap.mmap) and not out.data.readonly
    assert len(out.data.obj) > a.nbytes and out.data.nbytes == a.nbytes
    got = out.numpy()
    assert got.shape == a.shape and got.dtype == np.int32 and np.array_equal(got, a)


async def test_concurrent_big_and_small_calls_share_one_connection(fx):
    """Multi-MB frames under write backpressure and small calls in between arrive whole and matched to their ids."""
    arrays = [np.full(700_000 + 1000 * i, i, dtype=np.float32) for i in range(8)]  # ~2.8 MB each
    async with await fx.connect() as client:
        big = [client.call("tensor_echo", Tensor.of(a), Tensor) for a in arrays]
        small = [client.call("echo", Echo("s", i), Echo) for i in range(30)]
        results = await asyncio.gather(*big, *small)
    for a, out in zip(arrays, results[:8]):
        assert np.array_equal(out.numpy(), a)
    assert [r.n for r in results[8:]] == list(range(1, 31))


async def test_wrong_secret_is_refused_and_others_keep_working(fx, caplog):
    caplog.set_level(logging.INFO, logger="areal_async.net.rpc")
    good = await fx.connect()
    with pytest.raises(RpcAuthError, match="wrong shared secret"):
        await RpcClient.connect(fx.address, b"not-the-secret", timeout=5)
    assert "wrong shared secret" in caplog.text and "rejected" in caplog.text
    assert await good.call("echo", Echo("a"), Echo) == Echo("A", 1)
    async with await fx.connect() as another:
        assert await another.call("echo", Echo("b"), Echo) == Echo("B", 1)
    await good.close()


async def test_client_refuses_a_server_that_does_not_know_the_secret():
    """An impostor that answers AUTH_OK without knowing the secret gets no request out of the client."""
    received: list[int] = []

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = rpc_wire.Hello(rpc_wire.PROTOCOL_VERSION, os.urandom(32), "impostor", 1 << 20)
        writer.write(_frame(rpc_wire.HELLO, hello))
        (n,) = struct.unpack(">Q", await reader.readexactly(8))
        await reader.readexactly(n)  # the client's AUTH
        writer.write(_frame(rpc_wire.AUTH_OK, rpc_wire.AuthOk(os.urandom(32))))
        received.append(len(await reader.read()))  # whatever arrives before the client hangs up
        writer.close()

    srv = await asyncio.start_server(impostor, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    with pytest.raises(RpcAuthError, match="could not prove"):
        await RpcClient.connect(f"tcp://127.0.0.1:{port}", SECRET, timeout=5)
    for _ in range(100):
        if received:
            break
        await asyncio.sleep(0.02)
    assert received == [0]
    srv.close()
    await srv.wait_closed()


def _frame(kind: int, payload: object, req_id: int = 0, method: str = "") -> bytes:
    body = msgspec.msgpack.encode(rpc_wire.Envelope(req_id, kind, method, msgspec.Raw(msgspec.msgpack.encode(payload))))
    return struct.pack(">Q", len(body)) + body


HOSTILE = {
    "garbage": (b"\x00" * 7 + b"\x05" + b"\xc1\xff\x00\x13\x37", "malformed frame"),
    "bad_envelope": (struct.pack(">Q", 3) + msgspec.msgpack.encode([1, 2]), "malformed frame"),
    "oversized": (struct.pack(">Q", (1 << 30) + 1), "exceeds max_frame_bytes=1073741824"),
    "truncated": (struct.pack(">Q", 1000) + b"x" * 10, "truncated frame"),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
async def test_hostile_bytes_after_auth_close_only_that_connection(fx, caplog, kind):
    data, reason = HOSTILE[kind]
    caplog.set_level(logging.INFO, logger="areal_async.net.rpc")
    bystander = await fx.connect()
    victim = await fx.connect()
    pending = asyncio.create_task(victim.call("gated", Gated(1, wait=True), Gated))
    await asyncio.sleep(0.05)
    victim._conn.transport.write(data)  # as if the peer's stream were corrupted
    if kind == "truncated":
        victim._conn.transport.write_eof()
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(pending, 5)
    assert victim.closed
    with pytest.raises(ConnectionError):
        await victim.call("echo", Echo("x"), Echo)
    assert reason in caplog.text
    assert await bystander.call("echo", Echo("fine"), Echo) == Echo("FINE", 1)
    async with await fx.connect() as newcomer:
        assert await newcomer.call("echo", Echo("new"), Echo) == Echo("NEW", 1)
    await victim.close()
    await bystander.close()


@pytest.mark.parametrize("kind", ["garbage", "oversized", "truncated", "silence"])
async def test_hostile_bytes_before_auth_are_dropped(fx, caplog, monkeypatch, kind):
    monkeypatch.setattr(rpc_server, "HANDSHAKE_TIMEOUT_S", 0.3)  # the binding _Session reads
    caplog.set_level(logging.INFO, logger="areal_async.net.rpc")
    host, port = fx.address[len("tcp://") :].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    (n,) = struct.unpack(">Q", await reader.readexactly(8))
    assert 0 < n < 4096
    await reader.readexactly(n)  # HELLO
    if kind == "garbage":
        writer.write(HOSTILE["garbage"][0])
    elif kind == "oversized":
        writer.write(struct.pack(">Q", 5000))  # over the 4 KiB allowed before authentication
    elif kind == "truncated":
        writer.write(struct.pack(">Q", 100) + b"abc")
        writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # the server hung up
    expected = {
        "garbage": "malformed frame",
        "oversized": "exceeds max_frame_bytes=4096",
        "truncated": "truncated frame",
        "silence": "no authentication within",
    }[kind]
    assert expected in caplog.text
    writer.close()
    async with await fx.connect() as client:
        assert await client.call("echo", Echo("up"), Echo) == Echo("UP", 1)


async def test_request_over_the_servers_limit_fails_locally():
    srv = RpcServer(SECRET, max_frame_bytes=64 << 10)
    srv.register("tensor", lambda t: Empty(), Tensor)
    address = await srv.start_tcp()
    async with await RpcClient.connect(address, SECRET) as client:
        with pytest.raises(ValueError, match="exceeds the peer's max_frame_bytes=65536"):
            await client.call("tensor", Tensor.of(np.zeros(20000, np.float32)), Empty)
        assert await client.call("tensor", Tensor.of(np.zeros(100, np.float32)), Empty) == Empty()
    await srv.close()


async def test_unix_socket_and_connect_retries_until_the_server_is_up(tmp_path):
    path = str(tmp_path / "trainer.sock")
    srv = RpcServer(SECRET)
    srv.register("echo", lambda r: Echo(r.text * 2), Echo)

    async def start_late() -> str:
        await asyncio.sleep(0.3)
        return await start_unix(srv, path)

    starter = asyncio.create_task(start_late())
    client = await RpcClient.connect(f"unix://{path}", SECRET, timeout=10)  # nothing listens yet
    assert await starter == f"unix://{path}"
    assert await client.call("echo", Echo("ab"), Echo) == Echo("abab")
    await client.close()
    await srv.close()
    with pytest.raises(ConnectionError, match="could not connect"):
        await RpcClient.connect(f"unix://{path}", SECRET, timeout=0.3)


async def test_blocking_handlers_run_in_call_order_on_one_thread():
    srv = RpcServer(SECRET, name="ordered")
    log: list[tuple[int, int]] = []
    release = threading.Event()
    rng = np.random.default_rng(0)
    delays = rng.uniform(0, 0.01, size=40)

    def step(req: Gated) -> Gated:
        if req.wait:
            release.wait(10)  # holds the worker thread; the loop must stay free
        threading.Event().wait(float(delays[req.i]))
        log.append((threading.get_ident(), req.i))
        return Gated(req.i)

    srv.register("step", step, Gated, blocking=True)
    srv.register("echo", lambda r: Echo(r.text), Echo)
    address = await srv.start_tcp()
    async with await RpcClient.connect(address, SECRET) as client:
        first = asyncio.create_task(client.call("step", Gated(0, wait=True), Gated))
        rest = [asyncio.create_task(client.call("step", Gated(i), Gated)) for i in range(1, 40)]
        await asyncio.sleep(0.05)
        # the loop answers other calls while the blocking handler holds its thread
        assert await client.call("echo", Echo("free"), Echo, timeout=5) == Echo("free")
        assert not first.done()
        release.set()
        results = await asyncio.gather(first, *rest)
    assert [r.i for r in results] == list(range(40))
    assert [i for _, i in log] == list(range(40))  # executed in the order the calls were made
    threads = {t for t, _ in log}
    assert len(threads) == 1 and threads != {threading.get_ident()}
    await srv.close()


async def test_connection_drop_fails_pending_calls_promptly(fx):
    client = await fx.connect()
    pending = [asyncio.create_task(client.call("gated", Gated(i, wait=True), Gated)) for i in range(5)]
    await asyncio.sleep(0.05)
    await fx.server.close()
    for task in pending:
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(task, 5)
    with pytest.raises(ConnectionError):
        await client.call("echo", Echo("x"), Echo)
    await client.close()


async def test_client_close_fails_its_pending_calls(fx):
    client = await fx.connect()
    pending = asyncio.create_task(client.call("gated", Gated(1, wait=True), Gated))
    await asyncio.sleep(0.05)
    await client.close()
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(pending, 5)


async def test_request_stop_from_a_handler_replies_then_stops():
    srv = RpcServer(SECRET, name="stoppable")

    def shutdown(_: Empty) -> Echo:
        srv.request_stop()
        return Echo("bye")

    srv.register("shutdown", shutdown, Empty, blocking=True)  # from the worker thread: must be thread-safe
    address = await srv.start_tcp()
    serving = asyncio.create_task(srv.serve_forever())
    client = await RpcClient.connect(address, SECRET)
    assert await client.call("shutdown", Empty(), Echo) == Echo("bye")
    await asyncio.wait_for(serving, 5)
    with pytest.raises(ConnectionError):
        await RpcClient.connect(address, SECRET, timeout=0.3)
    await client.close()


async def test_sync_client_from_a_script_thread(fx):
    def script() -> Echo:
        with RpcSyncClient(fx.address, SECRET, timeout=5) as c:
            return c.call("echo", Echo("sync", 1), Echo)

    assert await asyncio.to_thread(script) == Echo("SYNC", 2)


class _Recorder:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def on_frame(self, conn, frame) -> None:
        self.frames.append(bytes(frame))


def test_framing_survives_any_split_of_the_byte_stream():
    """Frames of every size class (empty, small, straddling the scratch buffer, bigger than it) cut at random points,
    the way TCP may deliver them, come out whole and in order."""
    rng = np.random.default_rng(1)
    scratch = rpc_connection._SCRATCH_BYTES
    sizes = [
        0,
        1,
        7,
        8,
        9,
        4096,
        100,
        scratch - 8,
        scratch - 7,
        scratch,
        3 * scratch + 5,
        *rng.integers(0, 40_000, 40),
        600_000,
        3,
    ]
    frames = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    stream = b"".join(struct.pack(">Q", len(f)) + f for f in frames)
    for trial in range(4):
        owner = _Recorder()
        conn = rpc_connection.Connection(owner, 1 << 20, "test")
        pos = 0
        while pos < len(stream):
            want = int(rng.choice([1, 3, 8, 13, 1000, 70_000, 300_000])) if trial else len(stream)
            buf = conn.get_buffer(-1)
            assert len(buf) > 0
            n = min(want, len(buf), len(stream) - pos)
            buf[:n] = stream[pos : pos + n]
            del buf
            conn.buffer_updated(n)
            pos += n
        assert owner.frames == frames
        assert conn._end == conn._start == 0 and conn._big is None


def test_bad_arguments_are_rejected_early():
    with pytest.raises(TypeError, match="secret must be bytes"):
        RpcServer("a string")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        RpcServer(b"")
    srv = RpcServer(SECRET)
    srv.register("m", lambda r: r, Echo)
    with pytest.raises(ValueError, match="already registered"):
        srv.register("m", lambda r: r, Echo)

    async def coro(r: Echo) -> Echo:
        return r

    with pytest.raises(TypeError, match="blocking=True is for sync"):
        srv.register("c", coro, Echo, blocking=True)
    with pytest.raises(TypeError):  # a type msgspec cannot decode fails at registration, not per call
        srv.register("u", lambda r: r, memoryview | bytes)
    with pytest.raises(ValueError, match="tcp://host:port"):
        rpc_wire.parse_address("http://x:1")
    assert rpc_wire.parse_address("tcp://[::1]:5") == ("tcp", "::1", 5)


def test_error_pickles_and_reads_well():
    import pickle

    e = RpcError("ValueError", "bad", "Traceback ...\nValueError: bad\n", "train_step")
    back = pickle.loads(pickle.dumps(e))
    assert (back.remote_type, back.remote_message, back.method) == ("ValueError", "bad", "train_step")
    assert str(back).startswith("rpc 'train_step' failed remotely with ValueError: bad")
    # the channel's own errors keep their public names on the wire (remote_type) and in pickles, whichever module
    # under areal_async/net/ defines them
    assert rpc_wire.type_name(RpcError) == "areal_async.net.rpc.RpcError"
    assert pickle.loads(pickle.dumps(RpcAuthError("no"))).__class__ is RpcAuthError


def test_under_uvloop():
    """The controller runs uvloop: framing (small and big frames), errors and hostile bytes work there too."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        f = Fixture()
        f.address = await f.server.start_tcp()
        async with await f.connect() as client:
            assert await client.call("echo", Echo("uv"), Echo) == Echo("UV", 1)
            a = np.random.default_rng(0).standard_normal((1000, 2500)).astype(np.float32)  # 10 MB
            out = await client.call("tensor_echo", Tensor.of(a), Tensor)
            assert np.array_equal(out.numpy(), a) and not out.data.readonly
            outs = await asyncio.gather(*(client.call("echo", Echo("c", i), Echo) for i in range(100)))
            assert [o.n for o in outs] == list(range(1, 101))
            with pytest.raises(RpcError):
                await client.call("fail", Echo("x"), Echo)
        victim = await f.connect()
        victim._conn.transport.write(HOSTILE["garbage"][0])
        for _ in range(200):
            if victim.closed:
                break
            await asyncio.sleep(0.01)
        assert victim.closed
        async with await f.connect() as client:
            assert await client.call("echo", Echo("again"), Echo) == Echo("AGAIN", 1)
        await f.server.close()

    uvloop.run(scenario())


def test_benchmark_quick_smoke(tmp_path):
    """benchmarks/rpc.py --quick runs end to end across processes and writes its JSON (no speed assertion)."""
    out = tmp_path / "rpc.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "rpc.py"), "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    for key in ("rpc_mb_per_s", "pickle_socket_mb_per_s", "roundtrip_us", "payload_mb"):
        assert result[key] > 0, key

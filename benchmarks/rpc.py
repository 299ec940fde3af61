"""RPC throughput and latency: a packed TrainBatch from the controller to a trainer process, against pickle.

    rpc:      `RpcClient.call("train_step", TrainStepRequest(batch))` over loopback TCP to an `RpcServer` in another
              process, which views every array (np.frombuffer, no copy), sums the loss mask and replies with a small
              TrainStepResult. The call is timed from before encoding to the decoded reply.
    baseline: the same arrays as a dict of numpy arrays, `pickle.dumps` + `sendall(header + data)` over a plain
              socket to another process that receives it in chunks, joins them and `pickle.loads` it. The naive way.
    roundtrip: a small call (Empty -> Empty), median over many.

Both sides of the RPC use uvloop when it is installed (the controller does); with --loop asyncio they use the stdlib
loop. The full run measures both loops. Throughput is the payload's array bytes over the median call time.

    python benchmarks/rpc.py --out /tmp/rpc.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time

import msgspec
import numpy as np

from areal_async.net.rpc import RpcClient, RpcServer
from areal_async.types import Array, Empty, TrainBatch, TrainStepRequest, TrainStepResult, Trajectory, pack_trajectories

SECRET_ENV = "AREAL_BENCH_RPC_SECRET"
_LEN = struct.Struct(">Q")


# ---- the payload --------------------------------------------------------------------------------------------------


def make_batch(num_trajs: int, mean_len: int, seed: int = 0) -> TrainBatch:
    """A realistic training batch: groups of 8 samples, ~mean_len tokens each, a 256-token prompt."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(num_trajs):
        n = int(rng.integers(mean_len // 2, mean_len * 3 // 2))
        p = min(256, n - 1)
        gen = n - p
        trajs.append(
            Trajectory(
                input_ids=rng.integers(0, 150_000, n).tolist(),
                loss_mask=[0] * p + [1] * gen,
                logprobs=[0.0] * p + (-rng.exponential(1.0, gen)).tolist(),
                versions=[-1] * p + [7] * gen,
                reward=float(rng.random() < 0.5),
                group_id=i // 8,
                prompt_len=p,
            )
        )
    return pack_trajectories(
        trajs, policy_version=7, global_response_tokens=sum(t.response_len for t in trajs), global_num_seqs=num_trajs
    )


def batch_arrays(batch: TrainBatch) -> dict[str, np.ndarray]:
    return {f: getattr(batch, f).to_numpy() for f in batch.__struct_fields__ if isinstance(getattr(batch, f), Array)}


def payload_bytes(batch: TrainBatch) -> int:
    return sum(a.nbytes for a in batch_arrays(batch).values())


class _ArrayView(msgspec.Struct, frozen=True):
    dtype: str
    shape: list[int]
    data: memoryview


def request_type() -> type:
    """TrainStepRequest, or a mirror with `data: memoryview` while types.Array's `memoryview | bytes` is undecodable."""
    try:
        msgspec.msgpack.Decoder(TrainStepRequest)
        return TrainStepRequest
    except TypeError:
        fields = [(f.name, _ArrayView if f.type is Array else f.type) for f in msgspec.structs.fields(TrainBatch)]
        view = msgspec.defstruct("TrainBatchView", fields, kw_only=True)
        return msgspec.defstruct("TrainStepRequestView", [("batch", view)], kw_only=True)


# ---- trainer-side servers (run in a child process) ----------------------------------------------------------------


def loss_tokens(arrays: dict[str, np.ndarray]) -> int:
    return int(arrays["loss_mask"].sum())


async def serve_rpc() -> None:
    server = RpcServer(bytes.fromhex(os.environ[SECRET_ENV]), name="bench-trainer")

    def train_step(req) -> TrainStepResult:
        b = req.batch
        arrays = {f: np.frombuffer(getattr(b, f).data, dtype=getattr(b, f).dtype) for f in ("loss_mask", "input_ids")}
        return TrainStepResult(version=b.policy_version + 1, stats={"tokens": float(loss_tokens(arrays))})

    def shutdown(_: Empty) -> Empty:
        server.request_stop()
        return Empty()

    server.register("train_step", train_step, request_type())
    server.register("ping", lambda _: Empty(), Empty)
    server.register("shutdown", shutdown, Empty)
    address = await server.start_tcp("127.0.0.1", 0)
    print(address, flush=True)
    await server.serve_forever()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def serve_pickle() -> None:
    """The naive baseline: length-prefixed pickles over a blocking socket (trusted peer: this benchmark only)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(f"tcp://127.0.0.1:{listener.getsockname()[1]}", flush=True)
        conn, _ = listener.accept()
        with conn:
            while True:
                (n,) = _LEN.unpack(recv_exactly(conn, _LEN.size))
                msg = pickle.loads(recv_exactly(conn, n))
                if msg == "shutdown":
                    return
                reply = pickle.dumps({"version": msg["policy_version"] + 1, "tokens": loss_tokens(msg["arrays"])})
                conn.sendall(_LEN.pack(len(reply)) + reply)


def start_child(mode: str, loop: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", mode, "--loop", loop],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    line = proc.stdout.readline().strip()
    if not line.startswith(("tcp://", "unix://")):
        proc.kill()
        raise RuntimeError(f"{mode} server did not start (said {line!r})")
    return proc, line


def stop_child(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- controller-side measurements ---------------------------------------------------------------------------------


class PickleClient:
    """The baseline's controller side: pickle.dumps, sendall(header + data), recv the pickled reply."""

    def __init__(self, address: str) -> None:
        host, port = address[len("tcp://") :].rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def step(self, msg: dict) -> dict:
        data = pickle.dumps(msg)
        self.sock.sendall(_LEN.pack(len(data)) + data)
        (n,) = _LEN.unpack(recv_exactly(self.sock, _LEN.size))
        return pickle.loads(recv_exactly(self.sock, n))

    def close(self) -> None:
        data = pickle.dumps("shutdown")
        self.sock.sendall(_LEN.pack(len(data)) + data)
        self.sock.close()


async def measure(
    rpc_address: str, pickle_address: str | None, batch: TrainBatch, iters: int, pings: int
) -> dict[str, list[float]]:
    """Batch calls, RPC and pickle interleaved so that noise from a shared machine hits both alike; then pings."""
    secret = bytes.fromhex(os.environ[SECRET_ENV])
    request = TrainStepRequest(batch=batch)
    msg = {
        "arrays": batch_arrays(batch),
        "policy_version": batch.policy_version,
        "global_response_tokens": batch.global_response_tokens,
        "global_num_seqs": batch.global_num_seqs,
    }
    expected = int(batch.loss_mask.to_numpy().sum())
    times: dict[str, list[float]] = {"rpc": [], "pickle": [], "ping": []}
    baseline = PickleClient(pickle_address) if pickle_address else None
    try:
        async with await RpcClient.connect(rpc_address, secret, timeout=30) as client:
            for i in range(iters + 1):  # the first round is a warm-up
                t0 = time.perf_counter()
                out = await client.call("train_step", request, TrainStepResult)
                t1 = time.perf_counter()
                assert out.stats["tokens"] == expected and out.version == batch.policy_version + 1
                if baseline is not None:
                    reply = baseline.step(msg)
                    assert reply["tokens"] == expected
                t2 = time.perf_counter()
                if i:
                    times["rpc"].append(t1 - t0)
                    if baseline is not None:
                        times["pickle"].append(t2 - t1)
            for i in range(pings + pings // 10):
                t0 = time.perf_counter()
                await client.call("ping", Empty(), Empty)
                if i >= pings // 10:
                    times["ping"].append(time.perf_counter() - t0)
            await client.call("shutdown", Empty(), Empty)
    finally:
        if baseline is not None:
            baseline.close()
    return times


def run_loop(loop: str, coro):
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--quick", action="store_true", help="a small batch and few iterations (smoke test)")
    ap.add_argument("--trajectories", type=int, default=512)
    ap.add_argument("--mean-len", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    ap.add_argument("--serve", choices=["rpc", "pickle"], help=argparse.SUPPRESS)  # child process mode
    args = ap.parse_args()
    try:
        import uvloop  # noqa: F401

        have_uvloop = True
    except ImportError:
        have_uvloop = False
    loop = args.loop if args.loop != "auto" else ("uvloop" if have_uvloop else "asyncio")

    if args.serve == "rpc":
        return run_loop(loop, serve_rpc())
    if args.serve == "pickle":
        return serve_pickle()
    if not args.out:
        ap.error("--out is required")

    if args.quick:
        args.trajectories, args.mean_len, args.iters, args.pings = 64, 1024, 3, 200
    os.environ[SECRET_ENV] = os.urandom(32).hex()
    batch = make_batch(args.trajectories, args.mean_len)
    nbytes = payload_bytes(batch)
    loops = [loop] if args.quick or args.loop != "auto" or not have_uvloop else ["uvloop", "asyncio"]

    results: dict[str, float] = {}
    for lp in loops:
        children = [start_child("rpc", lp)] + ([start_child("pickle", "asyncio")] if lp == loops[0] else [])
        try:
            times = run_loop(
                lp,
                measure(children[0][1], children[1][1] if len(children) > 1 else None, batch, args.iters, args.pings),
            )
        finally:
            for proc, _ in children:
                stop_child(proc)
        suffix = "" if lp == loops[0] else f"_{lp}"
        results[f"rpc_mb_per_s{suffix}"] = nbytes / statistics.median(times["rpc"]) / 1e6
        if times["pickle"]:
            results["pickle_socket_mb_per_s"] = nbytes / statistics.median(times["pickle"]) / 1e6
        results[f"roundtrip_us{suffix}"] = statistics.median(times["ping"]) * 1e6
        results[f"roundtrip_p99_us{suffix}"] = float(np.percentile(times["ping"], 99)) * 1e6

    out = {
        **results,
        "speedup_vs_pickle": results["rpc_mb_per_s"] / results["pickle_socket_mb_per_s"],
        "payload_mb": nbytes / 1e6,
        "tokens": int(batch.seq_lens.to_numpy().sum()),
        "trajectories": args.trajectories,
        "iters": args.iters,
        "pings": args.pings,
        "loop": loops[0],
        "quick": args.quick,
        "python": platform.python_version(),
        "msgspec": msgspec.__version__,
        "cpus": os.cpu_count(),
    }
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(
        f"payload: {out['tokens']} tokens in {args.trajectories} trajectories = {out['payload_mb']:.1f} MB "
        f"of arrays, {args.iters} calls"
    )
    print(f"{'measure':<32}{'value':>12}")
    for key, value in results.items():
        unit = "MB/s" if "mb_per_s" in key else "us"
        print(f"{key:<32}{value:>10.1f} {unit}")
    print(f"{'speedup_vs_pickle':<32}{out['speedup_vs_pickle']:>10.2f} x")


if __name__ == "__main__":
    main()

"""How much one event loop can drive: the real controller pieces and the real InferenceClient against a stand-in
SGLang endpoint (its own process, real HTTP over loopback) that answers without any model.

    python benchmarks/controller_overhead.py --out benchmarks/out/controller_overhead.json [--quick]

For each in-flight target (default 1k and 10k prompt groups of one sample each), the RolloutManager keeps that many
RLVR workflows running through the StalenessBuffer (eta unbounded, concurrency cap = target) while a consumer takes
batches and bumps the version, as the trainer would. Every rollout is a real HTTP request on its own keep-alive
connection (the client's connection cap is set to the target), so "in flight" means in flight at the server.

The stand-in holds each request for a random time, uniform in [0.5, 1.5] x the mean latency, then answers with
`STAND_IN_TOKENS` tokens in SGLang's response shape. The spread matters: RL generations have varied lengths, and a
fixed hold time would keep every request in lockstep forever (all answers in one burst, then nothing). By default
the mean latency is in_flight / `--offered-rate` (500 requests/s: 2 s at 1k, 20 s at 10k), so both targets offer
the same request rate and differ only in how much the controller holds in flight; `--latency-ms` fixes it instead.

Measured on the controller process after a warm-up (until every slot has turned over once): requests/s, event-loop
lag (a 10 ms ticker's lateness by `time.perf_counter`; p50/p99/max, and the time-weighted seconds of lag beyond
50 ms, since a long stall is one late tick), controller CPU time per sample (its inverse is the most one core can
drive), the fraction of one core the controller used, and the garbage collector's pauses in the window. The
RolloutManager paces the collector from the loop by default (see rollout/gc_pacer.py, `GCPacer`); `--no-gc-pacing` shows
CPython's own schedule. After the window one full collection is forced and timed: that is the pause the pacer's
rare full collections cost at this in-flight count. The machine's load average is recorded, since other processes
share the cores. `--latency-ms 2000 --inflight 10000` offers more than the loop can take: requests/s is then its
saturated throughput, and the lag is meaningless (every loop iteration is a second of queued I/O).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import msgspec

STAND_IN_TOKENS = 32


# ---- the stand-in endpoint (its own process) ---------------------------------------------------------------------


class _GenerateRequest(msgspec.Struct):
    input_ids: list[int]
    sampling_params: dict
    rid: str = ""


class _StandIn(asyncio.Protocol):
    """A minimal HTTP/1.1 keep-alive server speaking just enough of SGLang's protocol: POST /generate answers after
    its hold time (a timer, no task per request); every other path answers 200 {"status": "ok"} at once. Raw
    protocol rather than a web framework so that the stand-in's own CPU cost stays far below the controller's."""

    enc = msgspec.json.Encoder()
    dec = msgspec.json.Decoder(_GenerateRequest)

    def __init__(self, mean_s: float, rng: random.Random) -> None:
        self.mean_s = mean_s
        self.rng = rng
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            length = 0
            for line in lines[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            path = lines[0].split(" ")[1]
            if path == "/generate":
                req = self.dec.decode(body)
                out = self._generate(req)
                delay = self.mean_s * (0.5 + self.rng.random())
                asyncio.get_running_loop().call_later(delay, self._write, out)
            else:
                self._write(b'{"status":"ok"}')

    def _generate(self, req: _GenerateRequest) -> bytes:
        n = max(1, min(STAND_IN_TOKENS, int(req.sampling_params.get("max_new_tokens", STAND_IN_TOKENS))))
        triples = _TRIPLES[n]
        meta = {
            "id": req.rid,
            "finish_reason": {"type": "stop", "matched": 1},
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": "0",
            "e2e_latency": self.mean_s,
            "output_token_logprobs": triples,
        }
        return self.enc.encode({"text": "x" * n, "output_ids": [t[1] for t in triples], "meta_info": meta})

    def _write(self, body: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )


_TRIPLES = {n: [(-0.5, 7, "x")] * (n - 1) + [(-0.5, 1, "")] for n in range(1, STAND_IN_TOKENS + 1)}


def stand_in_main(port: int, mean_latency_ms: float) -> None:
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        rng = random.Random(0)
        server = await loop.create_server(
            lambda: _StandIn(mean_latency_ms / 1000, rng), "127.0.0.1", port, backlog=16384
        )
        async with server:
            await server.serve_forever()

    _run(serve())


def _run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# ---- the controller side (this process) --------------------------------------------------------------------------


async def measure(
    url: str, inflight: int, seconds: float, mean_latency_s: float, tok_dir: str, pace_gc: bool = True
) -> dict:
    from areal_async.inference.client import InferenceClient
    from areal_async.rollout.buffer import StalenessBuffer
    from areal_async.rollout.manager import RolloutManager
    from areal_async.rollout.samples import SampleStream
    from areal_async.rollout.workflows.rlvr import RLVRWorkflow
    from areal_async.tokenizer import Tokenizer
    from areal_async.types import Sample, SamplingParams

    tok = Tokenizer(tok_dir)

    async def score(completion: str, answer: str, prompt: str) -> tuple[float, str | None]:
        return float(completion == answer), None

    samples = [Sample(id=i, prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(1000)]
    batch = max(1, inflight // 8)
    buffer = StalenessBuffer(batch, None, max_running=inflight)
    client = InferenceClient([url], max_connections=inflight, timeout_s=600, connect_timeout_s=60)
    workflow = RLVRWorkflow(tok, score, SamplingParams(max_new_tokens=STAND_IN_TOKENS), group_size=1)
    # pace_gc is the default; --no-gc-pacing shows what CPython's own collection schedule costs
    manager = RolloutManager(client, workflow, SampleStream(samples), buffer, **({} if pace_gc else {"pace_gc": False}))
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        interval = 0.01
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(interval)
            lags.append(max(0.0, time.perf_counter() - t - interval))

    async def consumer() -> None:
        v = 0
        while not stop.is_set():
            await buffer.get_batch()
            v += 1
            await buffer.set_version(v)

    gc_pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}  # generation collected -> pauses (s)
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_pauses[info["generation"]].append(time.perf_counter() - gc_start[0])

    manager.start()
    tick = asyncio.create_task(ticker())
    cons = asyncio.create_task(consumer())
    # warm up: every slot started and turned over once, so connections are open and answer times have spread out
    t_w = time.monotonic()
    warm_limit = 60 + 3 * mean_latency_s
    while (
        manager.in_flight < inflight * 0.95 or manager.stats.samples < inflight
    ) and time.monotonic() - t_w < warm_limit:
        await asyncio.sleep(0.05)
    lags.clear()
    gc.callbacks.append(on_gc)
    load0 = os.getloadavg()[0]
    done0, failed0, cpu0, t0 = manager.stats.samples, manager.stats.failed, time.process_time(), time.monotonic()
    inflight_seen: list[int] = []
    while time.monotonic() - t0 < seconds:
        await asyncio.sleep(0.1)
        inflight_seen.append(manager.in_flight)
    elapsed = time.monotonic() - t0
    window = sorted(lags)  # only the window: what follows (a forced collection, shutdown) must not count
    done = manager.stats.samples - done0
    cpu = time.process_time() - cpu0
    gc.callbacks.remove(on_gc)
    load1 = os.getloadavg()[0]
    failed = manager.stats.failed - failed0
    # what one full collection costs with this much in flight (the pacer runs one every full_every_s)
    t_gc = time.perf_counter()
    gc.collect()
    forced_full_gc_s = time.perf_counter() - t_gc
    tracked, frozen = len(gc.get_objects()), gc.get_freeze_count()
    stop.set()
    await manager.stop()
    await buffer.close()
    for t in (tick, cons):
        t.cancel()
    await asyncio.gather(tick, cons, return_exceptions=True)
    await client.close()

    def pct(p: float) -> float:
        return 1000 * window[min(len(window) - 1, int(p * len(window)))] if window else 0.0

    return {
        "inflight": inflight,
        "inflight_mean": sum(inflight_seen) / max(len(inflight_seen), 1),
        "stand_in_mean_latency_ms": 1000 * mean_latency_s,
        "offered_requests_per_s": inflight / mean_latency_s,
        "requests_per_s": done / elapsed,
        "p50_loop_lag_ms": pct(0.50),
        "p99_loop_lag_ms": pct(0.99),
        "max_loop_lag_ms": 1000 * window[-1] if window else 0.0,
        "ticks": len(window),
        "lag_over_50ms_s": sum(x for x in window if x > 0.05),  # time-weighted: p99 of ticks under-counts stalls
        "cpu_ms_per_sample": 1000 * cpu / max(done, 1),
        "controller_cpu_fraction": cpu / elapsed,
        "young_gc_count": len(gc_pauses[0]) + len(gc_pauses[1]),
        "young_gc_max_ms": 1000 * max(gc_pauses[0] + gc_pauses[1], default=0.0),
        "full_gc_count": len(gc_pauses[2]),
        "full_gc_max_ms": 1000 * max(gc_pauses[2], default=0.0),
        "forced_full_gc_ms": 1000 * forced_full_gc_s,
        "gc_tracked_objects": tracked,  # what a full collection scans
        "gc_frozen_objects": frozen,  # pre-rollout objects the pacer froze out of every scan
        "gc_paced": getattr(manager, "pace_gc", False),
        "failed": failed,
        "warmup_s": t0 - t_w,
        "seconds": elapsed,
        "loadavg_1m": [load0, load1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny settings for the smoke test")
    ap.add_argument("--inflight", type=int, nargs="*", default=None)
    ap.add_argument("--seconds", type=float, default=None, help="measured window per target (default 15)")
    ap.add_argument(
        "--offered-rate",
        type=float,
        default=500.0,
        help="requests/s offered: mean stand-in latency = in_flight / rate (default 500)",
    )
    ap.add_argument("--latency-ms", type=float, default=None, help="fixed mean stand-in latency for every target")
    ap.add_argument("--no-gc-pacing", action="store_true", help="RolloutManager(pace_gc=False), for comparison")
    ap.add_argument("--stand-in", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stand_in is not None:
        stand_in_main(args.stand_in, args.latency_ms or 0.0)
        return
    targets = args.inflight or ([50] if args.quick else [1000, 10000])
    seconds = args.seconds or (2.0 if args.quick else 15.0)
    fixed_ms = args.latency_ms if args.latency_ms is not None else (20.0 if args.quick else None)

    from areal_async.launch import free_port
    from areal_async.tasks.char_tokenizer import save_char_tokenizer

    runs = []
    with tempfile.TemporaryDirectory() as tok_dir:
        save_char_tokenizer(tok_dir)
        for inflight in targets:
            mean_ms = fixed_ms if fixed_ms is not None else 1000 * inflight / args.offered_rate
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, __file__, "--out", os.devnull, "--stand-in", str(port), "--latency-ms", str(mean_ms)]
            )
            try:
                _wait_port(port)
                runs.append(
                    _run(
                        measure(
                            f"http://127.0.0.1:{port}",
                            inflight,
                            seconds,
                            mean_ms / 1000,
                            tok_dir,
                            pace_gc=not args.no_gc_pacing,
                        )
                    )
                )
            finally:
                proc.terminate()
                proc.wait(10)
    result = {
        "runs": runs,
        "seconds": seconds,
        "measured": "controller process only: real RolloutManager + StalenessBuffer + RLVRWorkflow + "
        "InferenceClient (aiohttp, one connection per in-flight request) over loopback HTTP to a "
        "stand-in SGLang /generate in its own process (raw asyncio protocol, uniform [0.5, 1.5] x "
        "mean hold time, 32-token answers); the stand-in shares the same cores",
        "cpu_count": os.cpu_count(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"{'in flight':>10} {'latency s':>9} {'req/s':>8} {'p50 lag ms':>10} {'p99 lag ms':>10} "
        f"{'max lag ms':>10} {'CPU ms/smp':>10} {'CPU frac':>8} {'full GCs':>8} {'forced GC ms':>12} {'load':>5}"
    )
    for r in runs:
        print(
            f"{r['inflight']:>10} {r['stand_in_mean_latency_ms'] / 1000:>9.2f} {r['requests_per_s']:>8.0f} "
            f"{r['p50_loop_lag_ms']:>10.2f} {r['p99_loop_lag_ms']:>10.2f} {r['max_loop_lag_ms']:>10.1f} "
            f"{r['cpu_ms_per_sample']:>10.3f} {r['controller_cpu_fraction']:>8.2f} {r['full_gc_count']:>8} "
            f"{r['forced_full_gc_ms']:>12.0f} {r['loadavg_1m'][1]:>5.1f}"
        )


def _wait_port(port: int, timeout: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"stand-in did not listen on {port}")


if __name__ == "__main__":
    main()

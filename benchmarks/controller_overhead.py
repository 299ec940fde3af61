"""How much one event loop can drive: the real controller pieces and the real InferenceClient against a stand-in
SGLang endpoint (its own process, loopback) that answers without any model.

    python benchmarks/controller_overhead.py --out benchmarks/out/controller_overhead.json [--quick]

For each in-flight target (1k and 10k prompt groups of one sample each), the RolloutManager keeps that many
workflows running through the StalenessBuffer (eta unbounded, concurrency cap = target) while a consumer takes
batches and bumps the version, as the trainer would. The stand-in holds each request for `--latency-ms` so that the
in-flight count is the cap, not the stand-in's speed. Measured on the controller process: requests/s, event-loop lag
(a 10 ms ticker's lateness, p50/p99), and controller CPU time per sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import msgspec

STAND_IN_TOKENS = 32


def stand_in_main(port: int, latency_ms: float) -> None:
    """A minimal SGLang /generate: `STAND_IN_TOKENS` tokens after `latency_ms`, SGLang's response shape."""
    from aiohttp import web

    enc = msgspec.json.Encoder()
    dec = msgspec.json.Decoder()

    async def generate(request: web.Request) -> web.Response:
        body = dec.decode(await request.read())
        await asyncio.sleep(latency_ms / 1000)
        n = min(STAND_IN_TOKENS, body["sampling_params"].get("max_new_tokens", STAND_IN_TOKENS))
        triples = [[-0.5, 7, None]] * (n - 1) + [[-0.5, 1, None]]
        out = {"text": "x" * n, "output_ids": [7] * (n - 1) + [1],
               "meta_info": {"id": body.get("rid"), "finish_reason": {"type": "stop", "matched": 1},
                             "prompt_tokens": len(body["input_ids"]), "completion_tokens": n, "cached_tokens": 0,
                             "weight_version": "0", "e2e_latency": latency_ms / 1000,
                             "output_token_logprobs": triples}}
        return web.Response(body=enc.encode(out), content_type="application/json")

    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", ok)
    for path in ("/pause_generation", "/continue_generation", "/abort_request"):
        app.router.add_post(path, ok)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(app, host="127.0.0.1", port=port, print=None, backlog=16384, access_log=None)


async def measure(url: str, inflight: int, seconds: float, tok_dir: str) -> dict[str, float]:
    from areal_async.inference.client import InferenceClient
    from areal_async.rollout.buffer import StalenessBuffer
    from areal_async.rollout.rollout import RolloutManager
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
    # in-flight rollouts are not open sockets: past ~1k connections the kernel backlog, not the loop, is the limit
    client = InferenceClient([url], max_connections=min(inflight, 1024), timeout_s=600)
    workflow = RLVRWorkflow(tok, score, SamplingParams(max_new_tokens=STAND_IN_TOKENS), group_size=1)
    manager = RolloutManager(client, workflow, SampleStream(samples), buffer)
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        interval = 0.01
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            t = loop.time()
            await asyncio.sleep(interval)
            lags.append(max(0.0, loop.time() - t - interval))

    async def consumer() -> None:
        v = 0
        while not stop.is_set():
            await buffer.get_batch()
            v += 1
            await buffer.set_version(v)

    manager.start()
    tick = asyncio.create_task(ticker())
    cons = asyncio.create_task(consumer())
    # warm up until the in-flight count reaches the cap
    t_w = time.monotonic()
    while manager.in_flight < inflight * 0.95 and time.monotonic() - t_w < 30:
        await asyncio.sleep(0.05)
    lags.clear()
    done0, cpu0, t0 = manager.stats.samples, time.process_time(), time.monotonic()
    inflight_seen: list[int] = []
    while time.monotonic() - t0 < seconds:
        await asyncio.sleep(0.1)
        inflight_seen.append(manager.in_flight)
    elapsed = time.monotonic() - t0
    done = manager.stats.samples - done0
    cpu = time.process_time() - cpu0
    stop.set()
    await manager.stop()
    await buffer.close()
    for t in (tick, cons):
        t.cancel()
    await asyncio.gather(tick, cons, return_exceptions=True)
    await client.close()
    lags.sort()

    def pct(p: float) -> float:
        return 1000 * lags[min(len(lags) - 1, int(p * len(lags)))] if lags else 0.0

    return {
        "inflight": inflight,
        "inflight_mean": sum(inflight_seen) / max(len(inflight_seen), 1),
        "requests_per_s": done / elapsed,
        "p50_loop_lag_ms": pct(0.50),
        "p99_loop_lag_ms": pct(0.99),
        "cpu_ms_per_sample": 1000 * cpu / max(done, 1),
        "failed": manager.stats.failed,
        "seconds": elapsed,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny settings for the smoke test")
    ap.add_argument("--inflight", type=int, nargs="*", default=None)
    ap.add_argument("--seconds", type=float, default=None)
    ap.add_argument("--latency-ms", type=float, default=None)
    ap.add_argument("--stand-in", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stand_in is not None:
        stand_in_main(args.stand_in, args.latency_ms or 0.0)
        return
    targets = args.inflight or ([50] if args.quick else [1000, 10000])
    seconds = args.seconds or (2.0 if args.quick else 15.0)
    latency = args.latency_ms if args.latency_ms is not None else (20.0 if args.quick else 2000.0)

    from areal_async.launcher import free_port
    from areal_async.tasks.char_tokenizer import save_char_tokenizer

    runs = []
    with tempfile.TemporaryDirectory() as tok_dir:
        save_char_tokenizer(tok_dir)
        for inflight in targets:
            port = free_port()
            proc = subprocess.Popen([sys.executable, __file__, "--out", os.devnull, "--stand-in", str(port),
                                     "--latency-ms", str(latency)])
            try:
                _wait_port(port)
                try:
                    import uvloop

                    run = uvloop.run
                except ImportError:
                    run = asyncio.run
                runs.append(run(measure(f"http://127.0.0.1:{port}", inflight, seconds, tok_dir)))
            finally:
                proc.terminate()
                proc.wait(10)
    result = {"runs": runs, "stand_in_latency_ms": latency, "seconds": seconds,
              "note": "controller process only; the stand-in runs in its own process on the same 2 cores"}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'in flight':>10} {'req/s':>9} {'p50 lag ms':>11} {'p99 lag ms':>11} {'CPU ms/sample':>14}")
    for r in runs:
        print(f"{r['inflight']:>10} {r['requests_per_s']:>9.0f} {r['p50_loop_lag_ms']:>11.2f} "
              f"{r['p99_loop_lag_ms']:>11.2f} {r['cpu_ms_per_sample']:>14.3f}")


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

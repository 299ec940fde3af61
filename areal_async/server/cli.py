"""`python -m areal_async.serve --model DIR`: the embedded SGLang-protocol inference server as a process.

When the engine is ready the process prints one line to stdout,

    areal_async server ready at http://127.0.0.1:30000

(`READY_PREFIX` + URL, with the real port when --port 0 asked for an ephemeral one), so launchers can wait for it
or parse the URL. SIGTERM and SIGINT stop it cleanly: in-flight requests are aborted, the listener closes and the
engine shuts down. Exit status 0 after a clean stop, 1 when start-up fails.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import NoReturn

from areal_async.host.startup_gc import collector_paused
from areal_async.host.torch_threads import one_thread_until_set
from areal_async.protocol.ready_line import READY_PREFIX
from areal_async.server.app import start_server


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_async.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory (config.json, safetensors, tokenizer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed in the ready line)")
    p.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint except /health*"
    )
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on CUDA; on CPU bf16 where it has AVX512-BF16 or AMX, else fp32), float32, bfloat16, float16",
    )
    p.add_argument("--max-total-tokens", type=int, default=65536, help="KV-cache budget in tokens")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--weight-version", default="0", help="reported as meta_info.weight_version until an update")
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: the model path)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="compute every prompt in full (no sharing of prompt pages between requests), as in SGLang",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the engine (default: OMP_NUM_THREADS, else every CPU this process may use)",
    )
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    """Run until SIGTERM/SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with collector_paused():  # torch and the model load here: no full collections meanwhile
        server = await start_server(
            args.model,
            args.host,
            args.port,
            args.api_key,
            served_model_name=args.served_model_name,
            device=args.device,
            dtype=args.dtype,
            max_total_tokens=args.max_total_tokens,
            max_running_requests=args.max_running_requests,
            weight_version=str(args.weight_version),
            seed=args.seed,
            prefix_cache=not args.disable_radix_cache,
            threads=args.threads,
        )
    try:
        print(f"{READY_PREFIX}{server.url}", flush=True)
        await stop.wait()
        logging.getLogger(__name__).info("signal received; shutting down")
    finally:
        await server.close()


def engine_threads(requested: int | None) -> int:
    """The engine's thread count: --threads, else OMP_NUM_THREADS, else the CPUs this process may run on."""
    if requested is not None:
        if requested < 1:
            raise SystemExit(f"--threads must be >= 1, got {requested}")
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def nccl_environment(environ: os._Environ[str] | dict[str, str]) -> str:
    """NCCL_CUMEM_ENABLE=0 unless set; returns the value in force. The trainers set the same under broadcast sync
    (train/worker.py) and SGLang sets it for its own processes: the two ends of the weight-update group must agree,
    or NCCL's same-node p2p setup fails ("p2p.cc ... invalid argument"). Set before torch loads, because NCCL
    reads it when the first communicator is created; harmless when the server never joins a group."""
    environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    return environ["NCCL_CUMEM_ENABLE"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.threads = engine_threads(args.threads)
    cumem = nccl_environment(os.environ)
    # before torch loads: only the engine thread, which sets its own count, will hold OpenMP workers
    one_thread_until_set()
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger(__name__).info("NCCL_CUMEM_ENABLE=%s", cumem)
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    log = logging.getLogger(__name__)
    try:
        runner(serve(args))
    except Exception as e:  # one readable line for the launcher's log; the traceback with --log-level debug
        log.error("server failed: %s: %s", type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1
    return 0


def run_and_exit(argv: list[str] | None = None) -> NoReturn:
    """`main`, then exit without the interpreter's finalisation, as the trainer worker does: the engine is shut
    down and the logs flushed by then, and after a gloo weight-update group a finalising interpreter can abort
    (torch's gloo threads drop tensors that hold Python references once the interpreter is going away:
    "terminate called without an active exception", SIGABRT, seen in a torchrun job of the test suite). The
    `areal-serve` script keeps `main`, which returns its exit code as the project's console scripts do."""
    code = main(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()

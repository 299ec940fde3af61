"""What streaming generation (SGLang's `stream: true` SSE) costs against one JSON answer per request, on the
embedded server over HTTP, driven by the real InferenceClient.

    python benchmarks/client_streaming.py --out benchmarks/out/client_streaming.json [--quick]

Why it matters: with `InferenceClient(stream=True)` a request whose server dies keeps the tokens already streamed
and continues elsewhere from them; without streaming the segment in progress is generated again. Streaming is not
free: every event is an HTTP chunk, a JSON encode on the server and a decode on the client, and SGLang's default
events (and ours) are cumulative, so a response of n tokens sent in k events moves O(n * k) bytes.

Workloads (greedy, ignore_eos, so both modes make exactly the same tokens):
- mixed: `--requests` prompts with long-tailed lengths (lognormal, median 96, at most 512), all in flight at once.
- long: a few requests of `--long-tokens` tokens each: the worst case for cumulative events.
The limit each figure is shown against is the non-streaming run of the same round (same server, same prompts,
run just before or after): the ratio is streaming throughput / non-streaming throughput. Rounds alternate the order
of the two modes; the table shows the median over rounds. CPU seconds are the client process's (the controller)
and the server process's, read from /proc around each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from inference_throughput import make_workload, start_server, wait_healthy  # noqa: E402


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_run(url: str, server_pid: int, stream: bool, prompts: list[list[int]], lengths: list[int]) -> dict:
    from areal_async.inference.client import InferenceClient
    from areal_async.types import SamplingParams

    async with InferenceClient([url], stream=stream, max_connections=4096, timeout_s=3600) as c:
        srv0, cli0, t0 = proc_cpu_s(server_pid), time.process_time(), time.perf_counter()
        results = await asyncio.gather(
            *(
                c.agenerate(p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
                for p, n in zip(prompts, lengths)
            )
        )
        wall = time.perf_counter() - t0
        srv_cpu, cli_cpu = proc_cpu_s(server_pid) - srv0, time.process_time() - cli0
    made = sum(len(r.output_ids) for r in results)
    if made != sum(lengths):
        raise RuntimeError(f"made {made} tokens, expected {sum(lengths)}")
    return {
        "wall_s": wall,
        "tokens_per_s": made / wall,
        "client_cpu_s": cli_cpu,
        "server_cpu_s": srv_cpu,
        "tokens": made,
        "outputs": [r.output_ids for r in results],
    }


async def bench(url: str, server_pid: int, workloads: dict[str, tuple[list, list]], rounds: int) -> dict:
    from areal_async.inference.client import InferenceClient

    async with InferenceClient([url]) as c:
        await wait_healthy(c)
    out: dict = {}
    for name, (prompts, lengths) in workloads.items():
        await one_run(url, server_pid, False, prompts[:4], [8] * len(prompts[:4]))  # warm-up: threads, caches
        runs: dict[str, list[dict]] = {"json": [], "stream": []}
        for r in range(rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for stream in order:
                runs["stream" if stream else "json"].append(await one_run(url, server_pid, stream, prompts, lengths))
        if any(a["outputs"] != b["outputs"] for a, b in zip(runs["json"], runs["stream"])):
            raise RuntimeError(f"{name}: streaming changed the greedy tokens")
        ratios = [s["tokens_per_s"] / j["tokens_per_s"] for j, s in zip(runs["json"], runs["stream"])]

        def med(mode: str, key: str) -> float:
            return statistics.median(x[key] for x in runs[mode])

        out[name] = {
            "requests": len(prompts),
            "tokens": sum(lengths),
            "longest": max(lengths),
            "json_tokens_per_s": med("json", "tokens_per_s"),
            "stream_tokens_per_s": med("stream", "tokens_per_s"),
            "ratio_each_round": ratios,
            "ratio_median": statistics.median(ratios),
            "json_client_cpu_s": med("json", "client_cpu_s"),
            "stream_client_cpu_s": med("stream", "client_cpu_s"),
            "json_server_cpu_s": med("json", "server_cpu_s"),
            "stream_server_cpu_s": med("stream", "server_cpu_s"),
            "runs": {m: [{k: v for k, v in x.items() if k != "outputs"} for x in xs] for m, xs in runs.items()},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="tiny model and workload: a smoke test, not a measurement")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--long-requests", type=int, default=None)
    ap.add_argument("--long-tokens", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="paired rounds (default 3; quick 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from areal_async.tasks.char_tokenizer import SPECIAL_TOKENS
    from areal_async.testing.tiny import make_tiny_checkpoint

    if args.quick:
        model_kw = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
        n_req, mean_new, sigma, max_new = args.requests or 8, 12.0, 0.5, 32
        n_long, long_tokens = args.long_requests or 2, args.long_tokens or 64
    else:
        model_kw = dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=768)
        n_req, mean_new, sigma, max_new = args.requests or 64, 96.0, 0.8, 512
        n_long, long_tokens = args.long_requests or 8, args.long_tokens or 1536
    rounds = args.rounds or (1 if args.quick else 3)

    with tempfile.TemporaryDirectory(prefix="bench_stream_") as tmp:
        model_dir = make_tiny_checkpoint(
            os.path.join(tmp, "model"), "qwen2", seed=args.seed, max_position_embeddings=2048, **model_kw
        )
        with open(os.path.join(model_dir, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        mixed = make_workload(n_req, args.seed, len(SPECIAL_TOKENS), vocab, mean_new, sigma, max_new)
        long_prompts, _ = make_workload(n_long, args.seed + 1, len(SPECIAL_TOKENS), vocab, 8.0, 0.1, 16)
        workloads = {"mixed": mixed, "long": (long_prompts, [long_tokens] * n_long)}
        proc, url = start_server(model_dir, args.threads, ["--max-total-tokens", "131072"])
        try:
            res = asyncio.run(bench(url, proc.pid, workloads, rounds))
        finally:
            proc.terminate()
            proc.wait(30)

    result = {
        "workloads": res,
        "settings": {
            "quick": args.quick,
            "rounds": rounds,
            "threads": args.threads,
            "model": model_kw,
            "greedy": True,
            "ignore_eos": True,
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        "| workload | requests x tokens | json tok/s | stream tok/s | stream / json (median) | client CPU s json "
        "/ stream | server CPU s json / stream |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, w in res.items():
        print(
            f"| {name} | {w['requests']} x {w['tokens'] // w['requests']} avg (longest {w['longest']}) | "
            f"{w['json_tokens_per_s']:.0f} | {w['stream_tokens_per_s']:.0f} | {w['ratio_median']:.2f} "
            f"({' / '.join(f'{r:.2f}' for r in w['ratio_each_round'])}) | {w['json_client_cpu_s']:.2f} / "
            f"{w['stream_client_cpu_s']:.2f} | {w['json_server_cpu_s']:.2f} / {w['stream_server_cpu_s']:.2f} |"
        )


if __name__ == "__main__":
    main()

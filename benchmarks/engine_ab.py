"""A/B of the embedded server across two versions of the code: both servers up at once, the same measurement taken
on each in turns, so that the host's slow and fast phases hit both alike.

    git worktree add /tmp/base HEAD~1
    python benchmarks/engine_ab.py --base /tmp/base --dtype float32 --rounds 8 --what batch1 \
        --out benchmarks/out/engine_ab.json

`--base` is a checkout of the version to compare with (its `areal_async` is imported through PYTHONPATH); the other
server runs this checkout. `--what`: `batch1` or `batch64` (decode tokens/s, as inference_throughput.py's decode
rates: 16 and 16 + `--steps` new tokens, the difference) or `workload` (its 64-request chat workload, useful
tokens/s). Each round measures both, in alternating order; the report is each side's median and the median of the
per-round ratios (new / base), with how many rounds the new code won.

Why its own script: under a VM the host moves a batch-1 step by up to ~1.4x for tens of seconds at a time, so two
runs minutes apart compare two moments of the host. A change of a few percent only shows in turns, seconds apart.
Both servers idle between their turns (an idle engine thread waits on a condition variable), so each turn has the
cores to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from contextlib import contextmanager
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_sides import decode_rate, embedded_run, start_server, stop, wait_healthy  # noqa: E402
from inference_throughput import make_chat_workload, make_workload, resolve_model  # noqa: E402


@contextmanager
def _pythonpath(path: str | None):
    """PYTHONPATH for a child started inside the block: `path` first, or nothing extra."""
    saved = os.environ.get("PYTHONPATH")
    if path:
        os.environ["PYTHONPATH"] = path
    else:
        os.environ.pop("PYTHONPATH", None)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


async def _rounds(urls: dict[str, str], prompts, lengths, args) -> dict[str, list[float]]:
    from areal_async.inference.client import InferenceClient

    clients = {k: InferenceClient([u], probe_interval_s=0.2) for k, u in urls.items()}
    out: dict[str, list[float]] = {k: [] for k in urls}
    try:
        for c in clients.values():
            await c.__aenter__()
            await wait_healthy(c)
            await decode_rate(c, prompts, 1, 8, 1)  # warm-up: kernels built, first steps taken
        for r in range(args.rounds):
            for side in ("base", "new") if r % 2 == 0 else ("new", "base"):
                c = clients[side]
                if args.what == "workload":
                    wall, _ = await embedded_run(c, prompts, lengths)
                    out[side].append(sum(lengths) / wall)
                else:
                    batch = 1 if args.what == "batch1" else 64
                    out[side].append((await decode_rate(c, prompts, batch, args.steps, 1))["tokens_per_s"])
            print(f"round {r}: base {out['base'][-1]:.1f}  new {out['new'][-1]:.1f} tokens/s", flush=True)
    finally:
        for c in clients.values():
            await c.__aexit__(None, None, None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="a checkout of the code to compare with")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--what", choices=["batch1", "batch64", "workload"], default="batch1")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64, help="decode steps a decode-rate measurement times")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not os.path.isdir(os.path.join(args.base, "areal_async")):
        sys.exit(f"--base {args.base}: no areal_async package there")
    import tempfile

    from transformers import AutoTokenizer

    from areal_async.host.cpu_features import describe

    with tempfile.TemporaryDirectory(prefix="engine_ab_") as tmp:
        model_dir = resolve_model(args.model, tmp, args.seed, False)
        tok = AutoTokenizer.from_pretrained(model_dir)
        if getattr(tok, "chat_template", None):
            prompts, lengths = make_chat_workload(tok, 64, args.seed, 96.0, 0.8, 384)
        else:  # a model without a chat template (`--model tiny`): random prompts, as inference_throughput.py
            with open(os.path.join(model_dir, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            prompts, lengths = make_workload(64, args.seed, 10, vocab, 96.0, 0.8, 384)
        procs: dict[str, Any] = {}
        try:
            for side, path in (("base", os.path.abspath(args.base)), ("new", None)):
                with _pythonpath(path):
                    procs[side] = start_server(
                        model_dir, args.threads, ["--threads", str(args.threads), "--dtype", args.dtype]
                    )
            load_start = os.getloadavg()
            rates = asyncio.run(_rounds({k: u for k, (_, u) in procs.items()}, prompts, lengths, args))
        finally:
            for proc, _ in procs.values():
                stop(proc)
    ratios = [n / b for b, n in zip(rates["base"], rates["new"])]
    res = {
        "what": args.what,
        "dtype": args.dtype,
        "base_tokens_per_s": rates["base"],
        "new_tokens_per_s": rates["new"],
        "base_median": statistics.median(rates["base"]),
        "new_median": statistics.median(rates["new"]),
        "ratio_median": statistics.median(ratios),
        "new_faster_rounds": sum(x > 1 for x in ratios),
        "settings": {**vars(args), "cpu": describe(), "load_average": [load_start, os.getloadavg()]},
    }
    print(
        f"{args.what} {args.dtype}: base {res['base_median']:.1f}, new {res['new_median']:.1f} tokens/s (medians); "
        f"new / base {res['ratio_median']:.3f}, new faster in {res['new_faster_rounds']} of {args.rounds} rounds"
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()

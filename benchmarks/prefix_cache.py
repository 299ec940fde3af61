"""What sharing prompt pages saves the embedded engine on RL rollouts: G samples of each prompt, sent together.

The engine alone (no HTTP), one torch thread, the default base model and the default task's prompts: rounds of
16 prompts x 8 samples at temperature 1 (a rollout batch of the default run), with the prefix cache on and off,
alternating round by round so that drift in the machine's speed hits both alike. Reports seconds per round, the
engine's busy seconds, generated tokens/s and how many prompt tokens were mapped instead of computed.

    python benchmarks/prefix_cache.py --out benchmarks/out/prefix_cache.json [--rounds 6] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time


async def _round(engine, prompts: list[list[int]], group: int, max_new: int, tag: str) -> dict:
    from areal_async.protocol.engine_api import EngineRequest, EngineSampling

    async def one(i: int, ids: list[int]) -> tuple[int, int]:
        req = EngineRequest(
            rid=f"{tag}-{i}",
            input_ids=ids,
            return_logprob=True,
            sampling=EngineSampling(max_new_tokens=max_new, temperature=1.0),
        )
        n, cached = 0, 0
        async for chunk in engine.generate(req):
            n += len(chunk.new_ids)
            cached = chunk.cached_tokens
        return n, cached

    busy0, t0 = engine.busy_s, time.perf_counter()
    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(q for q in prompts for _ in range(group))))
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "busy_s": engine.busy_s - busy0,
        "tokens": sum(n for n, _ in results),
        "cached_prompt_tokens": sum(c for _, c in results),
        "prompt_tokens": sum(len(p) for p in prompts) * group,
    }


async def _main(args: argparse.Namespace, model: str, prompts: list[list[int]]) -> dict:
    from areal_async.server.engine import AsyncEngine

    engines = {on: AsyncEngine(model, device="cpu", prefix_cache=on) for on in (True, False)}
    for e in engines.values():
        await e.start()
    rounds: dict[bool, list[dict]] = {True: [], False: []}
    try:
        for r in range(args.rounds):
            batch = prompts[(r * args.prompts) % len(prompts) :][: args.prompts]
            for on in (True, False) if r % 2 == 0 else (False, True):  # alternate which goes first
                rounds[on].append(await _round(engines[on], batch, args.group, args.max_new_tokens, f"r{r}{on}"))
    finally:
        for e in engines.values():
            await e.shutdown()
    out = {}
    for on, rs in rounds.items():
        key = "prefix_cache_on" if on else "prefix_cache_off"
        out[key] = {
            "wall_s_per_round": statistics.median(x["wall_s"] for x in rs),
            "busy_s_per_round": statistics.median(x["busy_s"] for x in rs),
            "tokens_per_s": sum(x["tokens"] for x in rs) / sum(x["wall_s"] for x in rs),
            "cached_prompt_frac": sum(x["cached_prompt_tokens"] for x in rs)
            / max(sum(x["prompt_tokens"] for x in rs), 1),
            "rounds": rs,
        }
    out["speedup_wall"] = out["prefix_cache_off"]["wall_s_per_round"] / out["prefix_cache_on"]["wall_s_per_round"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--quick", action="store_true", help="tiny random model, 2 prompts x 2 samples, 2 rounds")
    args = ap.parse_args()

    import torch

    from areal_async.tasks import arith
    from areal_async.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tmp = tempfile.TemporaryDirectory()
    if args.quick:
        from areal_async.testing.tiny import make_tiny_checkpoint

        args.rounds, args.prompts, args.group, args.max_new_tokens = 2, 2, 2, 8
        model = make_tiny_checkpoint(os.path.join(tmp.name, "qwen2"), "qwen2")
    else:
        from areal_async.tasks.base_model import ensure_base_model

        model = ensure_base_model()
    tok = Tokenizer(model)
    rng = random.Random(0)
    prompts = [tok.encode(arith.prompt_of(arith.random_problem(rng))) for _ in range(args.prompts * args.rounds)]
    result = asyncio.run(_main(args, model, prompts))
    result["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    result["env"] = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(
        f"{args.rounds} rounds of {args.prompts} prompts x {args.group} samples, max_new_tokens "
        f"{args.max_new_tokens}, load {os.getloadavg()[0]:.2f}"
    )
    print("| prefix cache | s per round | busy s per round | tokens/s | prompt tokens mapped |")
    print("|---|---|---|---|---|")
    for key in ("prefix_cache_on", "prefix_cache_off"):
        r = result[key]
        print(
            f"| {key.rsplit('_', 1)[1]} | {r['wall_s_per_round']:.3f} | {r['busy_s_per_round']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {100 * r['cached_prompt_frac']:.0f}% |"
        )
    print(f"speed-up (s per round): {result['speedup_wall']:.2f}x")
    tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())

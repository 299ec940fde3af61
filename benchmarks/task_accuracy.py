"""Greedy accuracy of a model on a dataset's held-out split(s), through the embedded server over HTTP.

    python benchmarks/task_accuracy.py --model smollm2-135m-instruct \\
        --datasets word_problems,word_problems_other --num 200 --out benchmarks/out/task_accuracy.json

What it measures is what a run's eval measures: the prompts come from `load_samples` (chat template on unless
--no-chat-template), the server is `python -m areal_async.serve` on the resolved model (a built-in name, a .gguf
file, an HF directory or a run's checkpoint), decoding is greedy, and each completion is graded by the reward named
by --reward (default `math`, math-verify). Use it for the base model's accuracy before RL and for a final
checkpoint's accuracy on other phrasings after it. Accuracy is reported per dataset and per difficulty level
(`Sample.meta["level"]` when present), with the mean completion length; no speed is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

import aiohttp

from areal_async.config import DataConfig
from areal_async.model_store import resolve_model_path
from areal_async.rewards import registry
from areal_async.server.cli import READY_PREFIX
from areal_async.tasks.datasets import load_samples
from areal_async.tokenizer import Tokenizer


def start_server(model: str, threads: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_async.serve",
            "--model",
            model,
            "--port",
            "0",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-running-requests",
            "256",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    for line in proc.stdout:
        if line.startswith(READY_PREFIX):
            return proc, line[len(READY_PREFIX) :].strip()
    proc.wait()
    raise SystemExit(f"the server for {model} did not start (exit status {proc.returncode})")


async def generate_all(
    url: str, prompts: list[list[int]], max_new: int, concurrency: int, samples: int, temperature: float
) -> list[list[dict]]:
    """`samples` completions per prompt (greedy when temperature is 0)."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:

        async def one(ids: list[int]) -> list[dict]:
            async with sem:
                body = {
                    "input_ids": [ids] * samples if samples > 1 else ids,
                    "sampling_params": {"temperature": temperature, "max_new_tokens": max_new},
                }
                async with http.post(url + "/generate", json=body) as r:
                    r.raise_for_status()
                    out = await r.json()
                    return out if isinstance(out, list) else [out]

        return await asyncio.gather(*(one(p) for p in prompts))


def measure(
    model_dir: str,
    url: str,
    dataset: str,
    num: int,
    seed: int,
    chat: bool,
    reward: str,
    max_new: int,
    concurrency: int,
    samples: int = 1,
    temperature: float = 0.0,
    split: str = "eval",
) -> dict[str, Any]:
    """Accuracy on `split` ("eval": the dataset's held-out prompts; "train": its first training prompts)."""
    tok = Tokenizer(model_dir)
    train, held = load_samples(
        DataConfig(
            name=dataset, num_train=num if split == "train" else 1, num_eval=num, seed=seed, apply_chat_template=chat
        )
    )
    items = (train if split == "train" else held)[:num]
    prompts = [tok.apply_chat_template(s.messages) if s.messages else tok.encode(s.prompt) for s in items]
    t0 = time.perf_counter()
    outs = asyncio.run(generate_all(url, prompts, max_new, concurrency, samples, temperature))
    seconds = time.perf_counter() - t0
    score = registry.load(registry.resolve(reward).target)
    per_level: dict[str, list[list[float]]] = defaultdict(list)
    rows = []
    for s, group in zip(items, outs):
        rs = [registry.call_reward(score, o["text"], s.answer, s.prompt, s.meta) for o in group]
        per_level[str(s.meta.get("level", "all"))].append(rs)
        rows.append(
            {
                "id": s.id,
                "prompt": s.prompt,
                "answer": s.answer,
                "completions": [o["text"] for o in group],
                "rewards": rs,
                "completion_tokens": [o["meta_info"]["completion_tokens"] for o in group],
                "finish": [o["meta_info"]["finish_reason"]["type"] for o in group],
                **s.meta,
            }
        )

    def summary(groups: list[list[float]]) -> dict[str, Any]:
        flat = [r for g in groups for r in g]
        return {
            "num": len(groups),
            "accuracy": sum(flat) / len(flat),
            "pass_at_k": sum(max(g) > 0 for g in groups) / len(groups),
        }

    tokens = [t for r in rows for t in r["completion_tokens"]]
    return {
        "dataset": dataset,
        "split": split,
        "samples_per_prompt": samples,
        "temperature": temperature,
        **summary([r["rewards"] for r in rows]),
        "by_level": {k: summary(v) for k, v in sorted(per_level.items())},
        "mean_completion_tokens": sum(tokens) / len(tokens),
        "truncated": sum(f == "length" for r in rows for f in r["finish"]),
        "seconds": round(seconds, 1),
        "samples": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model.path: a built-in name, .gguf or HF dir")
    ap.add_argument("--datasets", default="word_problems,word_problems_other")
    ap.add_argument("--num", type=int, default=200, help="held-out prompts per dataset")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reward", default="math")
    ap.add_argument("--no-chat-template", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument("--samples", type=int, default=1, help="completions per prompt (reports pass@k too)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ap.add_argument(
        "--split",
        choices=("eval", "train"),
        default="eval",
        help="held-out prompts, or the first training prompts (to see the learning signal)",
    )
    ap.add_argument("--out", default="benchmarks/out/task_accuracy.json")
    args = ap.parse_args()

    model_dir = resolve_model_path(args.model)
    proc, url = start_server(model_dir, args.threads)
    try:
        results = [
            measure(
                model_dir,
                url,
                d,
                args.num,
                args.seed,
                not args.no_chat_template,
                args.reward,
                args.max_new_tokens,
                args.concurrency,
                args.samples,
                args.temperature,
                args.split,
            )
            for d in args.datasets.split(",")
        ]
    finally:
        proc.terminate()
        proc.wait(30)
    report = {
        "model": args.model,
        "model_dir": model_dir,
        "reward": args.reward,
        "seed": args.seed,
        "chat_template": not args.no_chat_template,
        "max_new_tokens": args.max_new_tokens,
        "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    print(
        f"model {args.model} ({model_dir}), {mode}, {args.samples} per prompt, reward {args.reward}, "
        f"max {args.max_new_tokens} new tokens, {args.split} prompts"
    )
    print(
        f"| dataset | prompts | accuracy % | pass@{args.samples} % | by level (prompts: acc %, pass %) | "
        "mean tokens | truncated | s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        levels = ", ".join(
            f"L{k} ({v['num']}): {100 * v['accuracy']:.1f}, {100 * v['pass_at_k']:.0f}"
            for k, v in r["by_level"].items()
        )
        print(
            f"| {r['dataset']} | {r['num']} | {100 * r['accuracy']:.1f} | {100 * r['pass_at_k']:.1f} | {levels} | "
            f"{r['mean_completion_tokens']:.1f} | {r['truncated']} | {r['seconds']} |"
        )
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()

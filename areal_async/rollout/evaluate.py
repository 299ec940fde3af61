"""Held-out evaluation through the same inference servers: greedy decoding, accuracy by the task's reward."""

from __future__ import annotations

import asyncio
import time

from areal_async import progress
from areal_async.rollout.prompts import prompt_ids
from areal_async.rollout.workflow_api import Generator, ScoreFn, score_sample
from areal_async.tokenizer import Tokenizer
from areal_async.types import Sample, SamplingParams


async def evaluate(
    client: Generator,
    tokenizer: Tokenizer,
    samples: list[Sample],
    score: ScoreFn,
    *,
    max_new_tokens: int,
    use_chat_template: bool = False,
    concurrency: int = 256,
    priority: int | None = None,
) -> dict[str, float]:
    """Greedy accuracy on `samples` (a reward >= 0.5 counts as correct), mean completion length, seconds, and the
    lowest and highest weight version among the generated tokens (equal when the weights held still throughout;
    -1 when nothing was generated). `priority` is passed to every request: an eval beside running rollouts (the
    train step's weight sync waits for it) should not queue behind them. A progress bar counts the scored prompts
    when stderr is a terminal (areal_async/progress.py)."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    sem = asyncio.Semaphore(concurrency)
    extra = {} if priority is None else {"priority": priority}  # a Generator without priority support still works
    t0 = time.monotonic()

    async def one(s: Sample) -> tuple[float, int, int, int]:
        ids = prompt_ids(tokenizer, s, use_chat_template)
        async with sem:
            g = await client.agenerate(ids, sampling, rid=None, **extra)
        reward, _ = await score_sample(score, tokenizer.decode(g.output_ids), s)
        vers = g.output_versions
        shown.update(1)
        return reward, len(g.output_ids), min(vers, default=-1), max(vers, default=-1)

    with progress.shown(len(samples), "eval", unit="prompt", leave=False) as shown:
        results = await asyncio.gather(*(one(s) for s in samples))
    n = max(len(results), 1)
    generated = [r for r in results if r[1]]
    return {
        "accuracy": sum(1.0 for r in results if r[0] >= 0.5) / n,
        "mean_reward": sum(r[0] for r in results) / n,
        "mean_len": sum(r[1] for r in results) / n,
        "seconds": time.monotonic() - t0,
        "num": float(len(results)),
        "min_version": float(min((r[2] for r in generated), default=-1)),
        "max_version": float(max((r[3] for r in generated), default=-1)),
    }

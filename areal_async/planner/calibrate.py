"""Cost terms from a profile of the real stack on this machine, instead of from data sheets.

What a profile holds (benchmarks/planner_accuracy.py measures it): the embedded server's time for a batch of n
requests to generate L tokens, at several n and two L (the difference is pure decode at batch n); its time for a
batch of one-token requests (prefill); the response lengths the real workflow produces from the real prompts; and,
from a short synchronous run of the whole stack, the trainer's seconds per step with the tokens each step held, and
the weight publish and load seconds per step, and the mean response length of each of its steps.

Why this shape: it is what the simulator's cost terms mean, measured where they arise (through the same HTTP
client, the same engine, the same trainer), and none of it is a speedup: the planner is then checked against the
measured speedups of benchmarks/sync_vs_async.py, which it never sees.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from areal_async.planner.lengths import LengthModel
from areal_async.planner.server_model import ServerCosts
from areal_async.planner.simulate import Setting
from areal_async.planner.trainer_model import TrainerCosts


@dataclass
class Profile:
    """Raw measurements (seconds, tokens). `decode`: (n, seconds per decode step at batch n) pairs; `prefill_s`
    over `prefill_tokens` prompt tokens; `lengths`: response lengths; `prompt_tokens`: the mean prompt length;
    `train_steps`: (seconds, tokens) of each profiled train step; `publish_s` and `load_s`: per weight sync;
    `run_lengths_mean`: the mean response length of each profiled train step (empty: lengths do not change)."""

    decode: list[tuple[int, float]]
    prefill_s: float
    prefill_tokens: int
    lengths: list[int]
    prompt_tokens: float
    train_steps: list[tuple[float, float]]
    publish_s: float
    load_s: float
    max_new_tokens: int
    kv_capacity_tokens: int
    max_running: int
    extra: dict[str, Any] = field(default_factory=dict)
    run_lengths_mean: list[float] = field(default_factory=list)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x; a flat line through the mean for a single point."""
    if len(points) == 1:
        return points[0][1], 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def server_from_profile(p: Profile) -> ServerCosts:
    """A CPU server: decode step = a + b n (the context's KV folded into b: the profile's contexts are those of
    the task), additive rather than a roofline, prefill at the measured seconds per prompt token."""
    a, b = fit_line([(float(n), s) for n, s in p.decode])
    return ServerCosts(
        step_overhead_s=max(a, 0.0),
        weights_s=0.0,
        kv_s=0.0,
        seq_s=max(b, 0.0),
        attn_s=0.0,
        additive=True,
        prefill_token_s=p.prefill_s / max(p.prefill_tokens, 1),
        kv_capacity_tokens=p.kv_capacity_tokens,
        max_running=p.max_running,
        prefix_sharing=True,
        pause_s=0.0,
        load_s=p.load_s,
    )


def trainer_from_profile(p: Profile) -> TrainerCosts:
    """Seconds per trained token: the median over the profiled steps (the first, a warm-up, left out when there
    are more), everything else of a step folded in."""
    steps = p.train_steps[1:] if len(p.train_steps) > 2 else p.train_steps
    per_token = statistics.median(s / t for s, t in steps if t > 0)
    return TrainerCosts(token_s=per_token, publish_s=p.publish_s)


def length_trend(run_means: list[float], base_mean: float) -> list[float]:
    """Per-version length multipliers (LengthModel.version_scale) from the profile run's mean response length per
    step, over the mean of the base answers (`lengths`). Why: RL changes answer lengths from the first steps on
    (the default task's answers roughly double within six steps), and generation time follows them, so base-model
    lengths alone undercount every step's generation. Versions the profile ran take their step's mean; later ones
    hold the mean of its second half: a single step's mean moves by a quarter step to step, and nothing measured
    says where the trend goes beyond the profile, so it is held, not extrapolated."""
    if not run_means or base_mean <= 0:
        return []
    tail = run_means[len(run_means) // 2 :]
    return [m / base_mean for m in run_means] + [statistics.fmean(tail) / base_mean]


def setting_from_profile(
    p: Profile,
    *,
    batch_size: int,
    group_size: int,
    steps: int,
    max_concurrent_groups: int | None = None,
    interrupt_mode: str = "abort",
    servers: int = 1,
    seed: int = 0,
) -> Setting:
    lengths = LengthModel(
        kind="empirical",
        samples=list(p.lengths),
        max_new_tokens=p.max_new_tokens,
        prompt_tokens=int(round(p.prompt_tokens)),
        version_scale=length_trend(p.run_lengths_mean, statistics.fmean(p.lengths)),
    )
    return Setting(
        server=server_from_profile(p),
        trainer=trainer_from_profile(p),
        servers=servers,
        lengths=lengths,
        batch_size=batch_size,
        group_size=group_size,
        steps=steps,
        max_concurrent_groups=max_concurrent_groups,
        interrupt_mode=interrupt_mode,
        seed=seed,
    )

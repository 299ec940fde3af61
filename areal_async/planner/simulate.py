"""One planned run in virtual time: the real `AsyncRLController` (and so the real `RolloutManager`,
`StalenessBuffer`, `SampleLedger`, `SampleStream` and `update_weights`) driving a `SimFleet` and a `SimTrainer`.

What is real and what is simulated: everything the schedule decides is the shipped code, unchanged: when a group
may start (the admission rule), which finished groups make a batch and when (the batch rule), the train step, the
weight sync with its pause, load and continue, the version steps, rejected groups freeing their slots. The servers,
the trainer and the weight transport are models (server_model.py, trainer_model.py), and the workflow is the
planner's: it draws each sample's length, asks the fleet for the whole group at once and returns one compact
trajectory per group (a segment per policy version that sampled part of it, with token counts in `info`), so the
controller's per-token bookkeeping costs a few entries per group instead of tens of thousands. The sample counts
and token-weighted staleness are the planner's own (from the simulated trainer); the controller's histogram counts
segments.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from areal_async.config import ScheduleConfig
from areal_async.planner.clock import run_virtual
from areal_async.planner.fleet import SimFleet
from areal_async.planner.lengths import LengthModel
from areal_async.planner.server_model import ServerCosts
from areal_async.planner.trainer_model import (
    PROMPT_KEY,
    SAMPLES_KEY,
    SUMSQ_KEY,
    TOKENS_KEY,
    SimTrainer,
    SimWeightSync,
    TrainerCosts,
    version_key,
)
from areal_async.rollout.controller import AsyncRLController
from areal_async.rollout.samples import SampleStream
from areal_async.rollout.workflow_api import Generator
from areal_async.types import Sample, Trajectory


@dataclass
class Setting:
    """What one simulated run needs: the two sides' costs and sizes, the lengths, and the schedule."""

    server: ServerCosts
    trainer: TrainerCosts
    servers: int
    lengths: LengthModel
    batch_size: int = 16  # B, prompt groups per step
    group_size: int = 8  # samples per prompt
    steps: int = 20
    max_concurrent_groups: int | None = None  # None: (eta + 1) x B, the most the staleness rule lets run
    interrupt_mode: str = "abort"  # abort, in_place, or wait (no interruption)
    seed: int = 0


@dataclass
class RunResult:
    """One simulated run: wall time in virtual seconds and what each side did in it."""

    mode: str
    eta: int | None
    wall_s: float
    steps: int
    samples: int
    tokens: int
    samples_per_s: float
    tokens_per_s: float
    gen_busy_frac: float
    trainer_busy_frac: float
    staleness_hist: dict[int, int]
    staleness_mean: float
    staleness_max: int
    step_wall_s: list[float] = field(default_factory=list)
    wait_batch_s: float = 0.0
    train_s: float = 0.0
    weight_sync_s: float = 0.0
    groups_rejected: int = 0
    recomputed_tokens: float = 0.0
    sim_seconds: float = 0.0  # the CPU wall time the simulation took

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["staleness_hist"] = {str(k): v for k, v in sorted(self.staleness_hist.items())}
        return d


class PlanWorkflow:
    """The planner's workflow: draws the group's lengths, generates them on the fleet, rejects a share of groups,
    and returns one compact trajectory for the group (see the module docstring)."""

    def __init__(self, lengths: LengthModel, group_size: int, seed: int, version: Any) -> None:
        self.lengths = lengths
        self.group_size = group_size
        self.rng = np.random.default_rng(seed)
        self.draw = lengths.sampler(self.rng)
        self.version = version  # () -> the policy version now (lengths may grow over training)

    async def run(self, client: Generator, sample: Sample) -> list[Trajectory] | None:
        assert isinstance(client, SimFleet)
        lm = self.lengths
        lens = self.draw(self.group_size, self.version())
        by_version = await client.generate_group(lens, lm.prompt_tokens)
        if lm.reject_rate > 0 and self.rng.random() < lm.reject_rate:
            return None
        versions = sorted(by_version)
        n = len(versions)
        p, total = lm.prompt_tokens, sum(lens)
        if isinstance(p, int):  # sum of (p + x)^2, expanded: exact in integers, and no generator per group
            sumsq = float(len(lens) * p * p + 2 * p * total + sum(map(operator.mul, lens, lens)))
        else:
            sumsq = float(sum((p + x) ** 2 for x in lens))
        info: dict[str, float | int | str | bool] = {
            "finish": "stop",
            TOKENS_KEY: total,
            PROMPT_KEY: p,
            SAMPLES_KEY: self.group_size,
            SUMSQ_KEY: sumsq,
        }
        for v in versions:
            info[version_key(v)] = by_version[v]
        return [
            Trajectory(
                input_ids=[0] * (n + 1),
                loss_mask=[0] + [1] * n,
                logprobs=[0.0] * (n + 1),
                versions=[-1] + versions,
                reward=0.0,
                prompt_len=1,
                info=info,
            )
        ]


class _Records:
    """The controller's logger: keeps each train record."""

    def __init__(self) -> None:
        self.train: list[dict[str, Any]] = []

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if kind == "train":
            self.train.append(values)


async def _run(setting: Setting, eta: int | None, mode: str) -> RunResult:
    loop = asyncio.get_running_loop()
    fleet = SimFleet(setting.server, setting.servers, loop)
    trainer = SimTrainer(setting.trainer)
    weights = SimWeightSync(trainer, fleet)
    effective = 0 if mode == "sync" else eta
    b = setting.batch_size
    cap = setting.max_concurrent_groups or (b * (effective + 1) if effective is not None else 4 * b)
    im = setting.interrupt_mode
    schedule = ScheduleConfig(
        mode="sync" if mode == "sync" else "async",
        eta=eta if mode != "sync" else 0,
        batch_size=b,
        max_concurrent_groups=cap,
        interruptible=im != "wait",
        interrupt_mode="in_place" if im == "in_place" else "abort",
        total_steps=setting.steps,
        eval_every=0,
        checkpoint_every=0,
        max_consecutive_failures=10**9,
    )
    records = _Records()
    # the workflow never reads the sample; a dataset of one would make every draw an epoch of its own (a seeded
    # shuffle per group), so the stream holds the same sample many times: one shuffle per 4,096 draws
    stream = SampleStream([Sample(id=0, prompt="", answer="")] * 4096, seed=setting.seed)
    holder: dict[str, AsyncRLController] = {}
    workflow = PlanWorkflow(setting.lengths, setting.group_size, setting.seed, lambda: holder["c"].buffer.version)
    ctrl = AsyncRLController(
        schedule,
        fleet,
        trainer,
        workflow,
        stream,
        "planner-run-dir-unused",
        weights=weights,
        logger=records,
        pace_gc=False,
    )
    holder["c"] = ctrl
    t0 = loop.time()
    await ctrl.run()
    wall = loop.time() - t0
    fs = fleet.stats(wall)
    fleet.release()
    holder.clear()  # the controller's cycle through the workflow's version callback
    hist = dict(trainer.staleness)
    total = sum(hist.values())
    walls = [r["wall_s"] for r in records.train]
    return RunResult(
        mode=mode,
        eta=effective,
        wall_s=wall,
        steps=trainer.steps,
        samples=trainer.samples,
        tokens=trainer.tokens,
        samples_per_s=trainer.samples / wall,
        tokens_per_s=trainer.tokens / wall,
        gen_busy_frac=fs["busy_frac"],
        trainer_busy_frac=trainer.busy_s / wall,
        staleness_hist=hist,
        staleness_mean=sum(k * v for k, v in hist.items()) / total if total else 0.0,
        staleness_max=max(hist) if hist else 0,
        step_wall_s=[b - a for a, b in zip([0.0, *walls[:-1]], walls)],
        wait_batch_s=ctrl.timings["wait_batch_s"],
        train_s=ctrl.timings["train_s"],
        weight_sync_s=ctrl.timings["publish_s"] + ctrl.timings["weight_load_s"],
        groups_rejected=ctrl.rollout.stats.rejected,
        recomputed_tokens=fs["recomputed_tokens"],
    )


def simulate(setting: Setting, mode: str = "async", eta: int | None = 1) -> RunResult:
    """Run one mode ("sync", or "async" with `eta`) of `setting` in virtual time; returns what it predicts."""
    setting.lengths.validate()
    t0 = time.perf_counter()
    logging.getLogger("areal_async.rollout.controller").setLevel(logging.WARNING)
    # the collector off while it runs: a large plan holds millions of live objects (groups, ledger entries,
    # timers) and CPython's full collections, which find nothing here, would cost a third of the run or more. Off
    # is enough (no collection, so nothing to freeze out of one); the caller's own freeze, if any, is left alone
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        result = run_virtual(_run(setting, eta, mode))
    finally:
        if was_enabled:
            gc.enable()
    result.sim_seconds = time.perf_counter() - t0
    return result

"""A plan: the scenario run in sync mode and in async mode at each eta; and the recommendation: the split of GPUs,
eta and concurrency with the highest predicted throughput, from a grid of shorter runs.

Why shorter runs for the grid: a configuration's throughput settles after a few steps (the pipeline fills within
eta + 1 steps), and the grid is many configurations; the chosen one is then reported from the plan's full-length
runs where it is among them. `sweep_steps` says how short.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from areal_async.planner.scenario import Scenario
from areal_async.planner.simulate import RunResult, simulate


@dataclass
class PlanResult:
    """Sync and each eta for one scenario, plus (optionally) the recommendation."""

    scenario: Scenario
    runs: list[RunResult]
    recommendation: dict[str, Any] | None = None
    sim_seconds: float = 0.0

    @property
    def sync(self) -> RunResult:
        return next(r for r in self.runs if r.mode == "sync")

    def speedup(self, run: RunResult) -> float:
        """Wall time of sync over that of `run`, both training the same samples."""
        return self.sync.wall_s / run.wall_s

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.describe(),
            "runs": [{**r.to_json(), "speedup_vs_sync": self.speedup(r)} for r in self.runs],
            "recommendation": self.recommendation,
            "sim_seconds": self.sim_seconds,
        }


def run_plan(scenario: Scenario, etas: tuple[int, ...] = (1, 2, 4, 8)) -> PlanResult:
    """Sync, then async at each eta, all at the scenario's split and step count."""
    t0 = time.perf_counter()
    setting = scenario.setting()
    runs = [simulate(setting, "sync")]
    runs += [simulate(setting, "async", eta) for eta in etas]
    return PlanResult(scenario, runs, sim_seconds=time.perf_counter() - t0)


@dataclass
class Grid:
    """What the recommendation searches: generation shares of the GPUs, etas, and concurrency caps as multiples of
    (eta + 1) x B (1.0: the most the staleness rule admits; less leaves KV room per request)."""

    gen_fracs: tuple[float, ...] = (0.5, 0.625, 0.75, 0.875)
    etas: tuple[int, ...] = (1, 2, 4, 8)
    concurrency: tuple[float, ...] = (1.0, 0.5)
    sweep_steps: int = 8
    candidates: list[dict[str, Any]] = field(default_factory=list)


def recommend(scenario: Scenario, grid: Grid | None = None) -> dict[str, Any]:
    """The best (split, eta, concurrency) by predicted samples/s, with its speedup over the best sync split."""
    g = grid or Grid()
    short = replace(scenario, steps=min(scenario.steps, g.sweep_steps))
    rows: list[dict[str, Any]] = []
    best_sync: dict[str, Any] | None = None
    for frac in g.gen_fracs:
        try:
            s = short.with_split(frac)
            gen, train = s.split()
        except ValueError:
            continue
        sync = simulate(s.setting(), "sync")
        row = {
            "gen_frac": frac,
            "gen_gpus": gen,
            "train_gpus": train,
            "mode": "sync",
            "eta": 0,
            "max_concurrent_groups": scenario.batch_size,
            "samples_per_s": sync.samples_per_s,
        }
        rows.append(row)
        if best_sync is None or row["samples_per_s"] > best_sync["samples_per_s"]:
            best_sync = row
        for eta in g.etas:
            for mult in g.concurrency:
                cap = max(scenario.batch_size, int(round(mult * (eta + 1) * scenario.batch_size)))
                r = simulate(replace(s, max_concurrent_groups=cap).setting(), "async", eta)
                rows.append(
                    {
                        "gen_frac": frac,
                        "gen_gpus": gen,
                        "train_gpus": train,
                        "mode": "async",
                        "eta": eta,
                        "max_concurrent_groups": cap,
                        "samples_per_s": r.samples_per_s,
                        "gen_busy_frac": r.gen_busy_frac,
                        "trainer_busy_frac": r.trainer_busy_frac,
                        "staleness_mean": r.staleness_mean,
                    }
                )
    if best_sync is None:
        raise ValueError("no split of the grid fits the scenario")
    best = max((r for r in rows if r["mode"] == "async"), key=lambda r: r["samples_per_s"])
    return {
        "best": best,
        "best_sync": best_sync,
        "speedup_vs_best_sync": best["samples_per_s"] / best_sync["samples_per_s"],
        "sweep_steps": short.steps,
        "candidates": rows,
    }

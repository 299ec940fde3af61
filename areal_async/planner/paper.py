"""The AReaL paper's setting as planner input, and its reported figures beside the planner's predictions.

    python -m areal_async.planner.paper [--steps 20] [--json FILE]

Why in the package: docs/planner.md quotes this comparison, and a reader should be able to re-run it with one
command (and change an assumption to see how much the answer moves). The paper's numbers below are the check,
never an input: nothing here reads them before predicting.

The paper (arXiv 2505.24298) trains R1-Distill-Qwen 1.5B-32B on H800 nodes (8 GPUs each), 75% of the GPUs
generating and 25% training, batch 512 prompts x 16 answers, 4 PPO minibatches, eta 8 for math and 4 for code,
answers of up to 32k tokens. The inference servers' tensor-parallel size comes from the authors' own benchmark script
(PAPER_RUNS); what neither states is assumed (docs/planner.md, "Measured, specified, assumed"): the length
distribution below the 32k cap, 14B's TP, and every efficiency.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from typing import Any

from areal_async.planner.lengths import LengthModel
from areal_async.planner.scenario import Scenario
from areal_async.planner.simulate import simulate


@dataclass(frozen=True)
class PaperRun:
    """One row of the paper's headline table: model, task, GPUs, eta, sync and async hours and their ratio."""

    model: str
    task: str
    gpus: int
    eta: int
    sync_h: float
    async_h: float
    speedup: float
    tp: int  # the inference servers' TP size (the paper does not state it; see PAPER_RUNS)


# Inference TP: the paper's text does not give it, but the AReaL authors' own benchmark of this setting
# (inclusionAI/AReaL, benchmark/verl_312a8cb/build_cmd.py: R1-Distill-Qwen 1.5B, 7B and 32B, 512 x 16, 75% of the
# GPUs on SGLang) serves 1.5B and 7B at TP 1 and 32B at TP 8 (`sglang_tp = 1 if model_size < 32 else 8`). 14B is
# not in that script (it takes sizes 1, 7 and 32 only): its TP 2 stays an assumption (docs/planner.md).
PAPER_RUNS = [
    PaperRun("1.5b", "AIME24 (math)", 128, 8, 41.0, 14.8, 2.77, 1),
    PaperRun("7b", "AIME24 (math)", 192, 8, 57.7, 25.4, 2.27, 1),
    PaperRun("14b", "LiveCodeBench (code)", 256, 4, 48.8, 21.9, 2.23, 2),
    PaperRun("32b", "LiveCodeBench (code)", 384, 4, 51.1, 31.1, 1.64, 8),
]

# the staleness ablation (1.5B): effective training throughput in tokens/s at eta 0 (sync), 1 and 4
PAPER_ABLATION_TOKENS_S = {0: 129e3, 1: 270e3, 4: 357e3}

# assumed: reasoning answers with a median of 8k tokens and a long tail, cut at 32k (the paper gives the cap only)
PAPER_LENGTHS = LengthModel(median=8000, sigma=0.7, max_new_tokens=32768, prompt_tokens=300)


def paper_scenario(run: PaperRun, steps: int, gpus: int | None = None) -> Scenario:
    return Scenario(
        gpu="H800",
        model=run.model,
        gpus=gpus or run.gpus,
        gen_frac=0.75,
        tp=run.tp,
        batch_size=512,
        group_size=16,
        steps=steps,
        lengths=replace(PAPER_LENGTHS),
        minibatches=4,
    )


def headline(steps: int = 20) -> list[dict[str, Any]]:
    """Each headline row: the paper's speedup and the planner's (sync against async at the paper's eta)."""
    rows = []
    for run in PAPER_RUNS:
        setting = paper_scenario(run, steps).setting()
        sync = simulate(setting, "sync")
        asy = simulate(setting, "async", run.eta)
        pred = sync.wall_s / asy.wall_s
        rows.append(
            {
                "model": run.model,
                "task": run.task,
                "gpus": run.gpus,
                "eta": run.eta,
                "tp": run.tp,
                "paper_speedup": run.speedup,
                "predicted_speedup": pred,
                "error": pred / run.speedup - 1.0,
                "sync_samples_per_s": sync.samples_per_s,
                "async_samples_per_s": asy.samples_per_s,
                "sync_tokens_per_s": sync.tokens_per_s,
                "async_tokens_per_s": asy.tokens_per_s,
                "gen_busy_sync": sync.gen_busy_frac,
                "gen_busy_async": asy.gen_busy_frac,
                "trainer_busy_sync": sync.trainer_busy_frac,
                "trainer_busy_async": asy.trainer_busy_frac,
            }
        )
    return rows


def ablation(steps: int = 20) -> list[dict[str, Any]]:
    """The 1.5B staleness ablation's throughput ratios (eta 1 and 4 over sync), paper against planner."""
    setting = paper_scenario(PAPER_RUNS[0], steps).setting()
    sync = simulate(setting, "sync")
    rows = [
        {
            "eta": 0,
            "paper_tokens_per_s": PAPER_ABLATION_TOKENS_S[0],
            "predicted_tokens_per_s": sync.tokens_per_s,
            "paper_ratio": 1.0,
            "predicted_ratio": 1.0,
        }
    ]
    for eta in (1, 4):
        r = simulate(setting, "async", eta)
        paper = PAPER_ABLATION_TOKENS_S[eta] / PAPER_ABLATION_TOKENS_S[0]
        rows.append(
            {
                "eta": eta,
                "paper_tokens_per_s": PAPER_ABLATION_TOKENS_S[eta],
                "predicted_tokens_per_s": r.tokens_per_s,
                "paper_ratio": paper,
                "predicted_ratio": sync.wall_s / r.wall_s,
                "error": (sync.wall_s / r.wall_s) / paper - 1.0,
            }
        )
    return rows


def scaling(steps: int = 20, model: str = "1.5b", nodes: tuple[int, ...] = (16, 32, 64)) -> list[dict[str, Any]]:
    """Strong scaling at the paper's batch: async throughput at 16, 32 and 64 nodes of 8 GPUs, and its share of
    linear scaling from the first."""
    run = next(r for r in PAPER_RUNS if r.model == model)
    rows: list[dict[str, Any]] = []
    for n in nodes:
        setting = paper_scenario(run, steps, gpus=8 * n).setting()
        r = simulate(setting, "async", run.eta)
        s = simulate(setting, "sync")
        rows.append(
            {
                "nodes": n,
                "gpus": 8 * n,
                "async_tokens_per_s": r.tokens_per_s,
                "sync_tokens_per_s": s.tokens_per_s,
                "speedup": s.wall_s / r.wall_s,
            }
        )
    base = rows[0]
    for row in rows:
        k = row["nodes"] / base["nodes"]
        row["async_scaling_eff"] = row["async_tokens_per_s"] / (base["async_tokens_per_s"] * k)
        row["sync_scaling_eff"] = row["sync_tokens_per_s"] / (base["sync_tokens_per_s"] * k)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m areal_async.planner.paper",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {"headline": headline(args.steps), "ablation": ablation(args.steps), "scaling": scaling(args.steps)}
    print("| model | task | GPUs | eta | inference TP | paper speedup | predicted | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out["headline"]:
        print(
            f"| {r['model']} | {r['task']} | {r['gpus']} | {r['eta']} | {r['tp']} | {r['paper_speedup']:.2f} | "
            f"{r['predicted_speedup']:.2f} | {100 * r['error']:+.0f}% |"
        )
    print("\n| eta | paper tokens/s | predicted tokens/s | paper ratio | predicted ratio |")
    print("|---|---|---|---|---|")
    for r in out["ablation"]:
        print(
            f"| {r['eta']} | {r['paper_tokens_per_s'] / 1e3:.0f}k | {r['predicted_tokens_per_s'] / 1e3:.0f}k | "
            f"{r['paper_ratio']:.2f} | {r['predicted_ratio']:.2f} |"
        )
    print("\n| nodes | GPUs | async tokens/s | share of linear | sync tokens/s | share of linear | speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in out["scaling"]:
        print(
            f"| {r['nodes']} | {r['gpus']} | {r['async_tokens_per_s'] / 1e3:.0f}k | {r['async_scaling_eff']:.2f} | "
            f"{r['sync_tokens_per_s'] / 1e3:.0f}k | {r['sync_scaling_eff']:.2f} | {r['speedup']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

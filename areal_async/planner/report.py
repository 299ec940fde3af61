"""What a plan reports: a markdown table, the JSON of every run, and a PNG of predicted throughput and staleness.

Why three forms: the table is for reading at a terminal, the JSON for scripts and for comparing plans, the plot
for seeing at a glance where a larger eta stops paying (throughput flattens while staleness keeps growing).
"""

from __future__ import annotations

import json
import os
from typing import Any

from areal_async.planner.sweep import PlanResult


def _name(mode: str, eta: int | None) -> str:
    return "sync" if mode == "sync" else f"async eta={eta}"


def table(plan: PlanResult) -> str:
    """One row per mode: wall time, samples/s, speedup over sync, both sides' busy shares, staleness."""
    gen, train = plan.scenario.split()
    head = (
        f"{plan.scenario.model} on {plan.scenario.gpus} x {plan.scenario.gpu}: {gen} generating "
        f"(servers of tp={plan.scenario.tp}), {train} training; {plan.scenario.steps} steps of "
        f"{plan.scenario.batch_size} prompts x {plan.scenario.group_size}\n\n"
    )
    rows = [
        "| mode | wall h | samples/s | speedup | gen busy | train busy | mean stale | max stale | stale tokens % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in plan.runs:
        total = sum(r.staleness_hist.values()) or 1
        hist = " ".join(f"{k}:{100 * v / total:.0f}" for k, v in sorted(r.staleness_hist.items()))
        rows.append(
            f"| {_name(r.mode, r.eta)} | {r.wall_s / 3600:.2f} | {r.samples_per_s:.2f} | {plan.speedup(r):.2f} | "
            f"{r.gen_busy_frac:.2f} | {r.trainer_busy_frac:.2f} | {r.staleness_mean:.2f} | {r.staleness_max} | "
            f"{hist} |"
        )
    text = head + "\n".join(rows)
    rec = plan.recommendation
    if rec:
        b, s = rec["best"], rec["best_sync"]
        text += (
            f"\n\nRecommendation ({rec['sweep_steps']}-step runs over the grid): {b['gen_gpus']} GPUs generating, "
            f"{b['train_gpus']} training, eta={b['eta']}, max_concurrent_groups={b['max_concurrent_groups']}: "
            f"{b['samples_per_s']:.2f} samples/s, {rec['speedup_vs_best_sync']:.2f}x the best sync split "
            f"({s['gen_gpus']} generating, {s['samples_per_s']:.2f} samples/s)."
        )
    return text


def write(plan: PlanResult, out_dir: str, stem: str = "plan") -> dict[str, str]:
    """`<stem>.md`, `<stem>.json` and `<stem>.png` in `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{stem}.{k}") for k in ("md", "json", "png")}
    with open(paths["md"], "w") as f:
        f.write(table(plan) + "\n")
    with open(paths["json"], "w") as f:
        json.dump(plan.to_json(), f, indent=2)
    if not plot(plan, paths["png"]):
        del paths["png"]
    return paths


def plot(plan: PlanResult, path: str) -> bool:
    """Samples/s and mean staleness against eta (sync at 0). False when matplotlib is not installed (it is an
    optional dependency: the `plot` extra)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(plan.runs, key=lambda r: (r.mode != "sync", r.eta or 0))
    xs = [r.eta or 0 for r in runs]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(xs, [r.samples_per_s for r in runs], "o-", color="tab:blue", label="samples/s")
    for x, r in zip(xs, runs):
        ax.annotate(
            f"{plan.speedup(r):.2f}x", (x, r.samples_per_s), textcoords="offset points", xytext=(4, 6), fontsize=8
        )
    ax.set_xlabel("eta (0: sync)")
    ax.set_ylabel("predicted trained samples/s", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(xs, [r.staleness_mean for r in runs], "s--", color="tab:red", label="mean staleness")
    ax2.set_ylabel("mean staleness of trained tokens", color="tab:red")
    s = plan.scenario
    ax.set_title(f"{s.model}, {s.gpus} x {s.gpu}, {s.steps} steps (predicted)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def summary(plan: PlanResult) -> dict[str, Any]:
    """The headline numbers: sync and best async samples/s and the speedup."""
    best = max((r for r in plan.runs if r.mode != "sync"), key=lambda r: r.samples_per_s)
    return {
        "sync_samples_per_s": plan.sync.samples_per_s,
        "best_eta": best.eta,
        "best_samples_per_s": best.samples_per_s,
        "speedup": plan.speedup(best),
    }

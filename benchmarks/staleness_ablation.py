"""Does the decoupled objective hold up under staleness here too? The AReaL paper's staleness table, on our task.

    python benchmarks/staleness_ablation.py --out benchmarks/out/staleness.json [--steps 40] [--etas 0 1 2 4 8 16 none]

eta in {0, 1, 2, 4, 8, 16, unbounded} x {naive PPO (trust region centred on the behaviour policy), decoupled PPO}:
final held-out accuracy and effective throughput (trained samples/s). Unbounded staleness keeps the concurrency cap
(schedule.max_concurrent_groups) as its only limit. Writes JSON, a markdown table laid out like the paper's (.md) and
a PNG (.png).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runs import run_one  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--etas", nargs="*", help="default: 0 1 2 4 8 16 none (with --quick: 0 none)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    extra = list(args.overrides)
    etas = args.etas or (["0", "none"] if args.quick else ["0", "1", "2", "4", "8", "16", "none"])
    if args.quick:
        args.steps = 2
        extra = [
            "schedule.batch_size=2",
            "rollout.group_size=2",
            "eval.num_prompts=8",
            "rollout.max_new_tokens=24",
            "eval.max_new_tokens=24",
            *extra,
        ]
    out_dir = os.path.splitext(os.path.abspath(args.out))[0] + "_runs"
    rows = []
    for eta in etas:
        for objective in ("naive", "decoupled"):
            mode = ["mode=sync"] if eta == "0" else ["mode=async", f"eta={'null' if eta == 'none' else eta}"]
            name = f"eta={eta} {objective}"
            s = run_one(
                name,
                os.path.join(out_dir, f"eta{eta}_{objective}"),
                [
                    *mode,
                    f"train.loss.decoupled={'true' if objective == 'decoupled' else 'false'}",
                    f"total_steps={args.steps}",
                    "schedule.eval_every=0",
                    *extra,
                ],
            )
            rows.append(
                {
                    "eta": eta,
                    "objective": objective,
                    "final_accuracy": s["final_accuracy"],
                    "base_accuracy": s["base_accuracy"],
                    "wall_s": s["wall_s"],
                    "trained_samples_per_s": s["trained_samples"] / s["wall_s"],
                    "max_staleness_seen": s["max_staleness_seen"],
                }
            )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "steps": args.steps, "overrides": extra}, f, indent=2)
    lines = [
        "| eta | naive PPO acc | decoupled PPO acc | samples/s (naive / decoupled) | max staleness |",
        "|---|---|---|---|---|",
    ]
    for eta in etas:
        n = next(r for r in rows if r["eta"] == eta and r["objective"] == "naive")
        d = next(r for r in rows if r["eta"] == eta and r["objective"] == "decoupled")
        lines.append(
            f"| {'unbounded' if eta == 'none' else eta} | {100 * n['final_accuracy']:.1f} | "
            f"{100 * d['final_accuracy']:.1f} | {n['trained_samples_per_s']:.2f} / "
            f"{d['trained_samples_per_s']:.2f} | {max(n['max_staleness_seen'], d['max_staleness_seen'])} |"
        )
    table = "\n".join(lines)
    base = os.path.splitext(args.out)[0]
    with open(base + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    _plot(rows, etas, base + ".png")


def _plot(rows: list[dict], etas: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = list(range(len(etas)))
    for objective, marker in (("naive", "s--"), ("decoupled", "o-")):
        ys = [
            100 * next(r["final_accuracy"] for r in rows if r["eta"] == e and r["objective"] == objective) for e in etas
        ]
        ax.plot(xs, ys, marker, label=f"{objective} PPO")
    ax.set_xticks(xs, ["inf" if e == "none" else e for e in etas])
    ax.set_xlabel("max staleness eta")
    ax.set_ylabel("final held-out accuracy (%)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

"""What periodic held-out evals cost the training loop, by `eval.mode`: the same run (task, model, steps, eval
cadence) once per mode, one after the other on the same machine, against the same run without periodic evals.

    python benchmarks/eval_modes.py --out benchmarks/out/eval_modes.json [--steps 24 --eval-every 4] [--repeats 2]
    python benchmarks/eval_modes.py --config configs/smollm2.yaml --steps 6 --eval-every 2 \
        --out benchmarks/out/eval_modes_smollm2.json eval.num_prompts=64

Modes: `none` (schedule.eval_every=0: the base and final evals only, which lie outside the run's wall time in every
mode), `stop` (the train loop and new rollouts wait for each eval, as a synchronous system does), `overlap` (the
eval of v runs on the rollout servers beside the next train step, whose weight sync waits for it) and `pinned` (a
server of its own evaluates a snapshot of v at `eval.server_nice=0`; the loop waits only for the snapshot), and
`pinned_nice` (the same at `eval.server_nice=19`, the default: the eval server runs on the CPU the run leaves idle).

For each: wall time, trained samples/s and the share of `none`'s throughput lost (`lost_frac` = 1 - samples/s over
none's samples/s of the same round), the time the train loop waited for evals (`eval_wait_s`; for pinned, the
snapshots), the periodic evals that ended and the versions they scored, the pinned evals' lag from snapshot to
figure, the load average and the CPU seconds each role got. On one small machine every server shares the same
cores: a pinned eval server takes CPU from the rollout server and the trainer, which a GPU cluster's separate eval
device would not; the CPU columns show how much.

Writes JSON, a markdown table (next to --out, .md) and a PNG of held-out accuracy against the run's wall time at
the version evaluated (.png). `--repeats N` runs the list N times, round after round; the table shows each mode's
median round by wall time with the median of its paired losses.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runs import load_run, markdown_table, plot_accuracy, run_one  # noqa: E402

MODES = {
    "none": ["schedule.eval_every=0"],
    "stop": ["eval.mode=stop"],
    "overlap": ["eval.mode=overlap"],
    "pinned": ["eval.mode=pinned", "eval.server_nice=0"],
    "pinned_nice": ["eval.mode=pinned", "eval.server_nice=19"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None, help="a run config file every mode starts from")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument(
        "--modes", nargs="*", default=["none", "stop", "overlap", "pinned_nice"], help=f"of {', '.join(MODES)}"
    )
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every mode (paired losses, medians)")
    ap.add_argument("--report-only", action="store_true", help="rebuild the outputs from the runs already there")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; known: {list(MODES)}")
    out_dir = os.path.splitext(os.path.abspath(args.out))[0] + "_runs"
    rounds: list[list[dict[str, Any]]] = []
    for rnd in range(args.repeats):
        rows = []
        for mode in args.modes:
            run_dir = os.path.join(out_dir, mode if args.repeats == 1 else f"{mode}_r{rnd}")
            if args.report_only:
                s = load_run(mode, run_dir)
            else:
                s = run_one(
                    mode,
                    run_dir,
                    [
                        f"total_steps={args.steps}",
                        f"schedule.eval_every={args.eval_every}",
                        "schedule.max_wall_s=null",  # every mode trains the same samples
                        *args.overrides,
                        *MODES[mode],
                    ],
                    config=args.config,
                )
            rows.append(_row(mode, s, rnd))
        base = next((r for r in rows if r["mode"] == "none"), None)
        for r in rows:
            r["lost_frac"] = 1 - r["samples_per_s"] / base["samples_per_s"] if base else None
        rounds.append(rows)
    rows = [_median_round([rnd[i] for rnd in rounds]) for i in range(len(args.modes))]
    result = {
        "runs": rows,
        "rounds": rounds,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "config": args.config,
        "overrides": args.overrides,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    table = markdown_table(
        rows,
        [
            ("mode", "eval.mode", ""),
            ("wall_s", "wall s", ".1f"),
            ("samples_per_s", "samples/s", ".2f"),
            ("lost_frac", "throughput lost vs none", ".1%"),
            ("lost_rounds", "lost, each round", ""),
            ("eval_wait_s", "loop waited for evals s", ".1f"),
            ("periodic_evals", "periodic evals", "d"),
            ("eval_versions", "versions scored", ""),
            ("pinned_lag_s", "pinned lag s", ".1f"),
            ("final_accuracy", "final acc", ".3f"),
            ("cpu_server_s", "server CPU s", ".0f"),
            ("cpu_trainer_s", "trainer CPU s", ".0f"),
            ("load_mean", "load", ".1f"),
        ],
    )
    stem = os.path.splitext(args.out)[0]
    with open(stem + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    for r in rows:
        r["label"] = f"{r['mode']} ({r['samples_per_s']:.2f} samples/s)"
    plot_accuracy(rows, stem + ".png", label="label", xlabel="run wall time at the version evaluated (s)")


def _row(mode: str, s: dict[str, Any], rnd: int) -> dict[str, Any]:
    wall = s["wall_s"]
    periodic = [e for e in s["evals"] if 0 < e["version"] < s["steps"]]  # the base (0) and final ones are extra
    lags = [e["pinned_lag_s"] for e in periodic if "pinned_lag_s" in e]
    cpu = s.get("cpu_s") or {}
    return {
        "mode": mode,
        "round": rnd,
        "wall_s": wall,
        "samples_per_s": s["trained_samples"] / wall,
        "trained_samples": s["trained_samples"],
        "eval_wait_s": s["timings"]["eval_wait_s"],
        "eval_s": s["timings"]["eval_s"],
        "periodic_evals": len(periodic),
        "eval_versions": ",".join(str(e["version"]) for e in periodic) or "-",
        "pinned_lag_s": statistics.median(lags) if lags else None,
        "pinned_counts": s.get("pinned_evals"),
        "base_accuracy": s["base_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "eval_curve": [(e["wall_s"], e["accuracy"]) for e in s["evals"]],
        "cpu_server_s": cpu.get("server"),
        "cpu_trainer_s": cpu.get("trainer"),
        "cpu_s": cpu,
        "load_mean": (s.get("load") or {}).get("mean"),
    }


def _median_round(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The mode's round with the median wall time (the lower middle for an even count), with the median of its
    paired losses and every round's figure."""
    row = dict(sorted(rows, key=lambda r: r["wall_s"])[(len(rows) - 1) // 2])
    losses = [r["lost_frac"] for r in rows if r["lost_frac"] is not None]
    row["lost_frac"] = statistics.median(losses) if losses else None
    row["lost_rounds"] = " / ".join(f"{x:.1%}" for x in losses) or "-"
    row["wall_s_rounds"] = [r["wall_s"] for r in rows]
    return row


if __name__ == "__main__":
    main()

"""Sync against async on equal terms: the same task, model, config and number of trained samples, one run after
the other on the same machine.

    python benchmarks/sync_vs_async.py --out benchmarks/out/sync_vs_async.json [--steps 40] [--repeats 3] [--quick]
    python benchmarks/sync_vs_async.py --config configs/smollm2.yaml --steps 6 --out benchmarks/out/sva_smollm2.json \
        --modes sync "async eta=2" "async eta=2, in place" "async eta=2, no interruption"

Modes: sync (eta = 0: generation never overlaps training), async with eta in {1, 2, 4, 8} and the default in-flight
treatment (interruptible, abort-and-recompute: requests come back partial and resume under the new weights, their KV
recomputed), and at eta = 4 and eta = 2 the other two: in place (`schedule.interrupt_mode=in_place`: requests stay on
the server, keep their KV cache and continue under the new weights) and no interruption (weight loads wait for
in-flight requests). For each: wall time to the same number of trained samples, trained samples/s, generated
tokens/s, the busy fraction of the inference server and of the trainer, final held-out accuracy, the staleness
histogram and its mean, and the load average while it ran. Writes JSON, a markdown table (next to --out, .md) and a
PNG of held-out accuracy against wall time for every mode (.png). `--config` runs a config file's setting (every mode
overrides only its schedule keys and the step count).

The overlap limit: sync mode spends G seconds waiting for generation and T seconds in train calls; async can at best
hide the shorter behind the longer, so its speedup over sync is at most (G + T) / max(G, T). Each mode's
`limit_frac` is its speedup over the sync run of its round divided by that limit (G and T from that sync run).

`--repeats N` runs the whole list of modes N times, round after round: this machine's speed drifts by 20% or more
over minutes (a shared VM), so a mode is compared with the sync run of its own round (paired speedup), and the table
shows each mode's median round (by wall time) with the median of its paired speedups. Every round is in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runs import load_run, markdown_table, plot_accuracy, run_one  # noqa: E402

MODES = [
    ("sync", ["mode=sync"]),
    ("async eta=1", ["mode=async", "eta=1"]),
    ("async eta=2", ["mode=async", "eta=2"]),
    ("async eta=4", ["mode=async", "eta=4"]),
    ("async eta=8", ["mode=async", "eta=8"]),
    ("async eta=4, no interruption", ["mode=async", "eta=4", "schedule.interruptible=false"]),
    ("async eta=4, in place", ["mode=async", "eta=4", "schedule.interrupt_mode=in_place"]),
    ("async eta=2, no interruption", ["mode=async", "eta=2", "schedule.interruptible=false"]),
    ("async eta=2, in place", ["mode=async", "eta=2", "schedule.interrupt_mode=in_place"]),
]
DEFAULT_MODES = [
    "sync",
    "async eta=1",
    "async eta=2",
    "async eta=4",
    "async eta=8",
    "async eta=4, no interruption",
    "async eta=4, in place",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None, help="a run config file every mode starts from")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="2 modes, 2 steps, tiny batches: a smoke test")
    ap.add_argument(
        "--modes",
        nargs="*",
        default=None,
        help=f"mode names (default: {', '.join(DEFAULT_MODES)}); all: {', '.join(m[0] for m in MODES)}",
    )
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every mode (paired speedups, medians)")
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the JSON, table and plot from the runs already in the output folder",
    )
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    names = args.modes or DEFAULT_MODES
    unknown = [n for n in names if n not in dict(MODES)]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; known: {[m[0] for m in MODES]}")
    modes = [m for m in MODES if m[0] in names]
    extra = list(args.overrides)
    if args.quick:
        modes = [MODES[0], MODES[3]]
        extra = [
            "schedule.batch_size=2",
            "rollout.group_size=2",
            "eval.num_prompts=8",
            "rollout.max_new_tokens=24",
            "eval.max_new_tokens=24",
            *extra,
        ]
        args.steps = 2
    out_dir = os.path.splitext(os.path.abspath(args.out))[0] + "_runs"
    rounds: list[list[dict]] = []
    for rnd in range(args.repeats):
        runs = []
        for name, ov in modes:
            slug = name.replace(" ", "_").replace(",", "").replace("=", "")
            run_dir = os.path.join(out_dir, slug if args.repeats == 1 else f"{slug}_r{rnd}")
            if args.report_only:
                s = load_run(name, run_dir)
            else:
                # no wall-time cap (a config may set one): every mode trains the same number of samples
                s = run_one(
                    name,
                    run_dir,
                    [
                        *ov,
                        f"total_steps={args.steps}",
                        f"schedule.eval_every={args.eval_every}",
                        "schedule.max_wall_s=null",
                        *extra,
                    ],
                    config=args.config,
                )
            runs.append(_row(name, s, rnd))
        sync = next((r for r in runs if r["mode"] == "sync"), None)
        limit = overlap_limit(sync) if sync else None
        for r in runs:  # held-out evals are the same work in every mode: also compare without the time they cost
            r["speedup_vs_sync"] = sync["wall_s"] / r["wall_s"] if sync else None
            r["speedup_excl_eval"] = sync["wall_excl_eval_s"] / r["wall_excl_eval_s"] if sync else None
            r["overlap_limit"] = limit
            r["limit_frac"] = r["speedup_vs_sync"] / limit if limit else None
        rounds.append(runs)
    runs = [_median_round([rnd[i] for rnd in rounds]) for i in range(len(modes))]
    result = {
        "runs": runs,
        "rounds": rounds,
        "repeats": args.repeats,
        "steps": args.steps,
        "overrides": extra,
        "config": args.config,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    table = markdown_table(
        runs,
        [
            ("name", "mode", ""),
            ("wall_s", "wall s", ".1f"),
            ("speedup_vs_sync", "speedup", ".2f"),
            ("wall_rounds", "wall s, each round", ""),
            ("speedup_rounds", "speedup, each round", ""),
            ("wall_excl_eval_s", "wall s w/o eval", ".1f"),
            ("speedup_excl_eval", "speedup w/o eval", ".2f"),
            ("overlap_limit", "overlap limit", ".2f"),
            ("limit_frac", "of limit", ".2f"),
            ("trained_samples", "samples", "d"),
            ("trained_samples_per_s", "samples/s", ".2f"),
            ("generated_tokens_per_s", "gen tok/s", ".0f"),
            ("server_busy_frac", "server busy", ".2f"),
            ("trainer_busy_frac", "trainer busy", ".2f"),
            ("base_accuracy", "base acc", ".3f"),
            ("final_accuracy", "final acc", ".3f"),
            ("staleness_mean", "mean stale", ".2f"),
            ("max_staleness_seen", "max stale", "d"),
            ("load_mean", "load", ".1f"),
        ],
    )
    base = os.path.splitext(args.out)[0]
    with open(base + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    plot_accuracy(runs, base + ".png")


def _row(name: str, s: dict, rnd: int) -> dict:
    wall = s["wall_s"]
    t = s["timings"]
    return {
        "name": name,
        "round": rnd,
        "mode": s["mode"],
        "eta": s["eta"],
        "interruptible": s["interruptible"],
        # the base and final evals lie outside wall_s; periodic ones count only where the trainer waited for them
        "wall_s": wall,
        "eval_s": t["eval_s"],
        "eval_wait_s": t["eval_wait_s"],
        "wall_excl_eval_s": wall - t["eval_wait_s"],
        "train_s": t["train_s"],
        "wait_batch_s": t["wait_batch_s"],
        "trained_samples": s["trained_samples"],
        "trained_samples_per_s": s["trained_samples"] / wall,
        "generated_tokens_per_s": s["rollout"]["generated_tokens"] / wall,
        "server_busy_frac": (
            s["server_busy_s"] / (wall * s.get("num_servers", 1)) if s.get("server_busy_s") is not None else None
        ),
        "trainer_busy_frac": (t["train_s"] + t["publish_s"]) / wall,
        "base_accuracy": s["base_accuracy"],
        "final_accuracy": s["final_accuracy"],
        "max_staleness_seen": s["max_staleness_seen"],
        "staleness_hist": s["staleness_hist"],
        "staleness_mean": _hist_mean(s["staleness_hist"]),
        "eval_curve": [(e["wall_s"], e["accuracy"]) for e in s["evals"]],
        "load_mean": (s.get("load") or {}).get("mean"),
        "load_max": (s.get("load") or {}).get("max"),
        "cpu_s": s.get("cpu_s"),
    }


def overlap_limit(sync: dict) -> float | None:
    """(G + T) / max(G, T) from a sync run: G its seconds waiting for generated batches, T its train calls."""
    g, t = sync["wait_batch_s"], sync["train_s"]
    return (g + t) / max(g, t) if max(g, t) > 0 else None


def _hist_mean(hist: dict[str, int]) -> float | None:
    """Mean staleness of the trained tokens from the run's histogram {staleness: tokens}."""
    n = sum(hist.values())
    return sum(int(k) * v for k, v in hist.items()) / n if n else None


def _median_round(rows: list[dict]) -> dict:
    """The mode's round with the median wall time (the lower middle for an even count), carrying the medians of
    the paired speedups and every round's wall time."""
    import statistics

    ordered = sorted(rows, key=lambda r: r["wall_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["wall_s_rounds"] = [r["wall_s"] for r in rows]
    row["wall_rounds"] = " / ".join(f"{r['wall_s']:.1f}" for r in rows)
    for key in ("speedup_vs_sync", "speedup_excl_eval", "limit_frac"):
        vals = [r[key] for r in rows if r[key] is not None]
        row[key] = statistics.median(vals) if vals else None
        row[key + "_rounds"] = [r[key] for r in rows]
    row["speedup_rounds"] = " / ".join(f"{r['speedup_vs_sync']:.2f}" for r in rows if r["speedup_vs_sync"])
    return row


if __name__ == "__main__":
    main()

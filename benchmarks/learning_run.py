"""One RL run of a config, measured: held-out accuracy before and after, in the training phrasings and in phrasings
never trained on, the run's wall time, and where each train step's time went, with the machine's load meanwhile.

    python benchmarks/learning_run.py --config configs/smollm2.yaml --out benchmarks/out/smollm2_learning.json \\
        --figure benchmarks/figures/smollm2_progress.png

What it does:
1. `python -m areal_async.run --config CONFIG` (benchmarks/runs.py: in its own run directory, the load average and
   each process's CPU seconds sampled while it runs);
2. greedy accuracy of the final checkpoint on the config's dataset and on `--other` (default
   `word_problems_other`: the same held-out problems told in unseen phrasings), through the embedded server
   (benchmarks/task_accuracy.py), and of the base model on `--other` (the run itself measured the base on its own
   eval split); the config's eval prompt count, max_new_tokens and reward;
3. the time of a step: wall time per step, and its parts as the controller logs them (waiting for a batch, the train
   call, the weight sync, waiting for a periodic eval), the trainer's own step time, the server's busy fraction,
   and the CPU seconds the trainer and the server got per step against the wall time (their share of a core:
   below 1, something else held the core);
4. JSON to --out, a markdown table next to it (.md), and the run's progress.png copied to --figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runs import ROOT, run_one, window  # noqa: E402


def step_breakdown(summary: dict) -> dict:
    """Means per train step of what the controller and the trainer logged, and the CPU the run's processes got
    between the first and the last step."""
    recs = summary["train_records"]
    if not recs:
        return {}

    def mean(key: str) -> float:
        vals = [r[key] for r in recs if r.get(key) is not None]
        return round(statistics.fmean(vals), 2) if vals else float("nan")

    wall = summary["wall_s"]
    out = {
        "steps": len(recs),
        "wall_per_step_s": round(wall / len(recs), 2),
        **{
            k: mean(k)
            for k in (
                "wait_batch_s",
                "train_step_s",
                "weight_sync_s",
                "eval_wait_s",
                "train/step_seconds",
                "response_len_mean",
                "train/tokens",
                "train/shared_prefix_tokens",
                "train/response_tokens",
                "reward_mean",
                "staleness_mean",
                "train/imp_weight_masked_frac",
                "train/entropy",
            )
        },
        "first_step_s": round(recs[0]["wall_s"], 1),
        "server_busy_frac": (
            round(summary["server_busy_s"] / wall, 3) if summary.get("server_busy_s") is not None else None
        ),
    }
    if len(recs) >= 2 and summary.get("machine_series"):
        # steps 2..n: the first step's time includes the first batch, generated while the trainer had nothing to do
        w = window(summary["machine_series"], recs[0]["time"], recs[-1]["time"])
        if w:
            n = len(recs) - 1
            out["steady"] = {
                "steps": n,
                "seconds": w["seconds"],
                "load_mean": w["load_mean"],
                "load_max": w["load_max"],
                "cpu_s_per_step": {r: round(c / n, 1) for r, c in w["cpu_s"].items()},
                "core_share": {r: round(c / w["seconds"], 2) for r, c in w["cpu_s"].items()},
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "smollm2.yaml"))
    ap.add_argument("--out", default="benchmarks/out/smollm2_learning.json")
    ap.add_argument("--run-dir", default=None, help="default: next to --out")
    ap.add_argument("--figure", default=None, help="copy the run's progress.png here")
    ap.add_argument(
        "--other",
        default="word_problems_other",
        help="datasets (comma-separated) the final checkpoint is also scored on; empty: none",
    )
    ap.add_argument("--no-base", action="store_true", help="skip scoring the base model on --other")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the scoring server (after the run)")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("overrides", nargs="*", help="key=value overrides for the run")
    args = ap.parse_args()

    from task_accuracy import measure, start_server

    from areal_async.config import load_config
    from areal_async.model_store import resolve_model_path

    cfg = load_config(args.config, args.overrides)
    run_dir = os.path.abspath(args.run_dir or os.path.splitext(args.out)[0] + "_run")
    summary = run_one("learning", run_dir, args.overrides, config=args.config, timeout_s=args.timeout_s)

    datasets = [cfg.data.name] + [d for d in args.other.split(",") if d]
    num, max_new = cfg.eval.num_prompts, cfg.eval.max_new_tokens
    scores: dict[str, dict[str, dict]] = {"final": {}, "base": {}}
    todo = [("final", os.path.join(run_dir, "final"), datasets)]
    if not args.no_base and datasets[1:]:
        todo.append(("base", resolve_model_path(cfg.model.path), datasets[1:]))
    for which, model_dir, names in todo:
        proc, url = start_server(model_dir, args.threads)
        try:
            for d in names:
                r = measure(
                    model_dir, url, d, num, cfg.data.seed, cfg.data.apply_chat_template, cfg.data.reward, max_new, 64
                )
                r.pop("samples")
                scores[which][d] = r
        finally:
            proc.terminate()
            proc.wait(30)
    if summary.get("base_accuracy") is not None:
        scores["base"].setdefault(cfg.data.name, {"accuracy": summary["base_accuracy"], "from": "the run's eval"})

    breakdown = step_breakdown(summary)
    report = {
        "config": args.config,
        "overrides": args.overrides,
        "run_dir": run_dir,
        "wall_s": summary["wall_s"],
        "steps": summary["steps"],
        "trained_samples": summary["trained_samples"],
        "base_accuracy": summary["base_accuracy"],
        "final_accuracy": summary["final_accuracy"],
        "evals": [{k: e[k] for k in ("version", "wall_s", "accuracy") if k in e} for e in summary["evals"]],
        "scores": scores,
        "load": summary.get("load"),
        "cpu_s": summary.get("cpu_s"),
        "process_s": summary["process_s"],
        "breakdown": breakdown,
        "timings": summary["timings"],
        "dropped": summary["dropped"],
        "max_staleness_seen": summary["max_staleness_seen"],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    if args.figure:
        os.makedirs(os.path.dirname(os.path.abspath(args.figure)), exist_ok=True)
        shutil.copyfile(os.path.join(run_dir, "progress.png"), args.figure)
    md = render(report, datasets)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md)
    print(md)


def render(r: dict, datasets: list[str]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}"

    lines = [
        f"config {r['config']} {' '.join(r['overrides'])}".rstrip(),
        f"run wall time {r['wall_s']:.1f} s, {r['steps']} steps, {r['trained_samples']} trained samples; "
        f"load average {r['load']['mean']} (max {r['load']['max']})"
        if r.get("load")
        else "",
        "",
        "| held-out set | base % | final % | gain (points) |",
        "|---|---|---|---|",
    ]
    for d in datasets:
        b = r["scores"]["base"].get(d, {}).get("accuracy")
        f = r["scores"]["final"].get(d, {}).get("accuracy")
        gain = f"{100 * (f - b):+.1f}" if b is not None and f is not None else "n/a"
        lines.append(f"| {d} | {pct(b)} | {pct(f)} | {gain} |")
    lines.append(
        "\nthe run's own evals (version: accuracy % at wall s): "
        + ", ".join(f"v{e['version']}: {pct(e['accuracy'])} @ {e['wall_s']:.0f}" for e in r["evals"])
    )
    b = r["breakdown"]
    if b:
        lines += ["", "| per step (mean) | s |", "|---|---|"]
        for k in (
            "wall_per_step_s",
            "wait_batch_s",
            "train_step_s",
            "train/step_seconds",
            "weight_sync_s",
            "eval_wait_s",
        ):
            lines.append(f"| {k} | {b[k]} |")
        lines.append(
            f"\nfirst step done at {b['first_step_s']} s; server busy {b['server_busy_frac']} of the wall "
            f"time; {b['train/tokens']:.0f} tokens per step ({b['train/shared_prefix_tokens']:.0f} shared "
            f"prefix, {b['train/response_tokens']:.0f} response), mean response {b['response_len_mean']}"
        )
        if "steady" in b:
            s = b["steady"]
            lines.append(
                f"steps 2-{s['steps'] + 1}: CPU s per step {s['cpu_s_per_step']}, share of a core "
                f"{s['core_share']}, load {s['load_mean']} (max {s['load_max']})"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

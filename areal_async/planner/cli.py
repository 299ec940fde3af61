"""`python -m areal_async.plan`: predict a run before launching it (the capacity planner, docs/planner.md).

    python -m areal_async.plan --gpu H800 --model 7b --gpus 192 --gen-frac 0.75 --steps 50 --out plan_out
    python -m areal_async.plan --gpus 1024 --steps 200 --etas 1 2 4 --recommend
    python -m areal_async.plan --lengths-from RUN_DIR --set server.load_s=5 --set trainer.token_s=2e-7

Runs the real controller, rollout manager and staleness buffer in virtual time against simulated servers and
trainers (areal_async/planner/), in sync mode and in async mode at each eta; prints a table and writes
plan.md, plan.json and plan.png under --out. `--recommend` also searches splits, etas and concurrency caps.
Torch-free, like the rest of the controller side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from areal_async.planner.costs import Efficiency, override
from areal_async.planner.lengths import LengthModel, lengths_from_records
from areal_async.planner.presets import GPUS, MODELS
from areal_async.planner.report import table, write
from areal_async.planner.scenario import Scenario
from areal_async.planner.sweep import Grid, recommend, run_plan


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m areal_async.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--gpu", default="H800", help=f"GPU preset: {', '.join(GPUS)}")
    ap.add_argument("--model", default="1.5b", help=f"model preset: {', '.join(MODELS)} (or 1.5b, 7b, ...)")
    ap.add_argument("--gpus", type=int, default=128, help="GPUs in all")
    ap.add_argument("--gen-frac", type=float, default=0.75, help="share of the GPUs that generate")
    ap.add_argument("--tp", type=int, default=1, help="GPUs per inference server")
    ap.add_argument("--batch", type=int, default=512, help="prompt groups per train step (B)")
    ap.add_argument("--group", type=int, default=16, help="samples per prompt")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--etas", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--concurrency", type=int, default=None, help="max_concurrent_groups (default (eta + 1) x B)")
    ap.add_argument("--interrupt", choices=["abort", "in_place", "wait"], default="abort")
    ap.add_argument("--weight-sync", choices=["disk", "broadcast"], default="disk")
    ap.add_argument("--median", type=float, default=8000.0, help="median response length (log-normal)")
    ap.add_argument("--sigma", type=float, default=0.7, help="log-space sigma of response lengths")
    ap.add_argument("--max-new-tokens", type=int, default=32768)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--growth", type=float, default=0.0, help="response lengths grow by this share per step")
    ap.add_argument("--reject-rate", type=float, default=0.0, help="share of groups dropped (rejected/filtered)")
    ap.add_argument("--lengths-from", default=None, help="a run directory or a JSON/JSONL file of lengths")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PART.FIELD=VALUE",
        help="override a cost term: server.<ServerCosts field>, trainer.<TrainerCosts field>, eff.<Efficiency field>",
    )
    ap.add_argument("--recommend", action="store_true", help="also search splits, etas and concurrency")
    ap.add_argument("--sweep-steps", type=int, default=8, help="steps of each run of the recommendation's grid")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for plan.md, plan.json, plan.png")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    return ap


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    lengths = LengthModel(
        median=args.median,
        sigma=args.sigma,
        max_new_tokens=args.max_new_tokens,
        prompt_tokens=args.prompt_tokens,
        growth_per_step=args.growth,
        reject_rate=args.reject_rate,
    )
    if args.lengths_from:
        lengths.kind = "empirical"
        lengths.samples = lengths_from_records(args.lengths_from)
    parts: dict[str, dict[str, str]] = {"server": {}, "trainer": {}, "eff": {}}
    for item in args.set:
        key, sep, value = item.partition("=")
        part, dot, name = key.partition(".")
        if not sep or not dot or part not in parts:
            raise SystemExit(f"--set {item!r}: expected server.FIELD=VALUE, trainer.FIELD=VALUE or eff.FIELD=VALUE")
        parts[part][name] = value
    return Scenario(
        gpu=args.gpu,
        model=args.model,
        gpus=args.gpus,
        gen_frac=args.gen_frac,
        tp=args.tp,
        batch_size=args.batch,
        group_size=args.group,
        steps=args.steps,
        lengths=lengths,
        interrupt_mode=args.interrupt,
        weight_sync=args.weight_sync,
        max_concurrent_groups=args.concurrency,
        efficiency=override(Efficiency(), parts["eff"]),
        server_overrides=parts["server"],
        trainer_overrides=parts["trainer"],
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    scn = scenario_from_args(args)
    scn.setting()  # the presets and overrides resolve (a typo fails here, before any simulation)
    t0 = time.perf_counter()
    plan = run_plan(scn, tuple(args.etas))
    if args.recommend:
        plan.recommendation = recommend(scn, Grid(etas=tuple(args.etas), sweep_steps=args.sweep_steps))
    plan.sim_seconds = time.perf_counter() - t0
    if args.json:
        json.dump(plan.to_json(), sys.stdout, indent=2)
        print()
    else:
        print(table(plan))
        print(f"\n(simulated in {plan.sim_seconds:.1f} s)")
    if args.out:
        paths = write(plan, args.out)
        print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The capacity planner checked against reality on this machine: profile the real stack, predict
benchmarks/sync_vs_async.py's speedups from the profile alone, then run that benchmark and compare.

    python benchmarks/planner_accuracy.py --out benchmarks/out/planner_accuracy.json [--steps 40] [--repeats 3]
    python benchmarks/planner_accuracy.py --out X.json --warm-steps 40   # from a converged policy (see below)
    python benchmarks/planner_accuracy.py --out X.json --measured benchmarks/out/pa_sync_vs_async.json  # no rerun

0. Optional warm start (`--warm-steps N`): a synchronous run of N steps from the base model; the profile and every
   measured run start from its final weights. Why: on this small task the policy converges within a 40-step run
   (rewards 0.4 -> 0.9), and as it does a group's answers share ever longer prefixes, which the trainer runs once,
   so a train step's cost falls within the run. A profile of a run's first steps sees only the start of that; from
   a converged policy it sees the regime the measured runs are in, as a short pilot of a long run does at scale.
   Without it (the default) the measured runs are sync_vs_async.py's own, from the base model.
1. Profile (areal_async/planner/calibrate.py says what and why): the embedded server started as a run starts it
   (the config's model, KV budget, running cap, one torch thread), driven by the real InferenceClient: decode
   seconds per step at batch 16, 64, 128 and 256 (n requests generating 72 and 8 tokens, ignore_eos: the
   difference is pure decode), prefill seconds per prompt token, a weight load from disk, and the response lengths
   the run's own workflow produces from its own prompts (32 prompts x the group size). Then a short synchronous run
   of the whole stack (`--profile-steps`, no periodic evals): the trainer's seconds per trained token and the
   publish and load seconds of each weight sync.
2. Predict: the planner (the real controller in virtual time) at the benchmark's setting (configs/default.yaml:
   16 prompts x 8 samples, max_concurrent_groups 64, abort-and-resume) for sync and eta 1, 2, 4, `--steps` steps.
3. Measure: benchmarks/sync_vs_async.py with those four modes, the same steps, no periodic evals (`--eval-every 0`:
   held-out evals are not part of what the planner models; the base and final evals lie outside wall time anyway),
   `--repeats` rounds of all four: each mode's speedup is the median of its rounds' speedups over the sync run of
   the same round (this machine's speed drifts by 10% within minutes).

Writes JSON: `modes` (each with `mode`, `measured_speedup`, `predicted_speedup`, their ratio, and both wall times),
`profile` (every measured number and the cost terms derived from it), the CPU and the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

MODES = ["sync", "async eta=1", "async eta=2", "async eta=4"]
DECODE_BATCHES = (16, 64, 128, 256)
SHORT, LONG = 8, 72


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cores)"
    except OSError:
        pass
    return "unknown"


async def _timed(client, prompts: list[list[int]], new: int) -> float:
    from areal_async.types import SamplingParams

    t0 = time.perf_counter()
    await asyncio.gather(
        *(client.agenerate(p, SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True)) for p in prompts)
    )
    return time.perf_counter() - t0


async def profile_server(url: str, prompts: list[list[int]], workflow, samples, model_dir: str) -> dict[str, Any]:
    from inference_throughput import wait_healthy

    from areal_async.inference.client import InferenceClient

    out: dict[str, Any] = {}
    async with InferenceClient([url], probe_interval_s=0.2) as client:
        await wait_healthy(client)
        await _timed(client, prompts[:16], 8)  # warm-up
        decode = []
        for n in DECODE_BATCHES:
            batch = [prompts[i % len(prompts)] for i in range(n)]
            long_s = min([await _timed(client, batch, LONG) for _ in range(2)])
            short_s = min([await _timed(client, batch, SHORT) for _ in range(2)])
            decode.append((n, (long_s - short_s) / (LONG - SHORT)))
        out["decode"] = decode
        batch = [prompts[i % len(prompts)] for i in range(128)]
        one = min([await _timed(client, batch, 1) for _ in range(2)])
        step128 = dict(decode)[128]
        out["prefill_s"] = max(one - step128, 0.0)
        out["prefill_tokens"] = sum(len(p) for p in batch)
        loads = []
        for v in (1, 2):
            t0 = time.perf_counter()
            await client.update_weights_from_disk(model_dir, v)
            loads.append(time.perf_counter() - t0)
        out["standalone_load_s"] = statistics.median(loads)
        trajs = await asyncio.gather(*(workflow.run(client, s) for s in samples))
        out["lengths"] = [t.response_len for group in trajs if group for t in group]
    return out


def profile(args: argparse.Namespace, work: str) -> dict[str, Any]:
    from inference_throughput import start_server

    from areal_async.config import load_config
    from areal_async.rollout.prompts import prompt_ids
    from areal_async.session.prepare import prepare

    cfg = load_config(None, [f"run_dir={os.path.join(work, 'prep')}", "resume=false", *args.overrides])
    plan = prepare(cfg)
    chat = bool(getattr(cfg.data, "apply_chat_template", False))
    prompts = [prompt_ids(plan.tokenizer, s, chat) for s in plan.train_samples[:256]]
    proc, url = start_server(
        plan.model_path,
        cfg.server.torch_threads,
        [
            "--max-total-tokens",
            str(cfg.server.max_total_tokens),
            "--max-running-requests",
            str(cfg.server.max_running_requests),
        ],
    )
    try:
        t0 = time.perf_counter()
        p = asyncio.run(profile_server(url, prompts, plan.workflow, plan.train_samples[:32], plan.model_path))
        p["server_profile_s"] = time.perf_counter() - t0
    finally:
        proc.kill()
        proc.wait()
        close = getattr(plan.rewards, "close", None)
        if close is not None:
            r = close()
            if inspect.isawaitable(r):
                asyncio.run(r)
    steps = args.profile_steps
    t0 = time.perf_counter()
    s = sync_run("profile (sync)", os.path.join(work, "profile_sync"), steps, args.overrides)
    p["trainer_profile_s"] = time.perf_counter() - t0
    b, g = cfg.schedule.batch_size, cfg.rollout.group_size
    prompt_mean = statistics.fmean(len(x) for x in prompts)
    p["prompt_tokens"] = prompt_mean
    p["train_steps"] = [(r["train_step_s"], b * g * (prompt_mean + r["response_len_mean"])) for r in s["train_records"]]
    t = s["timings"]
    p["publish_s"] = t["publish_s"] / steps
    p["load_s"] = t["weight_load_s"] / steps
    p["profile_run_lengths_mean"] = [r["response_len_mean"] for r in s["train_records"]]
    p["max_new_tokens"] = cfg.rollout.max_new_tokens
    p["kv_capacity_tokens"] = cfg.server.max_total_tokens
    p["max_running"] = cfg.server.max_running_requests
    p["batch_size"], p["group_size"] = b, g
    p["max_concurrent_groups"] = cfg.schedule.max_concurrent_groups
    p["interrupt_mode"] = cfg.schedule.interrupt_mode
    return p


def sync_run(name: str, run_dir: str, steps: int, overrides: list[str]) -> dict[str, Any]:
    """A synchronous run of `steps` steps without periodic evals (the profile's and the warm start's)."""
    from runs import run_one

    return run_one(
        name,
        run_dir,
        [
            "mode=sync",
            f"total_steps={steps}",
            "schedule.eval_every=0",
            "eval.num_prompts=8",
            "schedule.max_wall_s=null",
            *overrides,
        ],
    )


def warm_start(args: argparse.Namespace, work: str) -> dict[str, Any]:
    """Train `--warm-steps` synchronous steps from the base model; the profile and the measured runs start from the
    result (the module docstring says why)."""
    t0 = time.perf_counter()
    s = sync_run("warm start (sync)", os.path.join(work, "warm"), args.warm_steps, args.overrides)
    recs = s["train_records"]
    tail = recs[len(recs) // 2 :]
    return {
        "model_path": os.path.join(work, "warm", "final"),
        "steps": args.warm_steps,
        "seconds": time.perf_counter() - t0,
        "reward_mean_last_half": statistics.fmean(r["reward_mean"] for r in tail) if tail else None,
    }


def predict(p: dict[str, Any], steps: int) -> dict[str, dict[str, float]]:
    from areal_async.planner.calibrate import Profile, server_from_profile, setting_from_profile, trainer_from_profile
    from areal_async.planner.simulate import simulate

    prof = Profile(
        decode=[tuple(x) for x in p["decode"]],
        prefill_s=p["prefill_s"],
        prefill_tokens=p["prefill_tokens"],
        lengths=p["lengths"],
        prompt_tokens=p["prompt_tokens"],
        train_steps=[tuple(x) for x in p["train_steps"]],
        publish_s=p["publish_s"],
        load_s=p["load_s"],
        max_new_tokens=p["max_new_tokens"],
        kv_capacity_tokens=p["kv_capacity_tokens"],
        max_running=p["max_running"],
        run_lengths_mean=p.get("profile_run_lengths_mean", []),
    )
    p["server_costs"] = server_from_profile(prof).__dict__
    p["trainer_costs"] = trainer_from_profile(prof).__dict__
    setting = setting_from_profile(
        prof,
        batch_size=p["batch_size"],
        group_size=p["group_size"],
        steps=steps,
        max_concurrent_groups=p["max_concurrent_groups"],
        interrupt_mode=p["interrupt_mode"],
    )
    out = {}
    for name in MODES:
        r = simulate(setting, "sync") if name == "sync" else simulate(setting, "async", int(name.split("=")[1]))
        out[name] = {
            "wall_s": r.wall_s,
            "gen_busy": r.gen_busy_frac,
            "trainer_busy": r.trainer_busy_frac,
            "staleness_mean": r.staleness_mean,
        }
    return out


def measure(args: argparse.Namespace, work: str) -> dict[str, Any]:
    if args.measured:
        with open(args.measured) as f:
            return json.load(f)
    out = os.path.join(os.path.dirname(os.path.abspath(args.out)), "pa_sync_vs_async.json")
    cmd = [
        sys.executable,
        os.path.join(HERE, "sync_vs_async.py"),
        "--out",
        out,
        "--steps",
        str(args.steps),
        "--eval-every",
        "0",
        "--repeats",
        str(args.repeats),
        "--modes",
        *MODES,
        "--",
        *args.overrides,
    ]
    subprocess.run(cmd, cwd=ROOT, check=True)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40, help="train steps of each measured and predicted run")
    ap.add_argument("--profile-steps", type=int, default=12, help="steps of the profiling sync run")
    ap.add_argument("--profile", default=None, help="reuse a profile (the `profile` of an earlier output)")
    ap.add_argument("--measured", default=None, help="reuse a sync_vs_async.py JSON instead of running it")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the measured modes (paired speedups, medians)")
    ap.add_argument(
        "--warm-steps",
        type=int,
        default=0,
        help="first train this many synchronous steps from the base model and start the profile and every measured "
        "run from the result (0: start from the base model)",
    )
    ap.add_argument("overrides", nargs="*", help="key=value overrides for the profile and every measured run")
    args = ap.parse_args()
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="planner_accuracy_") as work:
        reuse = bool(args.profile and args.measured)  # nothing runs: nothing to start from
        warm = warm_start(args, work) if args.warm_steps > 0 and not reuse else None
        if warm is not None:  # last, so that it wins over a model.path the warm start itself started from
            args.overrides = [*args.overrides, f"model.path={warm['model_path']}"]
        if args.profile:
            with open(args.profile) as f:
                prof = json.load(f)["profile"]
        else:
            prof = profile(args, work)
        t_prof = time.perf_counter() - t0
        pred = predict(prof, args.steps)  # before anything is measured: the prediction sees only the profile
        measured = measure(args, work)
    runs = {r["name"]: r for r in measured["runs"]}
    sync_pred = pred["sync"]["wall_s"]
    modes = []
    for name in MODES:
        r = runs[name]
        ps = sync_pred / pred[name]["wall_s"]
        modes.append(
            {
                "mode": name,
                "measured_speedup": r["speedup_vs_sync"],
                "measured_speedup_rounds": r.get("speedup_vs_sync_rounds"),
                "predicted_speedup": ps,
                "predicted_over_measured": ps / r["speedup_vs_sync"],
                "measured_wall_s": r["wall_s"],
                "predicted_wall_s": pred[name]["wall_s"],
                "measured_server_busy": r.get("server_busy_frac"),
                "predicted_server_busy": pred[name]["gen_busy"],
                "measured_trainer_busy": r.get("trainer_busy_frac"),
                "predicted_trainer_busy": pred[name]["trainer_busy"],
                "measured_staleness_mean": r.get("staleness_mean"),
                "predicted_staleness_mean": pred[name]["staleness_mean"],
                "measured_load_mean": r.get("load_mean"),
            }
        )
    result = {
        "modes": modes,
        "steps": args.steps,
        "profile": prof,
        "warm_start": warm,
        "overrides": args.overrides,
        "repeats": args.repeats,
        "profile_s": t_prof,
        "total_s": time.perf_counter() - t0,
        "cpu": cpu_name(),
        "load_start": load0,
        "load_end": os.getloadavg(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print("| mode | measured speedup | predicted | predicted / measured | measured wall s | predicted wall s |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        print(
            f"| {m['mode']} | {m['measured_speedup']:.2f} | {m['predicted_speedup']:.2f} | "
            f"{m['predicted_over_measured']:.3f} | {m['measured_wall_s']:.1f} | {m['predicted_wall_s']:.1f} |"
        )


if __name__ == "__main__":
    main()

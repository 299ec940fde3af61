"""Faults injected into real runs of the default task, and what the run made of them.

    python benchmarks/faults.py --out benchmarks/out/faults.json [--steps 60] [--scenarios NAME ...] [key=value ...]

Each scenario is one run (`python -m areal_async.run`, the project's tiny model on the arithmetic task, small
batches, no periodic evals) with one fault injected at a chosen version:

    server_sigkill        one of two servers SIGKILLed (disk weight sync)
    server_sigstop        one of two servers SIGSTOPped: hung until the watchdog kills and restarts it
    broadcast_sigkill     one of two servers SIGKILLed with broadcast weight sync (the group is formed again)
    trainer_sigkill       the trainer rank SIGKILLed: trainers restart from the last checkpoint, the run rolls back
    controller_mid_step   the controller SIGKILLed mid-step, then rerun with the same run_dir
    controller_in_save    the controller SIGKILLed while it saves a checkpoint, then rerun
    all_servers_dead      the only server SIGKILLed with no restart allowed: the run stops with a checkpoint, and
                          a rerun (server restarts allowed again) finishes it

Reported per scenario: whether the run survived (finished every step; for all_servers_dead: stopped with a
checkpoint and finished on the rerun), the time to recover (from the injection to the recovery record, or for a
controller kill to the first step of the rerun, which starts at once), the steps trained twice (a rollback), and
the samples lost: draws that trained_index.jsonl does not account for exactly once, plus trained samples missing
from steps x batch x group (must be 0); and what the resumes kept of the work in flight (the generation journal):
tokens continued from, tokens generated again with the reason for each, and calls whose last segment was still on
a server at the kill. The limit each recovery time is shown against is measured in the same
session: the cold start of a server (process start to /health) and of a trainer job (torchrun to its rank file).
Writes JSON to --out and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from areal_async.net.rank_registry import rank_file
from areal_async.testing.faults import RunProcess, accounting, run_children, summary, wait_gone

B, N = 8, 4
BASE = [
    f"schedule.batch_size={B}",
    f"rollout.group_size={N}",
    "schedule.eval_every=0",
    "eval.num_prompts=20",
    "recovery.restart_backoff_s=0.5",
    "recovery.health_interval_s=1",
    "recovery.health_timeout_s=2",
]


def first_record(run: RunProcess, event: str, after: float, timeout: float = 300) -> dict[str, Any]:
    return run.wait_for(
        lambda: next((r for r in run.recoveries() if r.get("event") == event and r["time"] >= after), None),
        f"a {event} record",
        timeout,
    )


def result(name: str, run_dir: str, steps: int, **extra: Any) -> dict[str, Any]:
    acc = accounting(run_dir)
    s = summary(run_dir)
    lost = len(acc["lost"]) + len(acc["twice"]) + max(0, steps * B * N - s.get("trained_samples", 0))
    survived = bool(s.get("completed")) and acc["versions"] == list(range(1, steps + 1)) and acc["ended"]
    return {
        "scenario": name,
        "survived": survived,
        "samples_lost": lost,
        "trained_samples": s.get("trained_samples"),
        "steps": steps,
        "recovery": {k: s["recovery"][k] for k in ("faults", "recovered", "gave_up", "by_event")},
        **journal_kept(run_dir),
        **extra,
    }


def journal_kept(run_dir: str) -> dict[str, Any]:
    """What the resumes of this run kept of the work in flight (rollout/journal.py's reports): tokens continued
    from, tokens generated again (each with its reason), and calls whose last segment was on a server at the kill.
    A fault with no resume (a server fault) has no report: nothing was rolled back."""
    kept = recomputed = in_flight = 0
    reasons: dict[str, int] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "journal", "resumed-v*.json"))):
        with open(path) as f:
            rep = json.load(f)
        kept += rep["tokens_kept"]
        in_flight += rep["calls_in_flight"]
        for why, n in rep["tokens_dropped"].items():
            reasons[why] = reasons.get(why, 0) + n
            recomputed += n
    return {
        "tokens_kept": kept,
        "tokens_recomputed": recomputed,
        "tokens_recomputed_by_reason": reasons,
        "calls_in_flight_at_kill": in_flight,
    }


def server_kill(
    args_: list[str], run_dir: str, steps: int, at: int, *, name: str, sig: int, extra: list[str]
) -> dict[str, Any]:
    run = RunProcess([*args_, f"total_steps={steps}", "server.num_servers=2", *extra], run_dir).start()
    try:
        run.wait_version(at)
        victim = "server1" if sig == signal.SIGKILL else "server0"
        t0 = time.time()
        os.kill(run.server_pid(victim), sig)
        rec = first_record(run, "server_recovered", t0)
        rc = run.wait(600)
    finally:
        run.kill()
    assert rc == 0, run.output()[-3000:]
    return result(
        name,
        run_dir,
        steps,
        recover_s=rec["time"] - t0,
        steps_redone=0,
        detail=f"{victim}: back with weight version {rec['server_version']} (current {rec['current_version']})",
    )


def trainer_kill(args_: list[str], run_dir: str, steps: int, at: int) -> dict[str, Any]:
    run = RunProcess([*args_, f"total_steps={steps}", "schedule.checkpoint_every=5"], run_dir).start()
    try:
        run.wait_version(at)
        t0 = time.time()
        os.kill(run.trainer_rank_pid(0), signal.SIGKILL)
        rec = first_record(run, "trainer_recovered", t0)
        rc = run.wait(600)
    finally:
        run.kill()
    assert rc == 0, run.output()[-3000:]
    return result(
        "trainer_sigkill",
        run_dir,
        steps,
        recover_s=rec["time"] - t0,
        steps_redone=rec["steps_redone"],
        detail=f"rolled back to version {rec['version']}",
    )


def controller_kill(args_: list[str], run_dir: str, steps: int, at: int, *, in_save: bool) -> dict[str, Any]:
    args_ = [*args_, f"total_steps={steps}", "schedule.checkpoint_every=" + ("1" if in_save else "5")]
    run = RunProcess(args_, run_dir).start()
    detail = ""
    try:
        run.wait_version(at)
        if in_save:  # the trainer writes <checkpoint>/trainer.tmp while the controller waits for it
            for v in range(at + 1, at + 10):
                tmp = os.path.join(run_dir, "checkpoints", f"v{v}", "trainer.tmp")
                run.wait_for(lambda: os.path.isdir(tmp) or run.version() > v, f"the save of v{v}", poll_s=0.001)
                if os.path.isdir(tmp):
                    t0 = time.time()
                    run.kill()
                    with open(os.path.join(run_dir, "checkpoints", "latest.json")) as f:
                        latest = json.load(f)["version"]
                    if latest < v:
                        detail = f"killed while saving v{v}; latest complete checkpoint v{latest}"
                        break
                    run = RunProcess(args_, run_dir).start()  # the save won the race: try the next one
                    run.wait_version(v + 1)
            else:
                raise AssertionError("no kill landed during a save")
        else:
            time.sleep(0.2)
            t0 = time.time()
            run.kill()
            with open(os.path.join(run_dir, "checkpoints", "latest.json")) as f:
                detail = f"killed after version {run.version()}; latest checkpoint v{json.load(f)['version']}"
    finally:
        run.kill()
    wait_gone(run_children(run_dir), 60)
    with open(os.path.join(run_dir, "checkpoints", "latest.json")) as f:
        resumed_at = json.load(f)["version"]
    killed_at = run.version()
    ledger_path = os.path.join(run_dir, "trained_index.jsonl")
    before = os.stat(ledger_path).st_ino
    rerun = RunProcess(args_, run_dir).start()
    try:
        # the rerun cuts the ledger back to the checkpoint (a new file), then appends version resumed_at + 1
        rerun.wait_for(
            lambda: os.stat(ledger_path).st_ino != before and rerun.version() > resumed_at,
            "the rerun's first step",
            600,
        )
        recover_s = time.time() - t0
        rc = rerun.wait(600)
    finally:
        rerun.kill()
    assert rc == 0, rerun.output()[-3000:]
    return result(
        "controller_in_save" if in_save else "controller_mid_step",
        run_dir,
        steps,
        recover_s=recover_s,
        steps_redone=max(0, killed_at - resumed_at),
        detail=detail,
    )


def all_servers_dead(args_: list[str], run_dir: str, steps: int, at: int) -> dict[str, Any]:
    run = RunProcess(
        [*args_, f"total_steps={steps}", "recovery.max_server_restarts=0", "recovery.no_server_timeout_s=5"], run_dir
    ).start()
    try:
        run.wait_version(at)
        t0 = time.time()
        os.kill(run.server_pid("server0"), signal.SIGKILL)
        rc = run.wait(300)
    finally:
        run.kill()
    stopped = rc == 1 and "saved: a rerun with the same run_dir resumes" in run.output()
    stop_s = time.time() - t0
    rerun = RunProcess([*args_, f"total_steps={steps}"], run_dir).start()
    try:
        assert rerun.wait(600) == 0, rerun.output()[-3000:]
    finally:
        rerun.kill()
    out = result(
        "all_servers_dead",
        run_dir,
        steps,
        recover_s=None,
        steps_redone=0,
        detail=f"stopped with a checkpoint {stop_s:.1f}s after the kill: {stopped}; the rerun finished",
    )
    out["survived"] = out["survived"] and stopped
    return out


def cold_starts(model: str) -> dict[str, float]:
    """Seconds from process start to serving, for a server and for a one-rank trainer job, on this machine now."""
    from areal_async.launch.processes import Processes, free_port

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        procs = Processes(d)
        try:
            t0 = time.monotonic()
            port = free_port()
            child = procs.start_embedded_server(
                0,
                model,
                host="127.0.0.1",
                port=port,
                device="cpu",
                max_total_tokens=65536,
                max_running_requests=256,
                api_key=None,
                torch_threads=1,
            )
            import asyncio

            asyncio.run(procs.wait_healthy([child], 300))
            out["server_s"] = time.monotonic() - t0
            t0 = time.monotonic()
            procs.start_trainers(
                model=model, nproc=1, config_json="{}", seed=1, secret_hex=os.urandom(32).hex(), torch_threads=1
            )
            rank = rank_file(d, 0)
            while not os.path.exists(rank):
                assert not procs.exited(), "the trainer died"
                time.sleep(0.05)
            out["trainer_s"] = time.monotonic() - t0
        finally:
            procs.shutdown()
    return out


def resolve_model(overrides: list[str]) -> str:
    path = next((o.split("=", 1)[1] for o in overrides if o.startswith("model.path=")), "tiny")
    from areal_async.model_store import resolve_model_path

    return resolve_model_path(path)


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "server_sigkill": lambda a, d, s, at: server_kill(a, d, s, at, name="server_sigkill", sig=signal.SIGKILL, extra=[]),
    "server_sigstop": lambda a, d, s, at: server_kill(
        a, d, s, at, name="server_sigstop", sig=signal.SIGSTOP, extra=["recovery.unhealthy_restart_s=5"]
    ),
    "broadcast_sigkill": lambda a, d, s, at: server_kill(
        a, d, s, at, name="broadcast_sigkill", sig=signal.SIGKILL, extra=["train.weight_sync=broadcast"]
    ),
    "trainer_sigkill": trainer_kill,
    "controller_mid_step": lambda a, d, s, at: controller_kill(a, d, s, at, in_save=False),
    "controller_in_save": lambda a, d, s, at: controller_kill(a, d, s, at, in_save=True),
    "all_servers_dead": all_servers_dead,
}


def markdown(rows: list[dict[str, Any]], cold: dict[str, float]) -> str:
    lines = [
        "| scenario | faults injected | survived | time to recover s | cold start s (limit) | steps redone | "
        "samples lost | tokens kept / recomputed (calls in flight) | what happened |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        limit = cold.get("trainer_s") if r["scenario"].startswith(("trainer", "controller")) else cold.get("server_s")
        rec = "n/a" if r["recover_s"] is None else f"{r['recover_s']:.1f}"
        lines.append(
            f"| {r['scenario']} | 1 | {'yes' if r['survived'] else 'NO'} | {rec} | {limit:.1f} | "
            f"{r['steps_redone']} | {r['samples_lost']} | {r['tokens_kept']} / {r['tokens_recomputed']} "
            f"({r['calls_in_flight_at_kill']}) | {r['detail']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", type=int, default=6, help="the version at which each fault is injected")
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--keep", action="store_true", help="keep the run directories (next to --out)")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    out_dir = os.path.splitext(os.path.abspath(args.out))[0] + "_runs"
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    cold = cold_starts(resolve_model(args.overrides))
    print(f"cold start: server {cold['server_s']:.1f}s, trainer {cold['trainer_s']:.1f}s", flush=True)
    rows = []
    for name in args.scenarios:
        run_dir = os.path.join(out_dir, name)
        common = [f"run_dir={run_dir}", *BASE, *args.overrides]
        t0 = time.monotonic()
        try:
            row = SCENARIOS[name](common, run_dir, args.steps, args.at)
        except AssertionError as e:
            row = {
                "scenario": name,
                "survived": False,
                "samples_lost": None,
                "recover_s": None,
                "steps_redone": None,
                "detail": f"FAILED: {str(e)[:300]}",
            }
        row["wall_s"] = time.monotonic() - t0
        row["leftover_processes"] = len(wait_gone(run_children(run_dir), 60))  # must be 0
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "recovery"}), flush=True)
    report = {
        "cold_start": cold,
        "batch": {"groups": B, "group_size": N},
        "steps": args.steps,
        "at": args.at,
        "rows": rows,
        "command": " ".join([sys.executable, *sys.argv]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    table = markdown(rows, cold)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table)
    print(table)
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

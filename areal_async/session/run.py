"""`python -m areal_async.run [--config FILE] [key=value ...]`: one asynchronous RL run, end to end.

With no arguments it trains the project's tiny model on the synthetic arithmetic task on this machine's CPU: one
embedded inference server, one torchrun trainer, async mode (the code defaults, which configs/default.yaml lists).
Everything a run makes lands in `run_dir`: metrics.jsonl, trained_index.jsonl (which sample draws each step trained
or dropped), TensorBoard events, progress.png, logs/, checkpoints/, the final HF checkpoint and summary.json. A run
directory with a checkpoint is resumed (resume=false starts over).

The shape of a run: `prepare` checks everything that can be checked (config, model, tokenizer and chat template,
dataset, reward, workflow) before anything starts (prepare.py); a `Launcher` starts the servers and trainers
(launch/); the training runs under `supervise`, which hands every process event to the failure policy; teardown
always runs; report.py writes the summary. When a part dies (`roll_back`, rollback.py): docs/recovery.md;
how the weights reach the servers (`connect_weights`, connect.py): docs/weights.md.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import logging.handlers
import os
import shutil
import sys
import time
from typing import Any

import yaml

from areal_async.config import ConfigError, RunConfig, load_config, to_dict
from areal_async.config.help import describe
from areal_async.inference.client import InferenceClient, WeightTarget
from areal_async.launch import (
    Cluster,
    Launcher,
    RecoveryLog,
    RunRecovery,
    failure_policy,
    interrupt_on_sigterm,
    launcher_for,
    supervise,
)
from areal_async.launch.eval_server import EvalServerProcess
from areal_async.launch.processes import Processes
from areal_async.launch.recovery import LOG_FILE as RECOVERY_LOG_FILE
from areal_async.launch.recovery import RunLock
from areal_async.launch.sbatch import cli as slurm_submission
from areal_async.metrics import MetricsLogger, keep_aside
from areal_async.metrics_sinks import RunInfo, SinkSet
from areal_async.rollout.checkpoints import RunState, load_state, rewind_records
from areal_async.rollout.controller import AsyncRLController
from areal_async.rollout.evaluate import evaluate
from areal_async.rollout.ledger import FILE_NAME as LEDGER_FILE
from areal_async.rollout.ledger import SampleLedger
from areal_async.rollout.outcomes import NoServerServing, RunStopped, TrainerLost
from areal_async.rollout.pinned_eval import PinnedEvals, link_checkpoint
from areal_async.rollout.samples import SampleStream
from areal_async.rollout.weight_sync import WeightSync
from areal_async.session.connect import bring_servers_to, connect_trainers, connect_weights
from areal_async.session.prepare import RunPlan, make_score, prepare, resolve_model  # noqa: F401 (public here too)
from areal_async.session.report import print_summary, server_busy_s, summarize, write_outputs  # noqa: F401
from areal_async.session.resources import Session
from areal_async.session.rollback import restart_trainers, retire_controller, rewind, roll_back  # noqa: F401

try:
    import uvloop  # optional: a faster event loop where it is installed
except ImportError:
    uvloop = None

log = logging.getLogger("areal_async.run")

__all__ = [
    "Session",
    "check_before_submission",
    "main",
    "make_score",
    "open_run_dir",
    "prepare",
    "resolve_model",
    "rewind_records",
    "roll_back",
    "run",
    "setup_logging",
    "train",
]


def open_run_dir(plan: RunPlan) -> RunState:
    """Resume (cut the run's records back to the checkpoint) or start over (set older records aside)."""
    run_dir = plan.cfg.run_dir
    os.makedirs(run_dir, exist_ok=True)
    if not plan.cfg.resume and os.path.isdir(os.path.join(run_dir, "checkpoints")):
        shutil.rmtree(os.path.join(run_dir, "checkpoints"))
    if plan.resumed:
        state, ckpt = plan.resumed
        rewind_records(run_dir, state.version)
        log.info(
            "resuming from %s at version %d (next draw %d, %d to draw again)",
            ckpt,
            state.version,
            state.data_position,
            len(state.pending),
        )
    else:
        state = RunState()
        for name in ("metrics.jsonl", LEDGER_FILE, RECOVERY_LOG_FILE):
            kept = keep_aside(os.path.join(run_dir, name))
            if kept:
                log.info("a new run in %s: the previous %s is kept as %s", run_dir, name, os.path.basename(kept))
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(to_dict(plan.cfg), f, indent=2)
    return state


# ---- the run ----------------------------------------------------------------------------------------------------


async def run(cfg: RunConfig, workflow: Any = None, launcher: Launcher | None = None) -> dict[str, Any]:
    """Check, launch, train, write the outputs; always tear down. `workflow`: see `prepare`. `launcher` replaces
    the one `server.backend` picks (`launch.launcher_for`)."""
    plan = prepare(cfg, workflow)
    open_run_log(plan.cfg.run_dir)  # the checks passed: from here on the run has a directory
    session = Session(rewards=plan.rewards)
    sinks = SinkSet(plan.sinks)  # metrics.loggers: open for the whole run, across rollbacks (metrics_sinks.py)
    cluster: Cluster | None = None
    lock = RunLock(plan.cfg.run_dir)
    ended = "failed"
    try:
        try:
            crashed = lock.acquire()
        except RuntimeError as e:
            raise ConfigError(f"run_dir: {e}") from None
        state = open_run_dir(plan)
        resumed_at = plan.resumed[0].version if plan.resumed else None
        sinks.open(RunInfo.of(plan.cfg.run_dir, to_dict(plan.cfg), resumed_at))
        session.logger = MetricsLogger(plan.cfg.run_dir, sinks=sinks)
        session.recovery_log = rlog = RecoveryLog(plan.cfg.run_dir)
        rlog.metrics = session.log_metrics
        rlog.version = lambda: session.controller.state.version if session.controller else state.version
        if crashed is not None:
            _record_controller_restart(rlog, crashed, plan)
        launcher = launcher or launcher_for(plan.cfg)
        cluster = await launcher.launch(plan.cfg, model_path=plan.model_path, trainer_resume=plan.trainer_resume)
        lock.mark_running()  # started up: a controller that dies from now on leaves a run to recover
        policy = failure_policy(plan.cfg, cluster, session, rlog)
        session.recovery = policy if isinstance(policy, RunRecovery) else None  # the training runs under its guard
        try:
            out = await supervise(train(plan, state, cluster, session), cluster, policy)
        except RunStopped as e:
            _write_stopped(plan.cfg.run_dir, str(e), rlog)
            raise
        ended = "stopped"
        return out
    finally:
        await session.close()
        await asyncio.to_thread(sinks.close)  # the records still queued reach the loggers, which then close
        if cluster is not None:
            if session.trainers_stopped:
                await trainers_exit_on_their_own(cluster)
            await cluster.shutdown()
        lock.release(ended)


async def trainers_exit_on_their_own(cluster: Cluster, timeout_s: float = 20.0) -> None:
    """After the ranks took the shutdown RPC, give their torchrun agents (or the srun steps running them) time to
    exit by themselves before the launcher signals what is left: torchrun stopped by a signal prints a
    SignalException traceback into trainer.log on every clean run. Clusters without local children skip this."""
    procs = getattr(cluster, "processes", None)
    if isinstance(procs, Processes):
        if not await asyncio.to_thread(procs.wait_exited, "trainer", timeout_s):
            log.info("the trainer job did not exit within %.0fs of its shutdown; the launcher stops it", timeout_s)


def _record_controller_restart(rlog: RecoveryLog, crashed: dict[str, Any], plan: RunPlan) -> None:
    started = crashed.get("started")
    when = time.strftime("%H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    what = f"the controller (pid {crashed.get('pid', '?')}, started {when}) ended without stopping (killed?)"
    rlog.record("fault", "controller_exited", "controller", what, "rerun with the same run_dir")
    if plan.resumed:
        st, ckpt = plan.resumed
        rlog.record(
            "recovered",
            "controller_resumed",
            "controller",
            f"resumed from {ckpt}",
            f"version {st.version}, next draw {st.data_position}, {len(st.pending)} draws to draw again; "
            "records after the checkpoint cut back",
        )
    else:
        rlog.record("recovered", "controller_resumed", "controller", "no checkpoint yet", "started over")


def _write_stopped(run_dir: str, why: str, rlog: RecoveryLog) -> None:
    """summary.json of a run that stopped before its end: why, and what recovery did."""
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"completed": False, "stopped": why, "recovery": rlog.summary()}, f, indent=2)


async def train(plan: RunPlan, state: RunState, cluster: Cluster, session: Session) -> dict[str, Any]:
    """The RL run on a launched cluster: connect, bring the servers to the run's version, train, save, report.

    Under a recovery policy the training runs in segments: when the trainer job fails, `roll_back` restarts it
    from the last checkpoint, the controller starts again from that checkpoint's state, and the run goes on."""
    cfg, t0 = plan.cfg, time.monotonic()
    rec = session.recovery
    launch_state = copy.deepcopy(state)
    session.trainers = trainers = await connect_trainers(cluster, cfg)
    urls = [s.url for s in cluster.servers]
    rc = cfg.recovery
    # with recovery, requests wait for a server as long as the run does (no_server_timeout_s) before failing
    session.client = client = InferenceClient(
        urls,
        api_key=cfg.server.api_key,
        health_timeout_s=rc.health_timeout_s,
        **({"unavailable_timeout_s": rc.no_server_timeout_s} if rc.enabled else {}),
    )
    weights = await connect_weights(plan, trainers, client, cluster)
    if rec is not None:
        rec.attach(client)
    if cfg.eval.mode == "pinned" and plan.eval_samples:
        session.pinned_evals = make_pinned_evals(plan, session, trainers, weights)
    if plan.resumed:  # the servers start from the base model: bring them to the resumed version
        await bring_servers_to(weights, state.version)
    elif cfg.server.backend == "external":  # servers used before may hold other weights under another label
        client.weight_target = WeightTarget(state.version, plan.model_path)
        await client.bring_to_target()
    log.info(
        "servers %s and %d trainer rank(s) ready in %.1fs", urls, cluster.trainers.world_size, time.monotonic() - t0
    )
    checkpointed = plan.resumed is not None
    while True:
        session.controller = ctrl = make_controller(plan, state, session, weights, checkpointed)
        segment_t0, segment_wall0 = time.monotonic(), state.wall_s
        try:
            state = await (
                rec.guard(run_and_save(ctrl), stop=ctrl.request_stop) if rec is not None else run_and_save(ctrl)
            )
            break
        except TrainerLost as lost:
            if rec is None:  # recovery.enabled=false: a lost trainer ends the run
                raise
            state, weights, checkpointed = await roll_back(plan, cluster, session, lost, launch_state, weights)
            # wall time counts what the run really spent, the steps it now trains again and the recovery included
            state.wall_s = segment_wall0 + time.monotonic() - segment_t0
        except NoServerServing as e:
            raise RunStopped(await _stop_without_servers(ctrl, session, e)) from e
    ctrl.finish(completed=True)
    final = await _copy_final(ctrl, cfg.run_dir)
    summary = summarize(
        plan,
        ctrl,
        state,
        num_servers=len(urls),
        final_checkpoint=final,
        recovery=session.recovery_log.summary() if session.recovery_log else None,
    )
    write_outputs(cfg.run_dir, summary, session.logger)
    return summary


def make_controller(
    plan: RunPlan, state: RunState, session: Session, weights: WeightSync, checkpointed: bool
) -> AsyncRLController:
    cfg, client = plan.cfg, session.client
    assert client is not None and session.trainers is not None
    urls, api_key = list(client.urls), cfg.server.api_key
    return AsyncRLController(
        cfg.schedule,
        client,
        session.trainers,
        plan.workflow,
        SampleStream(plan.train_samples, seed=cfg.seed),
        cfg.run_dir,
        weights=weights,
        evaluator=make_evaluator(plan, client) if plan.eval_samples else None,
        logger=session.logger,
        state=state,
        ledger=SampleLedger(os.path.join(cfg.run_dir, LEDGER_FILE)),
        busy_probe=lambda: server_busy_s(urls, api_key),
        keep_checkpoints=cfg.recovery.keep_checkpoints,
        checkpointed=checkpointed,
        journal=cfg.recovery.journal,
        # pinned without held-out prompts has nothing to pin
        eval_mode="overlap" if cfg.eval.mode == "pinned" and session.pinned_evals is None else cfg.eval.mode,
        pinned_evals=session.pinned_evals,
    )


async def run_and_save(ctrl: AsyncRLController) -> RunState:
    state = await ctrl.run()
    await ctrl.save_checkpoint()
    return state


async def _stop_without_servers(ctrl: AsyncRLController, session: Session, why: NoServerServing) -> str:
    """No server is left: save a checkpoint when the step in progress finished (a training loop that had to be
    cancelled may have left the trainer a step ahead), and say how to resume."""
    try:
        if not why.stopped_cleanly:
            raise RuntimeError("the training loop did not stop by itself")
        path = await asyncio.wait_for(ctrl.save_checkpoint(), 600)
        where = f"checkpoint v{ctrl.state.version} ({path}) saved: a rerun with the same run_dir resumes from it"
    except Exception as e:
        found = load_state(ctrl.run_dir)
        where = (
            f"no checkpoint saved now ({type(e).__name__}: {e}); the last one (v{found[0].version}, "
            f"{found[1]}) resumes the run"
            if found
            else f"no checkpoint saved now ({e}), and there is none"
        )
    ctrl.finish(completed=False)
    session.controller = None
    return f"{why}; the run stops: {where}"


# ---- evals and the final checkpoint -----------------------------------------------------------------------------


def make_evaluator(plan: RunPlan, client: InferenceClient | None) -> Any:
    """The held-out eval through `client`; with None, a function of the client to evaluate through (the pinned
    evals' server)."""
    cfg = plan.cfg
    priority = cfg.eval.priority
    if priority is None and cfg.server.backend == "embedded":
        priority = 1

    async def evaluator(through: Any = None) -> dict[str, float]:
        return await evaluate(
            through if through is not None else client,
            plan.tokenizer,
            plan.eval_samples,
            plan.score,
            max_new_tokens=cfg.eval.max_new_tokens,
            use_chat_template=cfg.data.apply_chat_template,
            priority=priority,
        )

    return evaluator


def make_pinned_evals(plan: RunPlan, session: Session, trainers: Any, weights: WeightSync) -> PinnedEvals:
    """eval.mode=pinned (rollout/pinned_eval.py): the eval server (eval.server_url, else one this run starts) and
    the snapshot of a version: hard links to its disk-sync checkpoint when that is a full one, else a full
    checkpoint the trainer writes (broadcast and delta sync leave none of the version on disk)."""
    cfg = plan.cfg
    root = os.path.join(cfg.run_dir, "eval_weights")
    if cfg.eval.server_url is not None:
        fixed = cfg.eval.server_url

        async def server_url() -> str:
            return fixed
    else:
        session.eval_server = EvalServerProcess(cfg, plan.model_path)
        server_url = session.eval_server.url

    async def snapshot(version: int) -> str:
        dest = os.path.join(root, f"v{version}")
        latest = weights.latest_checkpoint
        if latest is not None and os.path.basename(latest.rstrip("/")) == f"v{version}":
            return await asyncio.to_thread(link_checkpoint, latest, dest)
        pub = await trainers.publish(version, root, keep=1_000_000)  # pinned_eval.py deletes each after its eval
        return pub.path

    evaluator = make_evaluator(plan, None)

    def make_client(url: str) -> InferenceClient:
        # a short wait for an unavailable server: a dead eval server fails its eval, it does not stall
        return InferenceClient([url], api_key=cfg.server.api_key, unavailable_timeout_s=30.0)

    return PinnedEvals(server_url=server_url, make_client=make_client, snapshot=snapshot, evaluate=evaluator)


async def _copy_final(ctrl: AsyncRLController, run_dir: str) -> str | None:
    # train.lora: the last adapters, as peft loads them; copied first (publish_final may write that version's
    # directory)
    final_adapter = getattr(ctrl.weights, "final_adapter", None)
    adapter = await final_adapter(ctrl.state.version) if final_adapter is not None else None
    if adapter and os.path.isdir(adapter):
        shutil.rmtree(os.path.join(run_dir, "final_adapter"), ignore_errors=True)
        shutil.copytree(adapter, os.path.join(run_dir, "final_adapter"))
    src = await ctrl.publish_final()
    if not src:
        return None
    # hard links, not a copy: a published version's files are never written again (a new version is a new
    # directory), and a copy would write the whole model once more at the end of every run
    return await asyncio.to_thread(link_checkpoint, src, os.path.join(run_dir, "final"))


# ---- the command line -------------------------------------------------------------------------------------------


def program_name(argv0: str | None = None) -> str:
    """How the user started this command, for usage lines: `areal-run` (the console script) or `python -m
    areal_async.run` (anything else: `-m`, or `main()` called from another program)."""
    name = os.path.basename(argv0 if argv0 is not None else (sys.argv[0] if sys.argv else ""))
    return name if name.startswith("areal-run") else "python -m areal_async.run"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags and key=value overrides in any order (`mode=sync --print-config eta=0`): overrides keep their order,
    which decides when a key is given twice."""
    p = argparse.ArgumentParser(
        prog=program_name(),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="configuration keys (set in a --config file or as key=value; mode, eta, steps and total_steps are "
        "short for their schedule. keys):\n" + describe(),
    )
    p.add_argument(
        "--config",
        default=None,
        help="YAML config file (may start from another with `base: FILE`); "
        "without it the code defaults (= configs/default.yaml) apply",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument(
        "--print-sbatch",
        action="store_true",
        help="launcher=slurm: print the batch script that runs this command, and exit (docs/cluster.md)",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. mode=sync eta=2 train.optim.lr=1e-4")
    return p.parse_intermixed_args(argv)


class _RunLog(logging.handlers.MemoryHandler):
    """run.log before the run has a directory: records are held in memory until the checks before launch pass
    (`open_run_log`), so a run that fails them creates no run directory, and run.log still starts at the top."""

    def __init__(self) -> None:
        super().__init__(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)

    def shouldFlush(self, record: logging.LogRecord) -> bool:
        return self.target is not None

    def open(self, run_dir: str) -> None:
        if self.target is None:
            os.makedirs(run_dir, exist_ok=True)
            target = logging.FileHandler(os.path.join(run_dir, "run.log"))
            target.setFormatter(self.formatter)
            self.setTarget(target)
            self.flush()

    def close(self) -> None:
        target = self.target
        super().close()
        if target is not None:
            target.close()


def open_run_log(run_dir: str) -> None:
    """Point the held run.log (set up by `setup_logging`) at `run_dir/run.log`; nothing when there is none."""
    for h in logging.getLogger().handlers:
        if isinstance(h, _RunLog):
            h.open(run_dir)


def setup_logging(run_dir: str | None = None) -> None:
    """Console logging, and run.log: written at once under `run_dir`, or (None) held until `open_run_log`."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    fileh = _RunLog()
    fileh.setFormatter(fmt)
    if run_dir is not None:
        fileh.open(run_dir)
    root.addHandler(console)
    root.addHandler(fileh)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def check_before_submission(cfg: RunConfig, workflow: Any = None) -> None:
    """Every check `prepare` makes, run on the submitting host before `sbatch`: a typo in model.path, a missing
    dataset, an unknown reward or a model without the chat template asked for is a ConfigError here rather than
    after the job leaves the queue. The host checks of `prepare` (GPUs, ports) skip Slurm runs: those are the
    job's nodes'. Nothing is kept (the job prepares again where it runs)."""
    plan = prepare(cfg, workflow)
    rewards = getattr(plan.rewards, "close", None)
    if rewards is not None:
        asyncio.run(rewards())


def main(argv: list[str] | None = None, workflow: Any = None, launcher: Launcher | None = None) -> int:
    """The command line entry point, also callable from Python: `main(["steps=20"], workflow=make_workflow)` runs
    with the same config handling, logging and exit codes, and the given workflow and launcher (see `run`)."""
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    interrupt_on_sigterm()  # SIGTERM tears down like Ctrl-C
    # launcher=slurm outside an allocation: submit the job (or print its script) and return
    code = slurm_submission(
        cfg,
        args.config,
        args.overrides,
        print_sbatch=args.print_sbatch,
        check=lambda c: check_before_submission(c, workflow),
    )
    if code is not None:
        return code
    setup_logging()  # run.log lands in run_dir once the checks before launch pass
    runner = uvloop.run if uvloop is not None else asyncio.run
    try:
        runner(run(cfg, workflow, launcher))
    except KeyboardInterrupt:
        log.warning("interrupted; children stopped")
        return 130
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        log.error("run failed: %s: %s", type(e).__name__, e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

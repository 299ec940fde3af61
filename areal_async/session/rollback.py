"""When the trainer job fails (docs/recovery.md): `roll_back` restarts it from the last checkpoint (or the base
model when there is none yet), with backoff, and brings the controller state, the sample ledger, metrics.jsonl and
the servers' weights back to that version; once `recovery.max_trainer_restarts` are spent it raises the
`RunStopped` that says what resumes the run. A cluster that restarts the job on fewer hosts than before (a trainer
host lost, recovery.shrink_trainers, launch/shrink.py) says so in `last_shrink`, recorded as `trainer_shrunk`.
Every step is written to the recovery log.

Apart from run.py because it is the one path of a run that goes backwards; `train` in run.py calls `roll_back` when
a segment ends with `TrainerLost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

from areal_async.launch import ChildFailed, Cluster, RecoveryLog, RunRecovery
from areal_async.metrics import MetricsLogger
from areal_async.rollout.checkpoints import RunState, rewind_records, rollback_target
from areal_async.rollout.outcomes import RunStopped, TrainerLost
from areal_async.rollout.weight_sync import WeightSync
from areal_async.session.connect import bring_servers_to, connect_trainers, connect_weights
from areal_async.session.prepare import RunPlan
from areal_async.session.resources import Session
from areal_async.train.client import TrainerError

__all__ = ["restart_trainers", "retire_controller", "rewind", "roll_back"]


async def roll_back(
    plan: RunPlan, cluster: Cluster, session: Session, lost: BaseException, launch_state: RunState, weights: WeightSync
) -> tuple[RunState, WeightSync, bool]:
    """The trainer job failed: restart it from the last checkpoint (or the base model when there is none yet),
    bring the controller state, the sample ledger, metrics.jsonl and the servers' weights back to that version,
    and return (state, weight sync, whether the state is a checkpoint's). Raises `RunStopped` once
    `recovery.max_trainer_restarts` are spent: the last checkpoint then resumes the run."""
    t_lost = time.monotonic()
    failed_at, base_accuracy = retire_controller(session, launch_state)
    target, ckpt = await restart_trainers(plan, cluster, session, lost, launch_state, failed_at)
    if target.version == 0 and target.base_accuracy is None:
        target.base_accuracy = base_accuracy  # the base model's eval is not run twice
    rewind(session, plan.cfg.run_dir, target.version)
    weights = await connect_weights(plan, session.trainers, session.client, cluster, previous=weights)
    await bring_servers_to(weights, target.version)
    layout = cluster.trainer_layout().record() if hasattr(cluster, "trainer_layout") else None
    _record_rolled_back(session, failed_at, target, ckpt, time.monotonic() - t_lost, layout)
    return target, weights, ckpt is not None


def retire_controller(session: Session, launch_state: RunState) -> tuple[int, float | None]:
    """Close the failed segment's controller (its ledger file, before the file is cut back); returns the version
    it failed at and the base model's accuracy it measured."""
    ctrl, session.controller = session.controller, None
    if ctrl is None:
        return launch_state.version, None
    ctrl.finish(completed=False)
    return ctrl.state.version, ctrl.state.base_accuracy


async def restart_trainers(
    plan: RunPlan, cluster: Cluster, session: Session, lost: BaseException, launch_state: RunState, failed_at: int
) -> tuple[RunState, str | None]:
    """Restart the trainer job from the rollback target (with backoff; a new job that fails too counts as another
    restart) and connect to it; returns the target and its checkpoint directory (None: the base model)."""
    cfg, rec, rlog = plan.cfg, session.recovery, session.recovery_log
    assert rec is not None and rlog is not None
    refusal = rec.trainer_restart_refusal()
    if refusal is not None:  # no restart is announced that will not be tried
        rlog.record(
            "fault", "trainer_failed", "trainer", str(lost), "not restartable: the run stops", version=failed_at
        )
        raise _not_restartable(rlog, lost, refusal, failed_at)
    while True:
        target, ckpt = rollback_target(cfg.run_dir, launch_state)
        delay = rec.trainer_restart_delay()
        if delay is None:
            raise _restarts_spent(plan, rec, rlog, lost, target, ckpt, failed_at)
        rlog.record(
            "fault",
            "trainer_failed",
            "trainer",
            str(lost),
            f"restart {rec.trainer_restarts} of {cfg.recovery.max_trainer_restarts} in {delay:.1f}s from "
            f"{_where(target, ckpt)}",
            version=failed_at,
        )
        if session.trainers is not None:
            with contextlib.suppress(Exception):
                await session.trainers.close()
            session.trainers = None
        await asyncio.sleep(delay)
        try:
            await rec.guard(cluster.restart_trainers(os.path.join(ckpt, "trainer") if ckpt else None))
            _record_shrink(rlog, cluster, failed_at)
            session.trainers = await rec.guard(connect_trainers(cluster, cfg))
            return target, ckpt
        except NotImplementedError as e:  # found out by trying: a Slurm trainer node that went away (NodeLost)
            raise _not_restartable(rlog, lost, str(e), failed_at) from e
        except (TrainerLost, TrainerError, ConnectionError, TimeoutError, ChildFailed) as e:
            lost = e  # the new job failed too: counts as another restart


def _record_shrink(rlog: RecoveryLog, cluster: Cluster, failed_at: int) -> None:
    """When the restart just done shrank the trainer job to the hosts left (launch/shrink.py), record which hosts
    it left out and why, and the new layout (`trainer_shrunk`; `trainer_recovered` follows once the run is back)."""
    shrink = getattr(cluster, "last_shrink", None)
    if shrink is None:
        return
    rlog.record(
        "info",
        "trainer_shrunk",
        "trainer",
        "; ".join(f"{host}: {why}" for host, why in shrink.lost.items()),
        f"the new trainer job runs on the hosts left: {shrink.after.describe()} (was {shrink.before.describe()})",
        version=failed_at,
        lost_hosts=sorted(shrink.lost),
        trainer_layout=shrink.after.record(),
        previous_layout=shrink.before.record(),
    )


def _not_restartable(rlog: RecoveryLog, lost: BaseException, why: str, failed_at: int) -> RunStopped:
    """Record that the trainer job cannot be restarted (`why`: the cluster's reason, naming the host or node and
    what to do); the error that stops the run."""
    rlog.record("gave_up", "trainer_not_restartable", "trainer", why, "the run stops", version=failed_at)
    return RunStopped(
        f"the trainer job failed ({str(lost).splitlines()[0]}) and cannot be restarted by this run ({why}); "
        "the last checkpoint resumes it"
    )


def _where(target: RunState, ckpt: str | None) -> str:
    return f"checkpoint v{target.version} ({ckpt})" if ckpt else "the base model (no checkpoint yet)"


def _restarts_spent(
    plan: RunPlan,
    rec: RunRecovery,
    rlog: RecoveryLog,
    lost: BaseException,
    target: RunState,
    ckpt: str | None,
    failed_at: int,
) -> RunStopped:
    """Record that the trainer restarts are spent; the error that stops the run, saying what resumes it."""
    resume = (
        f"its last checkpoint (v{target.version}, {ckpt}) resumes it: run the same command again"
        if ckpt
        else "no checkpoint was saved, so a rerun starts over"
    )
    rlog.record("fault", "trainer_failed", "trainer", str(lost), "no restart left", version=failed_at)
    rlog.record(
        "gave_up",
        "trainer_restarts_spent",
        "trainer",
        f"{rec.trainer_restarts} restart(s) spent (recovery.max_trainer_restarts)",
        "the run stops; " + resume,
        version=failed_at,
    )
    return RunStopped(
        f"the trainer job failed ({str(lost).splitlines()[0]}) and its restarts are spent "
        f"(recovery.max_trainer_restarts={plan.cfg.recovery.max_trainer_restarts}); {resume}"
    )


def rewind(session: Session, run_dir: str, version: int) -> None:
    """Cut metrics.jsonl, trained_index.jsonl, later checkpoints and published weights back to `version`, with
    the metrics writer closed meanwhile."""
    sinks = None
    if session.logger is not None:
        session.logger.close()
        sinks = session.logger.sinks  # the run's wandb or own sinks go on across the rollback
    rewind_records(run_dir, version)
    session.logger = MetricsLogger(run_dir, sinks=sinks)


def _record_rolled_back(
    session: Session,
    failed_at: int,
    target: RunState,
    ckpt: str | None,
    recover_s: float,
    layout: dict[str, object] | None = None,
) -> None:
    assert session.client is not None and session.recovery_log is not None
    held = {u: st["version"] for u, st in session.client.stats()["servers"].items() if st["state"] == "serving"}
    session.recovery_log.record(
        "recovered",
        "trainer_recovered",
        "trainer",
        f"the trainer job failed at version {failed_at}",
        f"trainers restarted from {_where(target, ckpt)}; controller state, sample ledger, metrics and the servers' "
        f"weights rolled back to version {target.version}",
        recover_s=recover_s,
        steps_redone=failed_at - target.version,
        version=target.version,
        server_versions=held,
        **({"trainer_layout": layout} if layout is not None else {}),
    )

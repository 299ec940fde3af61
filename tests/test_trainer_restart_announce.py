"""A trainer restart is announced ("restart 1 of 2 in 1.0s") only when one will be tried: a cluster that cannot
restart its trainers (agents started by hand elsewhere with recovery.shrink_trainers=false, a trainer job this
cluster did not start) says so through
`can_restart_trainers`, and session/rollback.py records the failure and stops the run without counting a restart. A
restart that is tried and then turns out impossible (a Slurm trainer node that went away: `NodeLost`) is still
announced, because it was attempted. No processes: the clusters' own queries, and run_rollback on fakes."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from areal_async.config import load_config
from areal_async.launch.api import ServerHandle, TrainerHandle
from areal_async.launch.local import LocalCluster
from areal_async.launch.outcomes import RunStopped, TrainerLost
from areal_async.launch.processes import Processes
from areal_async.launch.recovery import RecoveryLog, RunRecovery
from areal_async.launch.slurm import NodeLost, SlurmCluster
from areal_async.rollout.checkpoints import RunState
from areal_async.session.rollback import restart_trainers

TRAINERS = TrainerHandle(2, "/nowhere", b"s" * 32, "127.0.0.1")


def _local(cfg, *, ours: bool = True) -> LocalCluster:
    kw = {"cfg": cfg, "model_path": "/m"} if ours else {}
    return LocalCluster(Processes(cfg.run_dir), [ServerHandle("server0", "http://127.0.0.1:1")], TRAINERS, **kw)


class TriedCluster:
    """A cluster that can restart its trainers, whose restart then fails the way a lost Slurm node does."""

    can_restart_trainers = True

    def __init__(self) -> None:
        self.servers = [ServerHandle("server0", "http://127.0.0.1:1")]
        self.trainers = TRAINERS
        self.tries = 0

    def trainer_pids(self) -> set[int]:
        return set()

    async def restart_trainers(self, resume):
        self.tries += 1
        raise NodeLost("the trainer step 7.1 cannot be replaced in this allocation: node n2 went away (DOWN)")


def _roll_back(cfg, cluster) -> tuple[RunStopped, list[dict]]:
    """run_rollback.restart_trainers after a trainer failure at version 3; the error it stops with, the records."""
    rlog = RecoveryLog(cfg.run_dir)
    session = SimpleNamespace(recovery=RunRecovery(cfg, cluster, rlog), recovery_log=rlog, trainers=None)
    lost = TrainerLost("trainer rank 1 on h1 (10.0.0.2): train_step failed: ConnectionError")
    with pytest.raises(RunStopped) as stopped:
        asyncio.run(restart_trainers(SimpleNamespace(cfg=cfg), cluster, session, lost, RunState(), 3))
    return stopped.value, rlog.history


def test_clusters_say_whether_they_can_restart_their_trainers(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}"])
    assert _local(cfg).can_restart_trainers
    assert not _local(cfg, ours=False).can_restart_trainers  # external servers and trainers it was not given
    by_hand = [f"run_dir={tmp_path}", "train.nnodes=2", "train.rdzv.local_agents=1"]
    assert _local(
        load_config(None, by_hand)
    ).can_restart_trainers  # it shrinks to the agents here (test_trainer_shrink)
    cluster = _local(load_config(None, [*by_hand, "recovery.shrink_trainers=false"]))
    assert not cluster.can_restart_trainers
    assert "start the agent on the other node(s) with the command it logs" in cluster.why_trainers_cannot_restart()
    alloc = SimpleNamespace(job_id="7", nodes=["n1"], cpus={"n1": 16}, controller_node="n1")
    slurm = SlurmCluster(alloc, Processes(str(tmp_path)), None, "t", [], 1, b"s" * 32, str(tmp_path), "n1")
    assert not slurm.can_restart_trainers  # nothing to start a trainer step with yet
    slurm.start_trainers = lambda resume, generation: None
    assert slurm.can_restart_trainers


def test_agents_by_hand_stop_the_run_without_announcing_a_restart(tmp_path):
    by_hand = [f"run_dir={tmp_path}", "train.nnodes=2", "train.rdzv.local_agents=1", "recovery.restart_backoff_s=0"]
    cfg = load_config(None, [*by_hand, "recovery.shrink_trainers=false"])  # on: the job shrinks instead
    stopped, records = _roll_back(cfg, _local(cfg))
    assert [(r["outcome"], r["event"]) for r in records] == [
        ("fault", "trainer_failed"),
        ("gave_up", "trainer_not_restartable"),
    ], records
    assert not any("restart 1 of" in r["action"] for r in records), records
    assert records[0]["action"] == "not restartable: the run stops" and "h1 (10.0.0.2)" in records[0]["what"]
    assert "start the agent on the other node(s)" in records[1]["what"]
    assert "cannot be restarted by this run" in str(stopped) and "the last checkpoint resumes it" in str(stopped)


def test_a_restart_that_is_tried_is_announced_and_then_stops_the_run(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "recovery.restart_backoff_s=0"])
    cluster = TriedCluster()
    stopped, records = _roll_back(cfg, cluster)
    assert cluster.tries == 1
    assert [(r["outcome"], r["event"]) for r in records] == [
        ("fault", "trainer_failed"),
        ("gave_up", "trainer_not_restartable"),
    ], records
    assert records[0]["action"].startswith("restart 1 of 2 in 0.0s from the base model"), records[0]
    assert "node n2 went away" in records[1]["what"] and "node n2 went away" in str(stopped)

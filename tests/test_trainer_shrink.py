"""A trainer job that shrinks to the hosts left (recovery.shrink_trainers, launch/shrink.py), without processes: the
rule, a Slurm trainer step whose node went away against a scripted Slurm (the new step runs on the node left, with
srun --overlap, under a name the old step does not have), and agents started by hand under the local launcher (the
job restarts with the agents here alone), each through run_rollback.restart_trainers, which records the hosts left
out and the new layout. With shrinking off both stop the run as before. The same for real, across hosts:
tests/test_netns_slurm_faults.py and tests/test_netns_trainer_faults.py."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest

from areal_async.config import ConfigError, load_config
from areal_async.launch import local as local_launch
from areal_async.launch import slurm
from areal_async.launch.api import ServerHandle, TrainerHandle
from areal_async.launch.local import LocalCluster
from areal_async.launch.outcomes import RunStopped, TrainerLost
from areal_async.launch.processes import Processes
from areal_async.launch.recovery import RecoveryLog, RunRecovery
from areal_async.launch.shrink import hosts_left, not_shrinking_why
from areal_async.launch.slurm_allocation import Allocation, NodeHealth
from areal_async.net.rank_registry import Registration
from areal_async.rollout.checkpoints import RunState
from areal_async.session import rollback as run_rollback
from areal_async.session.rollback import restart_trainers


@pytest.fixture(autouse=True)
def no_trainers_to_connect(monkeypatch):
    async def connect(cluster, cfg):
        return SimpleNamespace(world_size=cluster.trainers.world_size)

    monkeypatch.setattr(run_rollback, "connect_trainers", connect)


def test_the_rule():
    lost = {"b": "IDLE*: its slurmd does not answer"}
    assert hosts_left(["a", "b"], lost, enabled=True) == ["a"]
    assert hosts_left(["b", "a", "c"], lost, enabled=True) == ["a", "c"]  # in order: the first hosts the rendezvous
    assert hosts_left(["a", "b"], lost, enabled=False) is None
    assert hosts_left(["a", "c"], lost, enabled=True) is None  # nothing of this job lost
    assert hosts_left(["b"], lost, enabled=True) is None  # nothing left
    assert "recovery.shrink_trainers=false" in not_shrinking_why(["a", "b"], lost, enabled=False)
    assert "no trainer node is left" in not_shrinking_why(["b"], lost, enabled=True)


def test_the_switch_is_a_checked_key():
    assert load_config(None, []).recovery.shrink_trainers is True
    with pytest.raises(ConfigError, match=r"recovery\.shrink_trainers"):
        load_config(None, ["recovery.shrink_trainers=maybe"])


def _restart(cfg, cluster) -> tuple[list[dict], RunStopped | None]:
    """run_rollback.restart_trainers after a failure at version 3, connecting to nothing; the records and the stop."""
    rlog = RecoveryLog(cfg.run_dir)
    session = SimpleNamespace(recovery=RunRecovery(cfg, cluster, rlog), recovery_log=rlog, trainers=None)
    lost = TrainerLost("trainer rank 1 on b (10.0.0.2): train_step failed: ConnectionError")
    try:
        asyncio.run(restart_trainers(SimpleNamespace(cfg=cfg), cluster, session, lost, RunState(), 3))
    except RunStopped as e:
        return rlog.history, e
    return rlog.history, None


# ---- Slurm: node b of the trainer step went away -------------------------------------------------------------------


class Child:
    def __init__(self, name: str) -> None:
        self.name, self.role, self.expected_exit, self.reported = name, "trainer", False, False
        self.proc = SimpleNamespace(pid=100, poll=lambda: None)
        self.log_path = "/nowhere.log"


class FakeProcesses:
    def __init__(self) -> None:
        self.children = [Child("trainer")]

    def stop(self, child, grace_s: float = 10.0) -> None:
        child.expected_exit = True


def _slurm(monkeypatch, tmp_path, *extra: str):
    steps = {"areal.t.trainer": "7.0"}  # the old step: no scancel ends b's part of it
    monkeypatch.setattr(slurm, "list_steps", lambda job: dict(steps))
    monkeypatch.setattr(slurm, "steps_or_none", lambda job: dict(steps))
    health = {"a": NodeHealth("MIXED", "t0"), "b": NodeHealth("MIXED*", "t0")}
    monkeypatch.setattr(slurm, "node_health", lambda nodes: {n: health[n] for n in nodes})

    def scancel(args: list[str], timeout_s: float = 30.0) -> str:  # ends every step but b's part of 7.0
        for name, sid in list(steps.items()):
            if sid in args and sid != "7.0":
                del steps[name]
        return ""

    monkeypatch.setattr(slurm, "slurm_cmd", scancel)
    cfg = load_config(None, [f"run_dir={tmp_path}", "launcher=slurm", "recovery.restart_backoff_s=0", *extra])
    alloc = Allocation("7", ["a", "b"], {"a": 8, "b": 8}, "a")
    registry = SimpleNamespace(entries={}, rank_dir=str(tmp_path))
    cluster = slurm.SlurmCluster(alloc, FakeProcesses(), registry, "t", [], 2, b"s" * 32, str(tmp_path), "a")
    cluster.trainer_nodes, cluster.node_timeout_s = ["a", "b"], 5.0
    cluster.nodes_at_start = {"a": NodeHealth("MIXED", "t0"), "b": NodeHealth("MIXED", "t0")}
    cluster.shrink_trainers = cfg.recovery.shrink_trainers
    started: list[dict] = []

    def start_trainers(resume, generation, *, nodes, overlap):
        started.append({"resume": resume, "nodes": nodes, "overlap": overlap, "name": cluster.step_name("trainer")})
        steps[cluster.step_name("trainer")] = f"7.{len(started)}"
        child = Child("trainer")
        cluster.processes.children.append(child)
        return child

    cluster.start_trainers = start_trainers
    return cfg, cluster, started


def test_a_slurm_trainer_node_gone_away_shrinks_the_step_to_the_node_left(monkeypatch, tmp_path):
    cfg, cluster, started = _slurm(monkeypatch, tmp_path)
    records, stopped = _restart(cfg, cluster)
    assert stopped is None, stopped
    # the new step on a alone, with --overlap (Slurm still counts the old step's CPUs on a), under a new name
    assert started == [{"resume": None, "nodes": ["a"], "overlap": True, "name": "areal.t.trainer.1"}]
    assert cluster.trainers.world_size == 1 and cluster.trainer_nodes == ["a"]
    assert "7.0" in cluster._abandoned  # teardown does not wait on b's part of it
    assert [(r["outcome"], r["event"]) for r in records] == [("fault", "trainer_failed"), ("info", "trainer_shrunk")]
    assert records[0]["action"].startswith("restart 1 of 2 in 0.0s"), records[0]
    shrunk = records[1]
    assert shrunk["lost_hosts"] == ["b"] and "b: MIXED*: its slurmd does not answer" in shrunk["what"], shrunk
    assert shrunk["trainer_layout"] == {"nodes": ["a"], "nproc": 1, "world_size": 1}, shrunk
    assert shrunk["previous_layout"]["world_size"] == 2, shrunk
    # a later restart of the shrunk job: on a again, still --overlap (b's part of 7.0 is still listed)
    asyncio.run(cluster.restart_trainers(None))
    assert started[-1]["nodes"] == ["a"] and started[-1]["overlap"] and cluster.last_shrink is None


def test_with_shrinking_off_a_lost_slurm_node_stops_the_run_naming_it(monkeypatch, tmp_path):
    cfg, cluster, started = _slurm(monkeypatch, tmp_path, "recovery.shrink_trainers=false")
    records, stopped = _restart(cfg, cluster)
    assert started == [] and stopped is not None
    assert [(r["outcome"], r["event"]) for r in records] == [
        ("fault", "trainer_failed"),
        ("gave_up", "trainer_not_restartable"),
    ], records
    assert "node b went away" in str(stopped) and "recovery.shrink_trainers=false" in str(stopped), stopped


# ---- launcher=local: agent 1 started by hand on host b -------------------------------------------------------------


def _by_hand(monkeypatch, tmp_path, *extra: str):
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path}",
            "train.nnodes=2",
            "train.rdzv.local_agents=1",
            "recovery.restart_backoff_s=0",
            *extra,
        ],
    )
    handle = TrainerHandle(2, str(tmp_path), b"s" * 32, "10.0.0.1")
    cluster = LocalCluster(
        Processes(str(tmp_path)), [ServerHandle("server0", "http://x:1")], handle, cfg=cfg, model_path="/m"
    )
    rank1 = Registration(kind="rank", name="rank1", address="tcp://10.0.0.2:5000", node="b", pid=9, rank=1)
    cluster.registry = SimpleNamespace(entries={"rank1": rank1}, close=lambda: asyncio.sleep(0))
    started: list = []

    async def start_trainers(procs, cfg, model_path, resume, master):
        started.append(cfg.train)
        return TrainerHandle(cfg.train.nnodes * cfg.train.nproc, cfg.run_dir, b"t" * 32, master), None

    monkeypatch.setattr(local_launch, "_start_trainers", start_trainers)
    return cfg, cluster, started


def test_agents_by_hand_shrink_to_the_agents_here(monkeypatch, tmp_path):
    cfg, cluster, started = _by_hand(monkeypatch, tmp_path)
    assert cluster.can_restart_trainers  # a restart is tried, and announced
    records, stopped = _restart(cfg, cluster)
    assert stopped is None, stopped
    assert [(t.nnodes, t.nproc, t.rdzv.local_agents) for t in started] == [(1, 1, None)]
    assert cluster.trainers.world_size == 1
    assert [(r["outcome"], r["event"]) for r in records] == [("fault", "trainer_failed"), ("info", "trainer_shrunk")]
    shrunk = records[1]
    assert shrunk["lost_hosts"] == ["b (10.0.0.2)"] and "started by hand" in shrunk["what"], shrunk
    here = socket.gethostname()
    assert shrunk["trainer_layout"] == {"nodes": [here], "nproc": 1, "world_size": 1}, shrunk
    assert shrunk["previous_layout"]["nodes"] == [here, "b (10.0.0.2)"], shrunk
    # the shrunk job is all ours: a later failure restarts it as it is
    asyncio.run(cluster.restart_trainers(None))
    assert cluster.last_shrink is None and started[-1].nnodes == 1


def test_agents_by_hand_with_shrinking_off_stop_the_run(monkeypatch, tmp_path):
    cfg, cluster, started = _by_hand(monkeypatch, tmp_path, "recovery.shrink_trainers=false")
    assert not cluster.can_restart_trainers
    records, stopped = _restart(cfg, cluster)
    assert started == [] and stopped is not None
    assert [r["event"] for r in records] == ["trainer_failed", "trainer_not_restartable"], records
    assert "recovery.shrink_trainers=false" in records[1]["what"] and "b (10.0.0.2)" in records[1]["what"]

"""The pieces of fault recovery that need no run: the controller lock and its crash record, checkpoint pruning and
the rollback's clean-up, the recovery log, restart budgets, and the guard's treatment of trainer failures.
tests/test_faults.py kills real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from areal_async.config import ConfigError, RecoveryConfig, RunConfig, load_config
from areal_async.launch.api import ProcessExited, ServerHandle, TrainerHandle
from areal_async.launch.outcomes import NoServerServing, TrainerLost
from areal_async.launch.recovery import RecoveryLog, RunLock, RunRecovery, backoff_s
from areal_async.metrics import cut_back
from areal_async.rollout.checkpoints import RunState, discard_after, prune_checkpoints, rollback_target, save_state


def _holder(run_dir, launched: bool) -> subprocess.Popen:
    """A controller that takes the lock (and, `launched`, gets as far as launching its run), then waits."""
    then = "l.mark_running(); " if launched else ""
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from areal_async.launch.recovery import RunLock; "
                "l = RunLock(sys.argv[1]); l.acquire(); "
                f"{then}print('held', flush=True); time.sleep(60)"
            ),
            str(run_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_lock_refuses_a_second_controller_and_records_a_killed_one(tmp_path):
    holder = _holder(tmp_path, launched=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=f"in use by another running controller.*{holder.pid}"):
            RunLock(str(tmp_path)).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    finally:
        holder.kill()
    lock = RunLock(str(tmp_path))
    previous = lock.acquire()  # the kernel dropped the dead holder's lock; its record says it never stopped
    assert previous is not None and previous["state"] == "running" and previous["pid"] == holder.pid
    lock.release("stopped")
    again = RunLock(str(tmp_path))
    assert again.acquire() is None  # a clean stop is no crash
    again.release("stopped")


def test_a_controller_killed_while_starting_up_is_no_crash(tmp_path):
    """Killed before its run was launched (a second Ctrl-C during start-up, a kill while the servers load): nothing
    was trained, so the next controller finds no crash to report, and still finds the lock free."""
    holder = _holder(tmp_path, launched=False)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match="in use by another running controller"):
            RunLock(str(tmp_path)).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    finally:
        holder.kill()
    lock = RunLock(str(tmp_path))
    assert lock.acquire() is None
    lock.mark_running()
    lock.release("failed")
    assert RunLock(str(tmp_path)).acquire() is None  # a run that failed and said so is no crash either


def _checkpoint(run_dir, version: int, complete: bool = True) -> str:
    path = os.path.join(run_dir, "checkpoints", f"v{version}")
    os.makedirs(os.path.join(path, "trainer"))
    if complete:
        save_state(str(run_dir), RunState(version=version), path)
    return path


def test_pruning_keeps_the_newest_complete_checkpoints_and_drops_killed_saves(tmp_path):
    for v in (2, 4, 6):
        _checkpoint(tmp_path, v)
    _checkpoint(tmp_path, 8, complete=False)  # a save that was killed: no controller.json, latest.json still at 6
    removed = prune_checkpoints(str(tmp_path), keep=2)
    assert sorted(os.path.basename(p) for p in removed) == ["v2", "v8"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest.json", "v4", "v6"]
    assert prune_checkpoints(str(tmp_path), keep=0) == []  # 0 keeps every complete one


def test_rollback_target_and_discard_after(tmp_path):
    launch = RunState(version=0, base_accuracy=0.25, pending=[1, 2])
    state, ckpt = rollback_target(str(tmp_path), launch)
    assert ckpt is None and state == launch and state is not launch and state.pending is not launch.pending
    _checkpoint(tmp_path, 3)
    os.makedirs(tmp_path / "weights" / "v3")
    os.makedirs(tmp_path / "weights" / "v5")  # published by steps the rollback trains again
    _checkpoint(tmp_path, 5, complete=False)
    state, ckpt = rollback_target(str(tmp_path), launch)
    assert state.version == 3 and ckpt.endswith("v3")
    discard_after(str(tmp_path), 3)
    assert sorted(os.listdir(tmp_path / "weights")) == ["v3"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest.json", "v3"]


def test_cut_back_keeps_recovery_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = [
        {"kind": "train", "step": 1},
        {"kind": "train", "step": 2},
        {"kind": "recovery", "step": 2},
        {"kind": "train", "step": 3},
        {"kind": "recovery", "step": 3},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "tr')  # a torn last line
    cut_back(str(path), 1)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [recs[0], recs[2], recs[4]]


def test_recovery_log_appends_and_summarises(tmp_path):
    seen = []
    rlog = RecoveryLog(str(tmp_path))
    rlog.metrics = lambda kind, step, values: seen.append((kind, step, values["event"]))
    rlog.version = lambda: 7
    rlog.record("fault", "server_exited", "server1", "exited with code -9\nlog tail", "restarting")
    rlog.record("recovered", "server_recovered", "server1", "serving", "restarted", recover_s=4.0)
    rlog.record("fault", "trainer_failed", "trainer", "rank 0 died", "restart 1 of 2", version=3)
    again = RecoveryLog(str(tmp_path))  # a later controller reads the history
    s = again.summary()
    assert s["faults"] == 2 and s["recovered"] == 1 and s["gave_up"] == 0
    assert s["by_event"] == {"server_exited": 1, "trainer_failed": 1} and s["recover_s_max"] == 4.0
    assert [r["version"] for r in again.history] == [7, 7, 3]
    assert seen == [
        ("recovery", 7, "server_exited"),
        ("recovery", 7, "server_recovered"),
        ("recovery", 3, "trainer_failed"),
    ]


def test_recovery_config_is_checked():
    assert RunConfig().recovery == RecoveryConfig()
    for bad, key in (
        ("recovery.max_trainer_restarts=-1", "recovery.max_trainer_restarts"),
        ("recovery.no_server_timeout_s=0", "recovery.no_server_timeout_s"),
        ("recovery.restart_backoff_max_s=0.1", "recovery.restart_backoff_max_s"),
        ("recovery.bogus=1", "recovery.bogus"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [bad])
    cfg = RecoveryConfig(restart_backoff_s=1.0, restart_backoff_max_s=5.0)
    assert [backoff_s(cfg, k) for k in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


class FakeCluster:
    """The recovery side of a cluster, without processes."""

    def __init__(self) -> None:
        self.servers = [ServerHandle("server0", "http://127.0.0.1:1")]
        self.trainers = TrainerHandle(1, "/nowhere", b"s" * 32, "127.0.0.1")
        self.pids = {100}
        self.can_restart_servers = False

    def trainer_pids(self) -> set[int]:
        return self.pids

    async def restart_trainers(self, resume):  # pragma: no cover - not called here
        raise AssertionError


def _exit(pid: int) -> ProcessExited:
    return ProcessExited(role="trainer", name="trainer", exit_code=1, log_path="x", log_tail="", pid=pid)


def test_guard_ends_a_segment_on_a_trainer_exit_and_ignores_a_replaced_job(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}"])

    async def main() -> None:
        cluster = FakeCluster()
        rec = RunRecovery(cfg, cluster, RecoveryLog(str(tmp_path)))
        waiting = asyncio.Event()

        async def body() -> str:
            waiting.set()
            await asyncio.sleep(30)
            return "finished"

        async def report(pid: int) -> None:
            await waiting.wait()
            await rec(_exit(pid))

        # the current job's exit ends the segment (its body is cancelled)
        task = asyncio.ensure_future(report(100))
        with pytest.raises(TrainerLost, match="the trainer job exited"):
            await asyncio.wait_for(rec.guard(body()), 10)
        await task
        # an exit of a job that was already replaced is ignored
        cluster.pids = {200}
        waiting.clear()

        async def quick() -> str:
            waiting.set()
            await asyncio.sleep(0.3)
            return "finished"

        task = asyncio.ensure_future(report(100))
        assert await asyncio.wait_for(rec.guard(quick()), 10) == "finished"
        await task
        # no server serving: the body is asked to stop, then the failure is raised
        stopped = []

        async def stop(exc: BaseException) -> None:
            stopped.append(exc)

        rec.fail(NoServerServing("none"))
        with pytest.raises(NoServerServing):
            await rec.guard(body(), stop=stop, stop_grace_s=0.1)
        assert len(stopped) == 1

    asyncio.run(main())


def test_trainer_restart_budget(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "recovery.max_trainer_restarts=2", "recovery.restart_backoff_s=1"])
    rec = RunRecovery(cfg, FakeCluster(), RecoveryLog(str(tmp_path)))
    assert [rec.trainer_restart_delay() for _ in range(3)] == [1.0, 2.0, None]

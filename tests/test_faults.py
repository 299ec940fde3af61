"""Faults on real runs of the default task (short and small): servers SIGKILLed and SIGSTOPped, a trainer rank
SIGKILLed, the controller SIGKILLed mid-step and during a checkpoint save, every server gone. Each test asserts
what the run promises (launch/recovery.py): it goes on, the restarted part holds the current weights, and the
sample accounting of trained_index.jsonl loses nothing.

Real processes throughout: `python -m areal_async.run` as a child, embedded servers over HTTP, torchrun trainers.
The tiny random checkpoint makes steps cheap; these check the machinery, not learning.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest

from areal_async.testing.faults import (
    RunProcess,
    accounting,
    assert_exact_accounting,
    metrics,
    pid_alive,
    run_children,
    signal_pid,
    summary,
    wait_gone,
)

pytestmark = pytest.mark.slow

B, N = 4, 4  # prompt groups per step, samples per group
COMMON = [
    f"schedule.batch_size={B}",
    f"rollout.group_size={N}",
    "rollout.max_new_tokens=160",
    "eval.num_prompts=8",
    "eval.max_new_tokens=16",
    "data.num_train=400",
    "data.num_eval=8",
    "train.micro_batch_tokens=1024",
    "server.max_total_tokens=16384",
    "schedule.eval_every=0",
    "recovery.restart_backoff_s=0.2",
    "recovery.health_interval_s=0.5",
    "recovery.health_timeout_s=1",
]


def args_for(tiny_ckpt: str, run_dir: str, *extra: str) -> list[str]:
    return [f"model.path={tiny_ckpt}", f"run_dir={run_dir}", *COMMON, *extra]


def assert_nothing_lost(run_dir: str, steps: int) -> dict:
    """Every step exactly once, every draw exactly once (trained, dropped or unfinished), B groups a step."""
    s = assert_exact_accounting(run_dir, steps, B, N)
    assert [r["version"] for r in metrics(run_dir, "train")] == list(range(1, steps + 1))
    return s


@pytest.fixture
def run_dir(tmp_path):
    d = str(tmp_path / "run")
    yield d
    assert not wait_gone(run_children(d), 60), "processes of the run outlived it"


def test_dead_and_hung_servers_are_restarted_with_the_current_weights(tiny_ckpt, run_dir):
    """Two servers, disk sync. server1 is SIGKILLed: its requests move to server0 with their tokens, the launcher
    restarts it and the client loads the current version into it before it serves. Then server0 is SIGSTOPped:
    the client takes it out (its health probes go unanswered) and the watchdog kills and restarts it after
    recovery.unhealthy_restart_s. The run never stops, drops no group and loses no sample. (While a recovery is
    awaited the trainer is frozen, so the run cannot finish first on a fast day.)"""
    steps = 40
    run = RunProcess(
        args_for(tiny_ckpt, run_dir, f"total_steps={steps}", "server.num_servers=2", "recovery.unhealthy_restart_s=3"),
        run_dir,
    ).start()
    try:
        run.wait_version(2)
        killed = run.server_pid("server1")
        os.kill(killed, signal.SIGKILL)
        time.sleep(0.5)  # requests in flight on server1 fail over under a running schedule
        with run.training_frozen():
            back = run.wait_recovery("server_recovered")[0]
        assert back["name"] == "server1" and back["server_version"] == back["current_version"] > 0, back
        assert run.server_pid("server1") != killed
        stopped = run.server_pid("server0")
        os.kill(stopped, signal.SIGSTOP)
        time.sleep(0.5)
        with run.training_frozen():
            hung = run.wait_recovery("server_unhealthy")[0]
            assert hung["name"] == "server0" and "silent on /health" in hung["what"], hung
            back = [r for r in run.wait_recovery("server_recovered", 2) if r["name"] == "server0"][0]
        assert back["server_version"] == back["current_version"] > 0, back
        assert not pid_alive(stopped)  # killed (SIGKILL works on a stopped process), not left behind
        assert run.wait(240) == 0, run.output()[-3000:]
    finally:
        run.kill()
    s = assert_nothing_lost(run_dir, steps)
    assert s["dropped"] == {}, s["dropped"]  # no group failed: every request in flight moved on
    rec = s["recovery"]
    assert rec["by_event"] == {"server_exited": 1, "server_unhealthy": 1} and rec["recovered"] == 2, rec
    recoveries = [r for r in metrics(run_dir, "recovery") if r["event"] == "server_recovered"]
    assert len(recoveries) == 2  # counted in metrics.jsonl too


def test_broadcast_sync_re_forms_its_group_around_a_restarted_server(tiny_ckpt, run_dir):
    """With weight broadcast, a dead server breaks the torch.distributed group: the next update forms a new one
    with the servers left, the restarted server catches up from a checkpoint the trainer publishes on demand,
    and the update after that brings it into a new group."""
    steps = 30
    run = RunProcess(
        args_for(tiny_ckpt, run_dir, f"total_steps={steps}", "server.num_servers=2", "train.weight_sync=broadcast"),
        run_dir,
    ).start()
    try:
        run.wait_version(2)
        os.kill(run.server_pid("server1"), signal.SIGKILL)
        run.wait_version(4)  # updates without server1
        with run.training_frozen():  # until the new server1 is up (catching it up needs the trainer)
            run.wait_for(lambda: run.log_count("server1 healthy at") == 2, "server1 restarted")
        back = run.wait_recovery("server_recovered")[0]
        assert back["server_version"] == back["current_version"] > 0, back
        assert run.wait(240) == 0, run.output()[-3000:]
    finally:
        run.kill()
    s = assert_nothing_lost(run_dir, steps)
    assert s["recovery"]["by_event"] == {"server_exited": 1}
    with open(os.path.join(run_dir, "run.log")) as f:
        log = f.read()
    group = r"weight-update group areal-[0-9a-f]+-{} \(gloo\): trainer rank 0 and {} server\(s\)"
    assert re.search(group.format(2, 1), log)  # not server1
    assert re.search(group.format(3, 2), log)  # with it


def test_killed_trainer_rank_rolls_the_run_back_to_its_checkpoint(tiny_ckpt, run_dir):
    """A trainer rank SIGKILLed mid-run: the trainers restart from the last checkpoint, and the controller state,
    the ledger, metrics.jsonl and the servers' weights go back to its version; the run then trains every step once
    more from there, and the final records read as if nothing had happened."""
    steps = 12
    run = RunProcess(
        args_for(tiny_ckpt, run_dir, f"total_steps={steps}", "schedule.checkpoint_every=3"), run_dir
    ).start()
    try:
        run.wait_version(5)
        os.kill(run.trainer_rank_pid(0), signal.SIGKILL)
        back = run.wait_recovery("trainer_recovered")[0]
        assert run.wait(240) == 0, run.output()[-3000:]
    finally:
        run.kill()
    failed = [r for r in run.recoveries() if r["event"] == "trainer_failed"][0]
    assert back["version"] in (3, 6) and back["version"] < failed["version"], (failed, back)
    assert back["steps_redone"] == failed["version"] - back["version"]
    assert set(back["server_versions"].values()) == {back["version"]}  # the servers hold the rolled-back weights
    s = assert_nothing_lost(run_dir, steps)
    assert s["recovery"]["by_event"] == {"trainer_failed": 1} and s["recovery"]["recovered"] == 1
    assert all(0 <= r["staleness_max"] <= 1 for r in metrics(run_dir, "train"))


def test_spent_trainer_restarts_stop_the_run_with_a_resumable_checkpoint(tiny_ckpt, run_dir):
    """With no restart left, a dead trainer stops the run, which says which checkpoint resumes it; the rerun
    does, and the final accounting holds across the stop."""
    steps = 8
    args = args_for(
        tiny_ckpt, run_dir, f"total_steps={steps}", "schedule.checkpoint_every=2", "recovery.max_trainer_restarts=0"
    )
    run = RunProcess(args, run_dir).start()
    try:
        run.wait_version(3)
        os.kill(run.trainer_rank_pid(0), signal.SIGKILL)
        assert run.wait(120) == 1
    finally:
        run.kill()
    out = run.output()
    assert "restarts are spent" in out and "resumes it: run the same command again" in out, out[-3000:]
    s = summary(run_dir)
    assert s["completed"] is False and "restarts are spent" in s["stopped"]
    assert s["recovery"]["gave_up"] == 1
    rerun = RunProcess(args, run_dir).start()
    assert rerun.wait(240) == 0, rerun.output()[-3000:]
    assert "resuming from" in rerun.output()
    assert_nothing_lost(run_dir, steps)


def test_controller_killed_mid_step_and_during_a_checkpoint_save_resumes_exactly(tiny_ckpt, run_dir):
    """SIGKILL the controller at a random moment of a step, and again while it saves a checkpoint (the trainer's
    checkpoint directory is being written, latest.json not yet moved): each rerun resumes from the last complete
    checkpoint with its version and counters, and over the final file every draw appears exactly once. Old
    checkpoints are pruned to recovery.keep_checkpoints. The episodes are multi-turn (two turns of up to 80
    tokens): the groups in flight at each kill continue from their journaled turns, and every turn they had made
    is asked for again by the restarted workflow (its environment is deterministic), so no kept token goes unused."""
    steps = 10
    args = args_for(
        tiny_ckpt,
        run_dir,
        f"total_steps={steps}",
        "schedule.checkpoint_every=1",
        "recovery.keep_checkpoints=2",
        "rollout.workflow=multi_turn",
        "rollout.multi_turn.max_turns=2",
        "rollout.max_new_tokens=80",
    )
    rng = random.Random(15)
    # 1: mid-step
    run = RunProcess(args, run_dir).start()
    try:
        run.wait_version(3)
        time.sleep(rng.uniform(0.05, 0.3))
        run.kill()
    finally:
        run.kill()
    assert not wait_gone(run_children(run_dir), 60), "the controller's children outlived it"
    # 2: during a save. The trainer writes <checkpoint>/trainer.tmp while the controller waits for it. Once it is
    # seen, the trainer rank is stopped (SIGSTOP): if trainer.tmp is still there and latest.json has not moved, the
    # save is provably under way and cannot end, however fast or slow this machine is, and the controller is
    # killed then. A save that ended between the look and the stop lets the rank go on, for the next step's save.
    caught = None
    rerun = RunProcess(args, run_dir).start()
    try:
        start = rerun.wait_for(lambda: rerun.version() or None, "a step after the resume")
        for v in range(start, steps):
            tmp = os.path.join(run_dir, "checkpoints", f"v{v}", "trainer.tmp")
            rerun.wait_for(lambda: os.path.isdir(tmp) or rerun.version() > v, f"the save of v{v}", poll_s=0.001)
            if not os.path.isdir(tmp):
                continue
            rank = rerun.trainer_rank_pid(0)
            os.kill(rank, signal.SIGSTOP)
            try:
                if os.path.isdir(tmp) and summary_of_latest(run_dir)["version"] < v:
                    rerun.kill()
                    caught = (v, summary_of_latest(run_dir))
                    break
            finally:
                signal_pid(rank, signal.SIGCONT)  # the controller is gone or goes on: the rank does as it would have
    finally:
        rerun.kill()
    assert caught is not None, f"no save of v{start}..v{steps - 1} was seen under way"
    v, latest = caught
    assert not os.path.exists(os.path.join(run_dir, "checkpoints", f"v{v}", "controller.json"))
    assert not wait_gone(run_children(run_dir), 60)
    final = RunProcess(args, run_dir).start()
    assert final.wait(240) == 0, final.output()[-3000:]
    assert f"resuming from {latest['checkpoint']} at version {latest['version']}" in final.output()
    s = assert_nothing_lost(run_dir, steps)
    assert s["recovery"]["by_event"].get("controller_exited", 0) >= 2, s["recovery"]
    # the groups in flight were continued from their journaled tokens, not generated again (rollout/journal.py)
    reports = resume_reports(run_dir)
    assert len(reports) >= 2 and sum(r["tokens_kept"] for r in reports) > 0, reports
    assert all(set(r["tokens_dropped"]) <= {JOURNAL_DROP_REASONS[0]} for r in reports), reports
    assert "groups in flight continue from the journal" in final.output()
    # pruned: the newest complete checkpoints only, and no half-written one from the killed save
    kept = {d for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.startswith("v")}
    assert kept == {f"v{steps - 1}", f"v{steps}"}, kept


JOURNAL_DROP_REASONS = (
    "made after the checkpoint by a version the resume discards",
    "asked for no more by the restarted workflow",
)


def resume_reports(run_dir: str) -> list[dict]:
    import glob
    import json

    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "journal", "resumed-v*.json"))):
        with open(path) as f:
            out.append(json.load(f))
    return out


def summary_of_latest(run_dir: str) -> dict:
    import json

    with open(os.path.join(run_dir, "checkpoints", "latest.json")) as f:
        return json.load(f)


def test_no_server_left_stops_the_run_with_a_checkpoint(tiny_ckpt, run_dir):
    """The only server dies and may not be restarted: after recovery.no_server_timeout_s without a serving server
    the run saves a checkpoint (the trainer is fine) and stops, saying so."""
    run = RunProcess(
        args_for(
            tiny_ckpt, run_dir, "total_steps=1000", "recovery.max_server_restarts=0", "recovery.no_server_timeout_s=3"
        ),
        run_dir,
    ).start()
    try:
        run.wait_version(2)
        os.kill(run.server_pid("server0"), signal.SIGKILL)
        assert run.wait(120) == 1
    finally:
        run.kill()
    out = run.output()
    assert "no inference server has been serving" in out and "saved: a rerun with the same run_dir resumes" in out
    latest = summary_of_latest(run_dir)
    acc = accounting(run_dir)
    assert latest["version"] == acc["versions"][-1] >= 2  # the checkpoint has every step the ledger has
    s = summary(run_dir)
    assert s["completed"] is False and s["recovery"]["by_event"] == {"server_exited": 1}

"""A trainer host that fails mid-step, across two real hosts (network namespaces, areal_async/testing/hosts.py). The
controller runs on h0 with its embedded server and trainer agent 0; agent 1 runs on h1, started by hand with the
command the launcher logs (`train.rdzv.local_agents=1`), so rank 1 and its gloo traffic cross h1's link. This test
process is not on their network.

- h1's link cut for a few seconds in the middle of a train step (`ip link set ... down`: packets vanish, nothing is
  reset) rides through: gloo and the controller's connection retransmit once the link is back, the step ends, and
  no fault is recorded.
- h1's link cut for longer than `recovery.trainer_unreachable_s` in the middle of a step, with
  `recovery.shrink_trainers=false`: the controller's connection to rank 1 is dropped (net/rpc_connection.py), the
  step fails naming rank 1's host, and since an agent started by hand cannot be restarted by the run, the run stops
  with its checkpoint, naming h1 and what to run again. The same command, with the agent on h1 started again as the
  stop message says, resumes the run, which then finishes every step with no sample lost or trained twice.
- Every process on h1 killed mid-step (the hand-started agent and its rank), shrinking on (the default): the trainer
  job shrinks to the agent on h0 (world size 2 -> 1), which loads the last checkpoint (written by two ranks), the run
  rolls back to it and finishes every step with no sample lost or trained twice, recoveries.jsonl naming h1.

A step is provably in progress when a fault is injected: trainer rank 0 (on h0) is stopped (SIGSTOP) as the
controller logs a step, so that step cannot end before the fault, and continued right after it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
from test_netns_faults import HostRun, agent_command

from areal_async.launch.processes import thread_env
from areal_async.testing import hosts as nshosts
from areal_async.testing.faults import assert_exact_accounting, signal_pid, summary

WHY = nshosts.skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.skipif(WHY is not None, reason=str(WHY))]

B, N, STEPS = 4, 4, 6  # prompt groups per step, samples per group, steps; a checkpoint every 2
UNREACHABLE_S = 10.0  # recovery.trainer_unreachable_s
NO_SHRINK = "recovery.shrink_trainers=false"  # the run stops instead of shrinking to h0
SHORT_CUT_S = 3.0  # well inside it, TCP's retransmission backoff (up to twice the cut) included
ARGS = [
    f"schedule.batch_size={B}",
    f"rollout.group_size={N}",
    "rollout.max_new_tokens=64",
    "eval.num_prompts=0",
    "data.num_train=400",
    "train.micro_batch_tokens=1024",
    "schedule.eval_every=0",
    "schedule.checkpoint_every=2",
    "server.max_total_tokens=8192",
    "train.nnodes=2",
    "train.rdzv.local_agents=1",
    "train.rdzv.timeout_s=60",
    "train.weight_sync=disk",
    f"recovery.trainer_unreachable_s={UNREACHABLE_S}",
    f"total_steps={STEPS}",
]


def step_lines(run: HostRun) -> list[int]:
    """The steps this controller has started, as the versions they make (it logs the line as it sends a step)."""
    return [int(v) for v in re.findall(r"train step \d+ -> (\d+): ", run.output())]


def step_in_progress(run: HostRun) -> int | None:
    """The step started (logged) and not yet ended (not in trained_index.jsonl), if any."""
    started = step_lines(run)
    return started[-1] if started and started[-1] > run.version() else None


def rank_on(run: HostRun, host: nshosts.Host) -> int:
    """The trainer rank that runs on `host` (c10d numbers the agents' ranks in no promised order)."""
    pids = set(host.pids())
    return next(r for r in range(2) if run.trainer_rank_pid(r) in pids)


@contextlib.contextmanager
def held_in_a_step(run: HostRun, h0: nshosts.Host) -> Iterator[int]:
    """Yield a step in progress that cannot end until the block is left: the trainer rank on h0 is stopped
    (SIGSTOP) as the controller starts a step and continued on leaving. Yields the version that step makes."""
    started = len(step_lines(run))
    run.wait_for(lambda: len(step_lines(run)) > started, "another train step", 120)
    pid = run.trainer_rank_pid(rank_on(run, h0))
    os.kill(pid, signal.SIGSTOP)
    try:
        yield run.wait_for(lambda: step_in_progress(run), "a step in progress", 120)
    finally:
        signal_pid(pid, signal.SIGCONT)


def start_run(h0: nshosts.Host, tiny_ckpt: str, run_dir: str, secret: str, *extra: str) -> HostRun:
    args = [f"model.path={tiny_ckpt}", f"run_dir={run_dir}", *ARGS, *extra]
    return HostRun(h0, args, run_dir, {"AREAL_RPC_SECRET": secret})


def start_agent(h1: nshosts.Host, run: HostRun, secret: str, log_path: str) -> None:
    """Agent 1 on h1, with the command this run logged for it (a rerun logs a new one: new ports, a new job)."""
    output = run.wait_for(lambda: "start the other 1" in run.output() and run.output(), "the agent command")
    env, cmd = agent_command(output)
    with open(log_path, "w") as out:
        h1.popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **thread_env(1), **env, "AREAL_RPC_SECRET": secret},
        )


def assert_stopped_naming(run: HostRun, run_dir: str, h1: nshosts.Host, rank: int) -> dict:
    """The run stopped (not completed) with a checkpoint, and its log, summary.json and recovery records name h1
    (name and address), its trainer `rank`, and what to run again."""
    out = run.output()
    stopped = summary(run_dir)
    assert not stopped["completed"], stopped
    why = stopped["stopped"]
    assert f"trainer rank {rank} on {h1.name} ({h1.address})" in why, why  # the rank that went away, and where
    assert f"start the agent on {h1.name} ({h1.address}) with the command it logs" in why, why
    assert "the last checkpoint resumes it" in why and why.splitlines()[0] in out, why
    events = {r["event"]: r for r in run.recoveries()}
    assert h1.name in events["trainer_failed"]["what"], events
    assert h1.name in events["trainer_not_restartable"]["what"], events
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "latest.json"))
    return stopped


def resume_to_the_end(h0: nshosts.Host, h1: nshosts.Host, tiny_ckpt: str, run_dir: str, secret: str, logs) -> None:
    """What the stop message says: the old agent on h1 stopped, the same command, the agent started again."""
    h1.kill_all()
    rerun = start_run(h0, tiny_ckpt, run_dir, secret, NO_SHRINK).start()
    try:
        start_agent(h1, rerun, secret, str(logs / "agent1-rerun.log"))
        assert rerun.wait(240) == 0, rerun.output()[-4000:]
    finally:
        rerun.kill()
    assert "resuming from" in rerun.output()
    assert_exact_accounting(run_dir, STEPS, B, N)


def test_a_trainer_host_cut_off_briefly_rides_through_and_for_long_stops_the_run_resumably(tiny_ckpt, tmp_path):
    run_dir, logs = str(tmp_path / "run"), tmp_path / "logs"
    logs.mkdir()
    secret = os.urandom(32).hex()
    with nshosts.Hosts(2, gateway=False) as hs:
        h0, h1 = hs.hosts
        run = start_run(h0, tiny_ckpt, run_dir, secret, NO_SHRINK).start()
        try:
            start_agent(h1, run, secret, str(logs / "agent1.log"))
            run.wait_version(1)
            away = rank_on(run, h1)
            # a short cut, in a step that cannot end before it: the step waits for h1 and ends once it is back
            for _ in range(3):  # a step that ended within the moment rank 0 took to stop is no proof: again
                with held_in_a_step(run, h0) as step:
                    h1.link_down()
                    cut = time.monotonic()
                time.sleep(max(0.0, SHORT_CUT_S - (time.monotonic() - cut)))
                held = run.version() < step  # the step did not end while h1 was cut off
                h1.link_up()
                up = time.monotonic()
                run.wait_version(step, 60)
                rode_s = time.monotonic() - up
                if held:
                    break
            else:
                pytest.fail("no step was held by the cut in three tries")
            assert not run.recoveries(), run.recoveries()  # no fault: the run rode through
            # a long cut: the run stops, naming h1, once h1 has answered nothing for trainer_unreachable_s
            with held_in_a_step(run, h0):
                h1.link_down()
                cut = time.monotonic()
            rc = run.wait(120)
            stopped_s = time.monotonic() - cut
            h1.link_up()
        finally:
            run.kill()
        assert rc != 0, run.output()[-4000:]
        assert_stopped_naming(run, run_dir, h1, away)
        failed = next(r for r in run.recoveries() if r["event"] == "trainer_failed")
        # dropped by the kernel: h1 answered nothing (its neighbour entry may have failed first: no route to host)
        assert re.search(r"Connection timed out|No route to host", failed["what"]), failed
        assert UNREACHABLE_S - 3 < stopped_s < UNREACHABLE_S + 45, stopped_s
        print(
            f"short cut {SHORT_CUT_S:.0f}s: the step ended {rode_s:.1f}s after the link came back; long cut: the run "
            f"stopped {stopped_s:.1f}s after it began"
        )
        resume_to_the_end(h0, h1, tiny_ckpt, run_dir, secret, logs)


def test_a_trainer_host_that_loses_its_processes_shrinks_the_job_to_the_host_left(tiny_ckpt, tmp_path):
    run_dir, logs = str(tmp_path / "run"), tmp_path / "logs"
    logs.mkdir()
    secret = os.urandom(32).hex()
    with nshosts.Hosts(2, gateway=False) as hs:
        h0, h1 = hs.hosts
        run = start_run(h0, tiny_ckpt, run_dir, secret).start()
        try:
            start_agent(h1, run, secret, str(logs / "agent1.log"))
            run.wait_version(2)  # past the first checkpoint
            with held_in_a_step(run, h0) as step:
                assert h1.kill_all()  # agent 1 and rank 1, as when h1 loses power
                killed = time.monotonic()
            back = run.wait_recovery("trainer_recovered", timeout=180)[-1]
            back_s = time.monotonic() - killed
            run.wait_version(step, 120)  # training again, on h0 alone
            training_s = time.monotonic() - killed
            rc = run.wait(240)
        finally:
            run.kill()
        assert rc == 0, run.output()[-4000:]
    assert summary(run_dir)["completed"]
    events = {r["event"]: r for r in run.recoveries()}
    assert h1.name in events["trainer_failed"]["what"], events  # the rank that went away, and where
    shrunk = events["trainer_shrunk"]
    assert [h.split(" ")[0] for h in shrunk["lost_hosts"]] == [h1.name], shrunk
    assert shrunk["previous_layout"]["world_size"] == 2 and shrunk["trainer_layout"] == {
        "nodes": [h0.name],
        "nproc": 1,
        "world_size": 1,
    }, shrunk
    assert back["trainer_layout"]["world_size"] == 1 and back["version"] == 2, back  # from the 2-rank checkpoint
    assert "the trainer job shrinks from 2 to 1 node(s)" in run.output()
    assert_exact_accounting(run_dir, STEPS, B, N)
    print(
        f"h1's processes killed: trainers back on h0 alone {back_s:.1f}s later (recover_s {back['recover_s']:.1f}), "
        f"step {step} trained again {training_s:.1f}s after the kill"
    )

"""Trainer faults under launcher=slurm on two real nodes (network-namespace hosts, areal_async/testing/netns_slurm.py):
the batch job (the controller) on h0, one server step and one torchrun agent on each node, as in test_netns_slurm.py
but with the tiny model. This test process is the login node: it submits the run and follows it.

- A trainer rank on h1 is SIGKILLed mid-run: the trainer step fails, the run cancels it and starts a new one on the
  same nodes from the last checkpoint (launch/slurm.py `restart_trainers`), rolls back, and finishes every step
  with no sample lost or trained twice.
- Then, in the same run, every process on h1 is SIGKILLed, slurmd included, as when the node loses power: Slurm
  keeps listing h1's part of the trainer step (no scancel ends it, and it keeps h0's CPUs of it counted too), so the
  trainer job shrinks to h0 (recovery.shrink_trainers): a new step there alone, with srun --overlap, from the last
  checkpoint (written by two ranks, loaded by one), and the run finishes every step with no sample lost or trained
  twice, recoveries.jsonl naming h1 (`trainer_shrunk`). server1, on h1 too, is left to the server policy (no room
  for it on h0 in this layout): the run goes on with server0.
- With the trainers on h0 alone, h1 (running server1) loses power: server1's step cannot end there, so the run
  starts server1 again on h0, which has room (launch/slurm.py `restart_server`), records that h1 went away, and
  finishes every step with server1 holding the current weights and no sample lost.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time

import pytest

from areal_async.testing import hosts as nshosts
from areal_async.testing.faults import RunProcess, assert_exact_accounting, summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION = os.environ.get("AREAL_TEST_SESSION", "nosession")
WHY = nshosts.skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.skipif(WHY is not None, reason=str(WHY))]
B, N, STEPS = 4, 4, 8  # checkpoints at 2, 4, 6: a rank killed at 3, the node lost at 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from areal_async.testing.netns_slurm import SlurmOnHosts

    if not os.path.exists("/run/munge/munge.socket.2"):  # munged comes with the machine's one-node cluster
        p = subprocess.run(["bash", os.path.join(REPO, ".ci", "start_slurm.sh")], capture_output=True, text=True)
        if p.returncode != 0:
            pytest.fail(f".ci/start_slurm.sh could not start munge and Slurm: {(p.stderr or p.stdout)[-1500:]}")
    with nshosts.Hosts(2) as hs:
        slurm = SlurmOnHosts(hs, str(tmp_path_factory.mktemp("slurm2f")))
        try:
            yield hs, slurm
        finally:
            slurm.close()


class SlurmRun(RunProcess):
    """`python -m areal_async.run launcher=slurm ...` on the login node (this process), against `slurm`."""

    def __init__(self, args: list[str], run_dir: str, env: dict[str, str]) -> None:
        super().__init__(args, run_dir)
        self.env = env

    def start(self) -> SlurmRun:
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "areal_async.run", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
            )
        self.started = time.monotonic()
        return self


def run_args(model: str, run_dir: str) -> list[str]:
    return [
        "launcher=slurm",
        f"model.path={model}",
        f"run_dir={run_dir}",
        f"total_steps={STEPS}",
        "schedule.checkpoint_every=2",
        "schedule.eval_every=0",
        "eval.num_prompts=0",
        f"schedule.batch_size={B}",
        f"rollout.group_size={N}",
        "rollout.max_new_tokens=48",
        "data.num_train=200",
        "train.micro_batch_tokens=1024",
        "server.device=cpu",
        "train.device=cpu",
        "slurm.nodes=2",
        "slurm.servers_per_node=1",
        "server.num_servers=2",
        "train.nnodes=2",
        "train.nproc=1",
        "server.host=0.0.0.0",
        f"server.api_key={secrets.token_hex(16)}",
        "slurm.sbatch_args=[--mem-per-cpu=200M]",  # as in test_netns_slurm.py
        "slurm.node_timeout_s=60",
        "recovery.health_interval_s=0.5",
        "recovery.health_timeout_s=1",
        # a two-node trainer step's start-up took over 120 s on a 2-core machine capped at 1.25 CPUs
        # (benchmarks/suite_time.py --cpus 1.25 --avx2); these bound a failure's detection, not the test's pace
        "train.connect_timeout_s=300",
        "train.rdzv.timeout_s=300",
    ]


def check_ledger(run_dir: str) -> None:
    assert_exact_accounting(run_dir, STEPS, B, N)


def test_a_killed_rank_is_replaced_then_a_lost_node_shrinks_the_job_to_the_node_left(cluster, tiny_ckpt, tmp_path):
    """Both faults of the module docstring in one run, one after the other (one job's start-up, not two)."""
    hs, slurm = cluster
    h1 = hs[1]
    run_dir = str(tmp_path / f"t{SESSION}-f-{secrets.token_hex(3)}")
    args = run_args(tiny_ckpt, run_dir)
    run = SlurmRun(args, run_dir, slurm.env).start()
    try:
        # 1. a trainer rank on h1 killed past the checkpoint at 2: a new trainer step, back to 2, on to the end
        run.wait_version(3, timeout=420)  # start-up included (the connect and rendezvous bounds above)
        pid = run.trainer_rank_pid(1)
        assert pid in h1.pids()  # rank 1 runs on h1
        os.kill(pid, signal.SIGKILL)
        back = run.wait_recovery("trainer_recovered", timeout=240)
        assert back[-1]["version"] == 2, back  # rolled back to the checkpoint
        assert [r for r in run.recoveries() if r["event"] == "trainer_failed"], run.recoveries()
        # 2. past the checkpoint at 4 with the new step, h1 loses power: slurmd, the step daemons, server1, trainer
        # agent 1 and its rank. The job shrinks to h0 and goes on.
        run.wait_version(5, timeout=240)
        assert h1.kill_all()
        killed = time.monotonic()
        shrunk_back = run.wait_recovery("trainer_recovered", count=2, timeout=240)[-1]
        back_s = time.monotonic() - killed
        slurm.start_slurmd(1)  # power is back: Slurm can end h1's part of the old steps, and the job can end
        rc = run.wait(240)
    finally:
        run.kill()
    assert rc == 0, run.output()[-4000:]
    assert summary(run_dir)["completed"]
    shrunk = next(r for r in run.recoveries() if r["event"] == "trainer_shrunk")
    assert shrunk["lost_hosts"] == [h1.name] and f"{h1.name}: " in shrunk["what"], shrunk
    assert shrunk["trainer_layout"] == {"nodes": [hs[0].name], "nproc": 1, "world_size": 1}, shrunk
    assert shrunk["previous_layout"]["world_size"] == 2, shrunk
    assert shrunk_back["trainer_layout"]["world_size"] == 1, shrunk_back
    assert shrunk_back["version"] >= 4 and shrunk_back["version"] % 2 == 0, shrunk_back  # a checkpoint of 2 ranks
    with open(os.path.join(run_dir, "logs", "trainer.log")) as f:
        assert "--overlap" in f.read()  # the shrunk step's srun line
    check_ledger(run_dir)
    assert not slurm.jobs()
    print(f"node h1 lost: the trainers back on h0 alone {back_s:.1f}s later (recover_s {shrunk_back['recover_s']:.1f})")


def test_a_server_step_whose_node_went_away_starts_again_on_the_other_node(cluster, tiny_ckpt, tmp_path):
    """The trainer step on h0 with server0, server1 alone on h1; h1 loses power mid-run (its slurmd with it)."""
    hs, slurm = cluster
    h0, h1 = hs[0], hs[1]
    steps = 5
    run_dir = str(tmp_path / f"t{SESSION}-s-{secrets.token_hex(3)}")
    drop = ("train.nnodes=", "total_steps=", "slurm.sbatch_args=", "slurm.node_timeout_s=")
    args = [a for a in run_args(tiny_ckpt, run_dir) if not a.startswith(drop)]
    args += [
        "train.nnodes=1",
        f"total_steps={steps}",
        "slurm.sbatch_args=[--mem-per-cpu=200M,--exclusive]",  # whole nodes: h0 has room for a second server
        "server.max_total_tokens=16384",
        "slurm.node_timeout_s=20",  # how long a SIGKILLed step may stay listed before its node counts as gone
        "recovery.restart_backoff_s=0.2",
        "recovery.unhealthy_restart_s=5",
    ]
    run = SlurmRun(args, run_dir, slurm.env).start()
    try:
        run.wait_version(2, timeout=240)
        with open(os.path.join(run_dir, "run.log")) as f:
            pid = int(re.findall(r"registered server1 at \S+ \(node \S+, pid (\d+)", f.read())[-1])
        assert pid in h1.pids()  # server1 runs on h1
        with run.training_frozen():  # no step ends until server1 is back: the run cannot finish first
            assert h1.kill_all()
            back = run.wait_recovery("server_recovered", timeout=180)[0]
        slurm.start_slurmd(1)  # power is back: Slurm can end h1's part of the old step, and the job can end
        assert run.wait(180) == 0, run.output()[-4000:]
    finally:
        run.kill()
    assert back["name"] == "server1" and back["server_version"] == back["current_version"] > 0, back
    assert back["where"].startswith(f"on node {h0.name} (Slurm step "), back
    # h1 named either way: flagged by slurmctld ("node h1 went away (...NOT_RESPONDING...)") or, before its next ping
    # of h1, found by the step that outlives its scancel by slurm.node_timeout_s ("node h1 does not end it")
    assert f"moved from {h1.name}: " in back["where"] and f"node {h1.name} " in back["where"], back
    assert_exact_accounting(run_dir, steps, B, N)
    assert not slurm.jobs()

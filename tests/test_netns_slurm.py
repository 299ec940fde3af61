"""launcher=slurm on a Slurm cluster of two real nodes: two network-namespace hosts (areal_async/testing/hosts.py),
slurmctld and a slurmd on the first, a slurmd on the second (areal_async/testing/netns_slurm.py), each node under
its own NodeName and NodeAddr. This test process is the login node (on the hosts' bridge): it submits the run, which
then runs as the batch job on the first node and starts one server step and one torchrun agent on each node; the
agents meet at a c10d store on the first node, the ranks and servers report their routable addresses to the
controller's registry, and the run must learn the default task (+20 held-out points; 4 steps measured +47.0 with
launcher=local and +44.5 to +48.0 in four runs of this test, AMD EPYC Zen 5, 2 cores). The hosts share the
filesystem: the model, run_dir and the disk-published weights.

The machine's one-node cluster (.ci/start_slurm.sh) is not touched: this one has its own name, config, ports and
state, and is torn down (jobs, daemons, hosts) when the module ends.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys

import pytest

from areal_async.testing import hosts as nshosts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION = os.environ.get("AREAL_TEST_SESSION", "nosession")
WHY = nshosts.skip_reason()
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.skipif(WHY is not None, reason=str(WHY))]
STEPS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from areal_async.testing.netns_slurm import SlurmOnHosts

    if not os.path.exists("/run/munge/munge.socket.2"):  # munged comes with the machine's one-node cluster
        p = subprocess.run(["bash", os.path.join(REPO, ".ci", "start_slurm.sh")], capture_output=True, text=True)
        if p.returncode != 0:
            pytest.fail(f".ci/start_slurm.sh could not start munge and Slurm: {(p.stderr or p.stdout)[-1500:]}")
    with nshosts.Hosts(2) as hs:
        slurm = SlurmOnHosts(hs, str(tmp_path_factory.mktemp("slurm2")))
        try:
            yield hs, slurm
        finally:
            slurm.close()


@pytest.fixture(scope="module")
def base_model() -> str:
    from areal_async.tasks.base_model import ensure_base_model

    return ensure_base_model()


def log_tails(run_dir: str) -> str:
    """The end of every step's log: what a failure needs (a rank on the second node, a server step)."""
    out = []
    logs = os.path.join(run_dir, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), errors="replace") as f:
            out.append(f"\n--- {name}\n" + "".join(f.readlines()[-25:]))
    return "".join(out)


def test_a_run_over_two_slurm_nodes_learns(cluster, base_model, tmp_path):
    hs, slurm = cluster
    run_dir = str(tmp_path / f"t{SESSION}-2n-{secrets.token_hex(3)}")
    args = [
        "launcher=slurm",
        f"model.path={base_model}",
        f"run_dir={run_dir}",
        f"total_steps={STEPS}",
        f"schedule.eval_every={STEPS}",
        "schedule.checkpoint_every=0",
        "server.device=cpu",
        "train.device=cpu",
        "slurm.nodes=2",
        "slurm.servers_per_node=1",
        "server.num_servers=2",
        "train.nnodes=2",
        "train.nproc=1",
        "server.host=0.0.0.0",
        f"server.api_key={secrets.token_hex(16)}",
        # the job exports SLURM_MEM_PER_CPU, which the steps' srun must not inherit next to --mem=0
        "slurm.sbatch_args=[--mem-per-cpu=200M]",
        "train.connect_timeout_s=120",  # hang guards, far above the seconds these take
        "train.rdzv.timeout_s=120",
    ]
    p = subprocess.run(
        [sys.executable, "-m", "areal_async.run", *args],
        capture_output=True,
        text=True,
        timeout=480,
        env={**os.environ, **slurm.env},
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:] + log_tails(run_dir)
    job = re.search(r"submitted batch job (\d+)", out).group(1)
    assert f"job {job} ended: COMPLETED, exit code 0" in out
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == STEPS
    assert summary["final_accuracy"] >= summary["base_accuracy"] + 0.20, summary
    with open(os.path.join(run_dir, "run.log")) as f:
        run_log = f.read()
    h0, h1 = hs.hosts
    # the batch job (the controller) ran on the first node; each node ran a server step and a trainer agent
    with open(os.path.join(run_dir, "logs", f"slurm-{job}.out")) as f:
        assert "trained samples" in f.read()
    for i, h in enumerate((h0, h1)):
        with open(os.path.join(run_dir, "logs", f"server{i}.log")) as f:
            assert re.search(rf"serving at tcp://{re.escape(h.address)}:\d+", f.read()), f"server{i} not on {h.name}"
        assert re.search(rf"registered rank{i} at tcp://{re.escape(h.address)}:\d+", run_log), run_log[-3000:]
    assert "127.0.0.1" not in "\n".join(re.findall(r"registered .*", run_log))  # nothing advertised loopback
    assert not slurm.jobs()  # the job and its steps are gone


def test_servers_apart_put_the_server_on_a_node_of_its_own(cluster, tiny_ckpt, tmp_path):
    """slurm.servers_apart=true: the trainer step on the first node (beside the controller), the server alone on
    the second; the run trains its steps with each where it belongs."""
    hs, slurm = cluster
    run_dir = str(tmp_path / f"t{SESSION}-apart-{secrets.token_hex(3)}")
    args = [
        "launcher=slurm",
        f"model.path={tiny_ckpt}",
        f"run_dir={run_dir}",
        "total_steps=2",
        "schedule.eval_every=0",
        "eval.num_prompts=0",
        "schedule.batch_size=2",
        "rollout.group_size=2",
        "rollout.max_new_tokens=32",
        "data.num_train=50",
        "server.device=cpu",
        "train.device=cpu",
        "slurm.nodes=2",
        "slurm.servers_apart=true",
        "server.num_servers=1",
        "server.host=0.0.0.0",
        f"server.api_key={secrets.token_hex(16)}",
        "slurm.sbatch_args=[--mem-per-cpu=200M]",
        "train.connect_timeout_s=120",
    ]
    p = subprocess.run(
        [sys.executable, "-m", "areal_async.run", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **slurm.env},
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:] + log_tails(run_dir)
    h0, h1 = hs.hosts
    with open(os.path.join(run_dir, "logs", "server0.log")) as f:
        assert re.search(rf"serving at tcp://{re.escape(h1.address)}:\d+", f.read()), "server0 not on h1"
    with open(os.path.join(run_dir, "run.log")) as f:
        run_log = f.read()
    assert re.search(rf"registered rank0 at tcp://{re.escape(h0.address)}:\d+", run_log), run_log[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["steps"] == 2
    assert not slurm.jobs()

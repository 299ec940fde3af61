"""Multi-node trainers for real, on one machine: `train.nnodes=2` makes the launcher start two torchrun agents with
`--nnodes 2` and c10d rendezvous (node ranks 0 and 1, one rank each) that form one job, and the ranks report their
addresses to the run's registry (no rank files from the ranks: nothing shared but the network). The controller
trains with both, and every number equals a two-process single-node job (`train.nproc=2`) fed the same batches:
loss and stats, published weights, and weights broadcast from trainer rank 0 into a server. A missing node ends the
run when the rendezvous times out, naming it, with nothing left running.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time

import aiohttp
import numpy as np
import pytest
import pytest_asyncio

from areal_async.config import load_config
from areal_async.launch import LocalLauncher
from areal_async.train.client import TrainerGroup
from areal_async.types import Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ON_LOOP = pytest.mark.asyncio(loop_scope="module")

# two minibatches of several micro-batches, global batch norm, a learning rate that moves the weights far beyond
# the tolerance
TRAIN = [
    "train.ppo_minibatches=2",
    "train.micro_batch_tokens=48",
    "train.advantage.batch_norm=true",
    "train.optim.lr=1e-3",
    "train.loss.behav_imp_weight_cap=null",
    "server.max_total_tokens=4096",
    "train.device=cpu",
    "server.device=cpu",
]  # gloo and fp32 on any host: the two jobs must agree exactly
STATS = (
    "loss",
    "pg_loss",
    "grad_norm",
    "clip_frac",
    "imp_weight_mean",
    "imp_weight_max",
    "ratio_mean",
    "approx_kl",
    "entropy",
    "adv_abs_mean",
    "reward_mean",
    "response_tokens",
    "tokens",
    "num_seqs",
    "optimizer_steps",
)
PROBES = [[3, 17, 42, 8, 64, 23, 5, 90, 31], [50, 2, 77, 13, 13, 60]]


def make_batch(rng: random.Random, version: int) -> list[Trajectory]:
    """Four groups of uneven lengths (the two ranks get different shards), rewards varying within groups."""
    trajs = []
    for g in range(4):
        for _ in range(3):
            p, r = rng.randrange(3, 8), rng.randrange(4, 24)
            trajs.append(
                Trajectory(
                    input_ids=[rng.randrange(2, 100) for _ in range(p + r)],
                    loss_mask=[0] * p + [1] * r,
                    logprobs=[0.0] * p + [-4.5 + rng.gauss(0, 0.3) for _ in range(r)],
                    versions=[-1] * p + [version] * r,
                    reward=float(rng.randrange(3)),
                    group_id=g,
                    prompt_len=p,
                )
            )
    return trajs


async def server_logprobs(url: str) -> list[list[float]]:
    out = []
    async with aiohttp.ClientSession() as s:
        for ids in PROBES:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            }
            async with s.post(url + "/generate", json=body) as r:
                assert r.status == 200, await r.text()
                out.append([x[0] for x in (await r.json())["meta_info"]["input_token_logprobs"][1:]])
    return out


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def load_weights(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[-1].split()[1])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


class Run:
    """A cluster started by the LocalLauncher as a run starts it, its TrainerGroup and InferenceClient."""

    def __init__(self, cfg, cluster) -> None:
        self.cfg, self.cluster = cfg, cluster
        self.group: TrainerGroup | None = None
        self.client = None

    async def connect(self) -> None:
        from areal_async.inference.client import InferenceClient

        tr = self.cluster.trainers
        watch = asyncio.ensure_future(self.cluster.processes.watch())
        connect = asyncio.ensure_future(TrainerGroup.connect(tr.rendezvous_dir, tr.world_size, tr.secret, timeout=180))
        await asyncio.wait([watch, connect], return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not connect.done():
            connect.cancel()
            watch.result()  # ChildFailed with the log tail
        self.group = connect.result()
        self.client = InferenceClient([s.url for s in self.cluster.servers])

    async def close(self) -> None:
        if self.group is not None:
            try:
                await asyncio.wait_for(self.group.shutdown(), 60)
            except Exception:
                pass
        if self.client is not None:
            await self.client.close()
        await self.cluster.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def runs(tiny_ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    cfgs = {
        "two_nodes": load_config(
            None,
            [f"model.path={tiny_ckpt}", f"run_dir={root / 'two_nodes'}", "train.nnodes=2", "train.nproc=1", *TRAIN],
        ),
        "one_node": load_config(
            None, [f"model.path={tiny_ckpt}", f"run_dir={root / 'one_node'}", "train.nnodes=1", "train.nproc=2", *TRAIN]
        ),
    }
    clusters = await asyncio.gather(
        *(LocalLauncher().launch(c, model_path=tiny_ckpt) for c in cfgs.values()), return_exceptions=True
    )
    out = {name: Run(cfg, c) for (name, cfg), c in zip(cfgs.items(), clusters) if not isinstance(c, BaseException)}
    try:
        for c in clusters:
            if isinstance(c, BaseException):
                raise c
        await asyncio.gather(*(r.connect() for r in out.values()))
        yield out | {"root": root}
    finally:
        await asyncio.gather(*(r.close() for r in out.values()), return_exceptions=True)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trained(runs):
    """Two steps on both jobs with the same batches; stats and published weights of each."""
    rng = random.Random(11)
    out = {"two_nodes": [], "one_node": [], "published": {"two_nodes": [], "one_node": []}}
    for step in range(2):
        batch = make_batch(rng, step)
        for name in ("two_nodes", "one_node"):
            res = await runs[name].group.train_step(batch, step)
            pub = await runs[name].group.publish(step + 1, str(runs["root"] / f"pub_{name}"), keep=4)
            out[name].append(res)
            out["published"][name].append(pub.path)
    return out


@ON_LOOP
async def test_two_agents_form_one_job_found_through_the_registry(runs):
    run = runs["two_nodes"]
    agents = [c for c in run.cluster.processes.children if c.role == "trainer"]
    assert [c.name for c in agents] == ["trainer0", "trainer1"]
    for c in agents:
        with open(c.log_path) as f:
            cmd = f.readline()
        assert "--nnodes 2 --rdzv-backend c10d" in cmd and "--nproc_per_node 1" in cmd
    infos = await run.group.info()
    assert [(i.rank, i.world_size) for i in infos] == [(0, 2), (1, 2)]
    # each rank is the child of a different agent, and reported itself to the registry (not through a file)
    regs = run.cluster.registry.entries
    assert sorted(regs) == ["rank0", "rank1"]
    parents = {ppid(regs[f"rank{r}"].pid) for r in range(2)}
    assert parents == {c.proc.pid for c in agents}
    with open(os.path.join(run.cfg.run_dir, "logs", "trainer0.log")) as f:
        log0 = f.read()
    assert "AREAL_REGISTRY" not in log0  # the environment carries it, not the command line


@ON_LOOP
async def test_two_nodes_equal_one_node_of_two_processes(trained):
    for step in range(2):
        a, b = trained["two_nodes"][step], trained["one_node"][step]
        assert a.version == b.version == step + 1
        for key in STATS:
            assert a.stats[key] == pytest.approx(b.stats[key], abs=1e-6), (step, key)
        wa, wb = (load_weights(trained["published"][n][step]) for n in ("two_nodes", "one_node"))
        assert set(wa) == set(wb)
        assert max(float(np.abs(wa[k] - wb[k]).max()) for k in wa) < 1e-6, step
    assert trained["two_nodes"][1].stats["optimizer_steps"] == 2
    w0, w2 = (load_weights(trained["published"]["two_nodes"][i]) for i in (0, 1))
    assert max(float(np.abs(w0[k] - w2[k]).max()) for k in w0) > 1e-4  # the steps really moved the weights


@ON_LOOP
async def test_broadcast_from_the_two_node_job_equals_disk_load(runs, trained):
    two, one = runs["two_nodes"], runs["one_node"]
    before = await server_logprobs(two.cluster.servers[0].url)
    await two.group.init_broadcast_group(
        two.client, master_address=two.cluster.trainers.master_address, num_server_ranks=1, backend="gloo"
    )
    await two.group.broadcast_weights(two.client, two.group.version, bucket_bytes=64 << 10)
    await one.client.update_weights_from_disk(trained["published"]["one_node"][-1], one.group.version)
    got = await server_logprobs(two.cluster.servers[0].url)
    want = await server_logprobs(one.cluster.servers[0].url)
    assert gap(before, want) > 1e-3
    assert gap(got, want) < 1e-6


@ON_LOOP
async def test_a_checkpoint_of_two_nodes_resumes_in_a_world_of_one_and_trains_the_same_step(runs, trained, tiny_ckpt):
    """What a trainer job that shrank to the hosts left relies on (recovery.shrink_trainers, launch/shrink.py): the
    two-node job's checkpoint loads in a world of one (DCP reshards model and AdamW state), and the next step on the
    same batch gives the same stats and weights (each rank divides its loss by the global token count, so the split
    of a batch over fewer ranks does not change the step)."""
    from areal_async.launch import local

    two, root = runs["two_nodes"], runs["root"]
    version = two.group.version
    ckpt = (await two.group.save_checkpoint(str(root / "ckpt_two_nodes"))).path  # also what this test restores
    cfg = load_config(
        None, [f"model.path={tiny_ckpt}", f"run_dir={root / 'shrunk'}", "train.nnodes=1", "train.nproc=1", *TRAIN]
    )
    procs = local.Processes(cfg.run_dir)
    handle, registry = await local._start_trainers(procs, cfg, tiny_ckpt, ckpt, "127.0.0.1")
    try:
        one = await TrainerGroup.connect(handle.rendezvous_dir, handle.world_size, handle.secret, timeout=180)
        assert (one.world_size, one.version) == (1, version)
        batch = make_batch(random.Random(23), version)
        a = await two.group.train_step(batch, version)
        b = await one.train_step(batch, version)
        for key in STATS:
            assert a.stats[key] == pytest.approx(b.stats[key], abs=1e-6), key
        wa = load_weights((await two.group.publish(version + 1, str(root / "pub_two_after"))).path)
        wb = load_weights((await one.publish(version + 1, str(root / "pub_shrunk"))).path)
        assert max(float(np.abs(wa[k] - wb[k]).max()) for k in wa) < 1e-6
        await asyncio.wait_for(one.shutdown(), 60)
    finally:
        await asyncio.to_thread(procs.shutdown)
        if registry is not None:
            await registry.close()
        # the two-node job is the module's: put it back where the other tests expect it (its weights equal to the
        # one-node job's last publish, test_broadcast_from_the_two_node_job_equals_disk_load), whatever the order
        assert (await two.group.load_checkpoint(ckpt)).version == version


def test_missing_node_ends_the_run_at_the_rendezvous_timeout(tiny_ckpt, tmp_path):
    """train.nnodes=2 with one agent here: the other never comes, torchrun's rendezvous gives up, the run ends."""
    run_dir = str(tmp_path / "missing")
    env = {**os.environ, "AREAL_RPC_SECRET": os.urandom(32).hex()}
    t0 = time.monotonic()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_async.run",
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "train.nnodes=2",
            "train.rdzv.local_agents=1",
            "train.rdzv.timeout_s=5",
            "server.max_total_tokens=4096",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "start the other 1, one per node" in p.stdout  # the command for the missing node was logged
    assert re.search(r"trainer0 exited with code \d+.*RendezvousTimeoutError", p.stdout, re.S), p.stdout[-3000:]
    assert took < 120, took
    with open(os.path.join(run_dir, "run.log")) as f:
        pids = [int(x) for x in re.findall(r"started \w+ \(pid (\d+)\)", f.read())]
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while [q for q in pids if alive(q)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [q for q in pids if alive(q)]


def test_run_with_two_trainer_nodes_and_broadcast(tiny_ckpt, tmp_path):
    """The whole run: the controller connects to both nodes' ranks, trains, broadcasts after every step."""
    run_dir = str(tmp_path / "run")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_async.run",
            f"model.path={tiny_ckpt}",
            f"run_dir={run_dir}",
            "train.nnodes=2",
            "train.weight_sync=broadcast",
            "total_steps=2",
            "schedule.batch_size=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=32",
            "eval.num_prompts=0",
            "data.num_train=100",
            "server.max_total_tokens=8192",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == 2 and summary["trained_samples"] == 2 * 4 * 4
    assert "2 trainer rank(s) ready" in p.stdout
    assert not os.path.exists(os.path.join(run_dir, "trainer", "rank1.json"))  # the registry cleaned up

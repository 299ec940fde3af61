"""The staleness bound end to end (issue 10): the real controller, an embedded server over real HTTP (in process)
and a real torchrun trainer, on a workload that makes stragglers.

The workflow generates for real; some groups then wait on a slow environment: every group that starts under the
first version except the first B. Such a group is done once the trainer has moved eta versions on, or after a few
seconds, whichever comes first. The old rule trained newer, fast groups at steps 1 .. eta - 1 and only waited at step
eta, when eta * B old groups were left for steps that could train B each; so here it trained tokens up to
2 * eta - 1 versions old, on every machine. The new rule holds step 1 until the old groups land (they then have
time). The trainer is wrapped so that the test reads the per-token versions of exactly the batches the torchrun
ranks were sent, and asserts every one is at most eta versions old.

One server and one trainer serve both runs: the eta = 4 run resumes at the version the runs before it ended with
(`RunState(version=...)` -> `StalenessBuffer.restore`), as a resumed run does; run first, it makes one short run
of its own before.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
import time

import pytest
import pytest_asyncio

from areal_async.launch import Processes as Launcher
from areal_async.rollout.controller import AsyncRLController, RunState, ScheduleConfig
from areal_async.rollout.samples import SampleStream
from areal_async.rollout.workflow_api import trajectory_from_generation
from areal_async.train.client import TrainerGroup
from areal_async.types import Sample, SamplingParams, Trajectory

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(240)]

B, GROUP = 2, 2
CFG = {"device": "cpu", "micro_batch_tokens": 1024, "optim": {"lr": 1e-4}}
SAMPLES = [Sample(id=i, prompt=f"p{i}", answer="") for i in range(64)]


class StragglerWorkflow:
    """Real generation (short and long answers alternate, so long ones run across weight updates); then the groups
    numbered B .. (eta + 1) * B - 1 of this run wait on a slow environment (see the module docstring)."""

    def __init__(self, eta: int, first_version: int, slow_timeout_s: float) -> None:
        self.eta = eta
        self.first_version = first_version
        self.slow_timeout_s = slow_timeout_s
        self.calls = itertools.count()
        self.version = lambda: first_version  # bound to the controller once it exists
        self.slow_started = 0

    async def run(self, client, sample: Sample) -> list[Trajectory]:
        i = next(self.calls)
        t0 = time.monotonic()
        prompt = [5 + (7 * sample.id + j) % 60 for j in range(6 + sample.id % 5)]
        gens = await asyncio.gather(
            *(
                client.agenerate(
                    prompt,
                    SamplingParams(max_new_tokens=96 if (i + k) % 2 else 8, temperature=1.0, ignore_eos=True),
                    session_key=f"s{i}",
                )
                for k in range(GROUP)
            )
        )
        if B <= i < (self.eta + 1) * B:
            self.slow_started += 1
            while self.version() < self.first_version + self.eta and time.monotonic() - t0 < self.slow_timeout_s:
                await asyncio.sleep(0.05)
        return [
            trajectory_from_generation(
                prompt, g, reward=float(k), group_id=0, finish=g.finish_reason, interruptions=g.num_interruptions
            )
            for k, g in enumerate(gens)
        ]


class RecordingTrainer:
    """The torchrun TrainerGroup, with every batch it is sent recorded as (version, [the response token versions of
    each trajectory])."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group
        self.batches: list[tuple[int, list[list[int]]]] = []

    async def train_step(self, trajectories: list[Trajectory], policy_version: int):
        self.batches.append(
            (policy_version, [[ver for m, ver in zip(t.loss_mask, t.versions) if m] for t in trajectories])
        )
        return await self.group.train_step(trajectories, policy_version)

    def __getattr__(self, name: str):  # publish, save_checkpoint, broadcast_weights
        return getattr(self.group, name)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tiny_ckpt, tmp_path_factory):
    from areal_async.inference.client import InferenceClient
    from areal_async.server.app import start_server

    root = tmp_path_factory.mktemp("staleness_e2e")
    secret = secrets.token_bytes(32)
    launcher = Launcher(str(root / "run"))
    child = launcher.start_trainers(
        model=tiny_ckpt, nproc=1, config_json=json.dumps(CFG), seed=0, secret_hex=secret.hex(), torch_threads=1
    )
    server = client = group = None
    try:
        server = await start_server(tiny_ckpt, port=0, device="cpu", max_total_tokens=16384)
        watch = asyncio.ensure_future(launcher.watch())
        connect = asyncio.ensure_future(TrainerGroup.connect(launcher.run_dir, 1, secret, timeout=180))
        await asyncio.wait([watch, connect], return_when=asyncio.FIRST_COMPLETED)
        watch.cancel()
        if not connect.done():  # the trainer died first: ChildFailed with its log tail
            connect.cancel()
            watch.result()
        group = connect.result()
        client = InferenceClient([server.url])
        yield {"group": group, "client": client, "run_dir": launcher.run_dir, "version": [0]}
    finally:
        if group is not None:
            try:
                await asyncio.wait_for(group.shutdown(), 60)
                child.proc.wait(60)
            except Exception:
                pass
        launcher.shutdown()
        if client is not None:
            await client.close()
        if server is not None:
            await server.close()


async def run_with_stragglers(stack, eta: int, steps: int) -> tuple[RecordingTrainer, AsyncRLController, int]:
    first = stack["version"][0]  # the servers and the trainer are at this version
    trainer = RecordingTrainer(stack["group"])
    workflow = StragglerWorkflow(eta, first, slow_timeout_s=3.0)
    sched = ScheduleConfig(
        batch_size=B, total_steps=first + steps, eta=eta, max_concurrent_groups=64, interruptible=True, eval_every=0
    )
    ctrl = AsyncRLController(
        sched,
        stack["client"],
        trainer,
        workflow,
        SampleStream(SAMPLES, seed=eta),
        stack["run_dir"],
        state=RunState(version=first),
    )
    workflow.version = lambda: ctrl.state.version
    await asyncio.wait_for(ctrl.run(), 150)
    stack["version"][0] = ctrl.state.version
    assert workflow.slow_started == eta * B  # the stragglers were there
    return trainer, ctrl, first


def assert_bound(trainer: RecordingTrainer, eta: int, first: int, steps: int) -> None:
    assert [v for v, _ in trainer.batches] == list(range(first, first + steps))
    for v, trajs in trainer.batches:
        assert len(trajs) == B * GROUP and all(trajs), f"step {v}: {len(trajs)} trajectories"
        versions = [ver for t in trajs for ver in t]
        assert max(versions) <= v, f"step {v}: a token of version {max(versions)} from the future"
        assert v - min(versions) <= eta, f"step {v}: a token {v - min(versions)} versions old (eta = {eta})"
    # every group that started under the first version was trained (none dropped): their first tokens carry it
    assert sum(1 for _, trajs in trainer.batches for t in trajs if t[0] == first) == (eta + 1) * B * GROUP


async def test_eta2_bound_holds_with_stragglers(stack):
    trainer, ctrl, first = await run_with_stragglers(stack, eta=2, steps=6)
    assert_bound(trainer, 2, first, 6)
    assert ctrl.buffer.held_batches >= 1  # step 1 was held for the old groups (the old rule trained ahead)


async def test_eta4_bound_holds_with_stragglers_after_a_resume(stack):
    if stack["version"][0] == 0:  # run first (another test order): bring the stack to a later version itself
        await run_with_stragglers(stack, eta=2, steps=3)
    assert stack["version"][0] > 0  # so this run resumes at a version, on the same server and trainer
    trainer, ctrl, first = await run_with_stragglers(stack, eta=4, steps=9)
    assert_bound(trainer, 4, first, 9)
    assert ctrl.buffer.held_batches >= 1

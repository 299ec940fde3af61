"""The controller and the rollout manager on one event loop, with the servers and trainers replaced by stand-ins
built to their protocols (a Generator that makes tokens, a Trainer that records batches): what is dropped and why,
the consecutive-failures stop, uniform-reward filtering, the weight-update modes, and the sample accounting of
trained_index.jsonl across a killed and resumed controller. The real parts run in tests/test_e2e.py."""

from __future__ import annotations

import asyncio
import json
import os
import random

import pytest

from areal_async.config import ScheduleConfig
from areal_async.rollout import ledger as ledger_mod
from areal_async.rollout.buffer import BufferClosed
from areal_async.rollout.controller import AsyncRLController, load_state
from areal_async.rollout.ledger import SampleLedger, check_invariant, truncate
from areal_async.rollout.samples import SampleStream
from areal_async.rollout.workflows.rlvr import RLVRWorkflow
from areal_async.types import (
    CheckpointResult,
    GenerationResult,
    PublishResult,
    Sample,
    SamplingParams,
    TrainStepResult,
    Trajectory,
)

pytestmark = pytest.mark.timeout(60)

SAMPLES = [Sample(id=i, prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(40)]


class CharTokenizer:
    """encode/decode are all a workflow needs of a tokenizer."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class FakeServers:
    """A Generator + admin: each request takes a few event-loop turns; `finish(sample_id)` picks its finish."""

    def __init__(self, finish=lambda sid: "stop", slow=lambda sid: 0.0, seed: int = 0) -> None:
        self.version = 0
        self.finish = finish
        self.slow = slow
        self.rng = random.Random(seed)
        self.calls: list[tuple] = []

    async def agenerate(self, input_ids, sampling, *, rid=None, session_key=None, return_text=False, priority=None):
        sid = int(session_key[1:].split("-")[0]) if session_key else -1
        await asyncio.sleep(self.slow(sid) + self.rng.random() * 0.002)
        n = self.rng.randint(1, 6)
        fr = self.finish(sid)
        n = 0 if fr == "empty" else n
        text = str(2 * sid) if self.rng.random() < 0.5 else "x"
        ids = [ord(c) for c in text][:n] or ([] if n == 0 else [ord("x")])
        return GenerationResult(
            input_ids=list(input_ids),
            output_ids=ids,
            output_logprobs=[-0.5] * len(ids),
            output_versions=[self.version] * len(ids),
            finish_reason="stop" if fr == "empty" else fr,
        )

    async def pause(self, mode="abort"):
        self.calls.append(("pause", mode))

    async def resume(self):
        self.calls.append(("resume",))

    async def update_weights_from_disk(self, path, version, *, flush_cache=True):
        self.calls.append(("disk", version, flush_cache))
        self.version = version


class FakeTrainer:
    def __init__(self, hang_at: int | None = None) -> None:
        self.batches: list[list[Trajectory]] = []
        self.broadcasts: list[tuple[int, bool]] = []
        self.checkpoints: list[str] = []
        self.hang_at = hang_at  # a train step at this version never returns (the controller is killed there)
        self.hanging = asyncio.Event()

    async def train_step(self, trajectories, policy_version):
        if policy_version == self.hang_at:
            self.hanging.set()
            await asyncio.sleep(3600)
        self.batches.append(list(trajectories))
        await asyncio.sleep(0.005)
        return TrainStepResult(version=policy_version + 1, stats={"loss": 0.0})

    async def publish(self, version, root, keep=2):
        return PublishResult(path=os.path.join(root, f"v{version}"), seconds=0.0, num_bytes=0)

    async def save_checkpoint(self, path):
        self.checkpoints.append(path)
        return CheckpointResult(path=path, version=len(self.batches), seconds=0.0)

    async def broadcast_weights(self, servers, version, *, flush_cache=True):
        self.broadcasts.append((version, flush_cache))
        servers.version = version


class Broadcast:
    """The shape of broadcast weight sync the controller sees (rollout/broadcast_sync.py has the real one): nothing
    to prepare, a bucketed apply through the trainer."""

    bucketed = True
    latest_checkpoint = None

    def __init__(self, trainer, servers):
        self.trainer, self.servers = trainer, servers

    async def prepare(self, version):
        del version

    async def apply(self, version, *, flush_cache):
        await self.trainer.broadcast_weights(self.servers, version, flush_cache=flush_cache)


async def score(completion, answer, prompt="", meta=None):
    return (1.0 if completion == answer else 0.0), None


def controller(
    tmp_path, servers, trainer, *, schedule: ScheduleConfig, workflow=None, state=None, ledger=True, weights=None
) -> AsyncRLController:
    wf = workflow or RLVRWorkflow(CharTokenizer(), score, SamplingParams(max_new_tokens=6), group_size=3)
    led = SampleLedger(os.path.join(tmp_path, ledger_mod.FILE_NAME)) if ledger else None
    return AsyncRLController(
        schedule,
        servers,
        trainer,
        wf,
        SampleStream(SAMPLES, seed=1),
        str(tmp_path),
        state=state,
        ledger=led,
        weights=weights,
    )


def trained_ids(trainer: FakeTrainer) -> list[int]:
    return [t.group_id for b in trainer.batches for t in b[::3]]  # group_size 3: one id per group


async def test_aborted_empty_and_failing_groups_are_dropped_never_trained(tmp_path):
    def finish(sid):
        return {0: "abort", 1: "empty"}.get(sid % 5, "stop")

    class Flaky:
        def __init__(self, inner):
            self.inner = inner

        async def run(self, client, sample):
            if sample.id % 5 == 2:
                raise RuntimeError(f"reward server down for {sample.id}")
            return await self.inner.run(client, sample)

    servers, trainer = FakeServers(finish), FakeTrainer()
    wf = Flaky(RLVRWorkflow(CharTokenizer(), score, SamplingParams(max_new_tokens=6), group_size=3))
    ctrl = controller(
        tmp_path,
        servers,
        trainer,
        workflow=wf,
        schedule=ScheduleConfig(batch_size=2, total_steps=4, eta=1, max_concurrent_groups=4, eval_every=0),
    )
    await ctrl.run()
    ctrl.finish(completed=True)
    stream = SampleStream(SAMPLES, seed=1)
    for b in trainer.batches:
        for t in b:
            sid = stream.sample_at(t.group_id).id  # group_id is the draw index
            assert sid % 5 not in (0, 1, 2), (t.group_id, sid)
            assert t.info["finish"] != "abort"
    recs = ledger_mod.read(os.path.join(tmp_path, ledger_mod.FILE_NAME))
    check_invariant(recs)
    drops = [d for r in recs for d in r.get("dropped", [])]
    whys = {stream.sample_at(d["index"]).id % 5: d["why"].split(":")[0] for d in drops}
    assert whys == {0: "aborted", 1: "invalid", 2: "failed"}, drops
    assert any("reward server down" in d["why"] for d in drops)
    st = ctrl.rollout.stats
    assert st.aborted and st.invalid and st.failed
    assert ctrl.ledger.drop_counts == {"aborted": st.aborted, "invalid": st.invalid, "failed": st.failed}
    # the draw index is unique per group, and is what the trainer's advantages group by
    ids = trained_ids(trainer)
    assert len(ids) == len(set(ids)) == 4 * 2
    assert [r["version"] for r in recs if "version" in r] == [1, 2, 3, 4]


async def test_consecutive_failures_stop_the_run(tmp_path):
    class Broken:
        async def run(self, client, sample):
            raise ConnectionError("no server left")

    ctrl = controller(
        tmp_path,
        FakeServers(),
        FakeTrainer(),
        workflow=Broken(),
        schedule=ScheduleConfig(batch_size=2, total_steps=3, max_consecutive_failures=7, eval_every=0),
    )
    with pytest.raises(BufferClosed, match="7 prompt groups failed in a row; last error: ConnectionError: no serv"):
        await asyncio.wait_for(ctrl.run(), 20)
    assert ctrl.rollout.stats.failed >= 7 and ctrl.state.version == 0


async def test_repeated_aborts_count_as_failures(tmp_path):
    ctrl = controller(
        tmp_path,
        FakeServers(lambda sid: "abort"),
        FakeTrainer(),
        schedule=ScheduleConfig(batch_size=2, total_steps=3, max_consecutive_failures=5, eval_every=0),
    )
    with pytest.raises(BufferClosed, match="5 prompt groups failed in a row; last error: aborted"):
        await asyncio.wait_for(ctrl.run(), 20)


@pytest.mark.parametrize("filtering", [True, False])
async def test_uniform_reward_filtering(tmp_path, filtering):
    class Rewards:
        """Samples with an even id get three equal rewards, odd ones 0, 1, 0."""

        async def run(self, client, sample):
            trajs = []
            for k in range(3):
                r = 1.0 if sample.id % 2 == 0 else float(k == 1)
                trajs.append(
                    Trajectory(
                        input_ids=[1, 2, 3],
                        loss_mask=[0, 1, 1],
                        logprobs=[0, -1, -1],
                        versions=[-1, 0, 0],
                        reward=r,
                        info={"finish": "stop"},
                    )
                )
            await asyncio.sleep(0)
            return trajs

    trainer = FakeTrainer()
    ctrl = controller(
        tmp_path,
        FakeServers(),
        trainer,
        workflow=Rewards(),
        schedule=ScheduleConfig(batch_size=2, total_steps=3, filter_uniform_reward=filtering, eval_every=0),
    )
    await ctrl.run()
    stream = SampleStream(SAMPLES, seed=1)
    trained_even = [gid for gid in trained_ids(trainer) if stream.sample_at(gid).id % 2 == 0]
    if filtering:
        assert not trained_even and ctrl.rollout.stats.filtered > 0
        assert ctrl.ledger.drop_counts["filtered"] == ctrl.rollout.stats.filtered
    else:
        assert trained_even and ctrl.rollout.stats.filtered == 0


@pytest.mark.parametrize(
    "interruptible,mode,expected",
    [
        (True, "abort", [("pause", "abort"), ("disk", 1, True), ("resume",)]),
        (True, "in_place", [("pause", "in_place"), ("disk", 1, False), ("resume",)]),  # never flush in place
        (False, "abort", [("disk", 1, True)]),  # waits for requests in flight: no pause
    ],
)
async def test_weight_update_modes_disk(tmp_path, interruptible, mode, expected):
    servers = FakeServers()
    ctrl = controller(
        tmp_path,
        servers,
        FakeTrainer(),
        ledger=False,
        schedule=ScheduleConfig(
            batch_size=2, total_steps=2, interruptible=interruptible, interrupt_mode=mode, eval_every=0
        ),
    )
    await ctrl.run()
    n = len(expected)
    assert servers.calls[:n] == expected
    assert servers.calls[n:] == [(c[0], 2, c[2]) if c[0] == "disk" else c for c in expected]


@pytest.mark.parametrize("mode,flush", [("abort", True), ("in_place", False)])
async def test_weight_update_modes_broadcast(tmp_path, mode, flush):
    servers, trainer = FakeServers(), FakeTrainer()
    ctrl = controller(
        tmp_path,
        servers,
        trainer,
        ledger=False,
        weights=Broadcast(trainer, servers),
        schedule=ScheduleConfig(batch_size=2, total_steps=2, interrupt_mode=mode, eval_every=0),
    )
    await ctrl.run()
    assert trainer.broadcasts == [(1, flush), (2, flush)]
    assert servers.calls == [("pause", mode), ("resume",)] * 2


def test_stream_redraws_earlier_draws_before_fresh_ones():
    s = SampleStream(SAMPLES[:7], seed=3)
    first = [s.draw() for _ in range(16)]  # into the third epoch
    again = SampleStream(SAMPLES[:7], seed=3, position=16)
    again.redraw([2, 9, 3])
    got = [again.draw() for _ in range(4)]
    assert [d.index for d in got] == [2, 3, 9, 16]
    assert [d.sample.id for d in got[:3]] == [first[2].sample.id, first[3].sample.id, first[9].sample.id]
    assert got[3].sample.id == s.draw().sample.id  # then the stream goes on where it was
    with pytest.raises(ValueError, match="never drawn"):
        again.redraw([99])


def test_ledger_truncate_and_invariant_checker(tmp_path):
    path = str(tmp_path / "t.jsonl")
    led = SampleLedger(path)
    for i in range(5):
        led.drawn(i)
    led.dropped(4, "aborted: x")
    led.trained(1, [0, 1])
    led.trained(2, [2])
    led.close(finished=True)
    recs = ledger_mod.read(path)
    check_invariant(recs)
    assert recs[-1] == {"end": True, "dropped": [], "unfinished": [3]}
    with open(path, "a") as f:
        f.write('{"version": 3, "trai')  # a torn line after the end
    assert truncate(path, 1) == 1
    assert ledger_mod.read(path) == [{"version": 1, "trained": [0, 1], "dropped": [{"index": 4, "why": "aborted: x"}]}]
    with pytest.raises(AssertionError, match="missing"):
        check_invariant(ledger_mod.read(path))  # 2 and 3 now appear nowhere: the checker sees it
    with pytest.raises(AssertionError, match="more than once"):
        check_invariant([{"version": 1, "trained": [0, 1]}, {"version": 2, "trained": [1]}])
    with pytest.raises(ValueError, match="not outstanding"):
        led2 = SampleLedger()
        led2.drawn(0)
        led2.trained(1, [0])
        led2.trained(2, [0])


async def test_resume_after_a_kill_draws_every_untrained_sample_again_exactly_once(tmp_path):
    """Run A checkpoints at version 2 with groups in flight, buffered and dropped-but-unwritten, then dies in the
    middle of the run (its task is cancelled: no end line, no final checkpoint). Run B resumes from the checkpoint:
    the file is cut back, the pending draws are drawn again, and the final file accounts for every draw once."""
    slow = {3, 11, 17}  # samples whose generations take long: in flight at the checkpoint

    def finish(sid):
        return "abort" if sid % 7 == 4 else "stop"

    sched = dict(batch_size=2, eta=2, max_concurrent_groups=6, eval_every=0, checkpoint_every=2)
    path = os.path.join(tmp_path, ledger_mod.FILE_NAME)
    servers_a = FakeServers(finish, slow=lambda sid: 0.3 if sid in slow else 0.0, seed=1)
    trainer_a = FakeTrainer(hang_at=3)  # steps 1, 2 (checkpoint), 3 are written; the kill comes during step 4
    ctrl_a = controller(tmp_path, servers_a, trainer_a, schedule=ScheduleConfig(total_steps=50, **sched))
    task = asyncio.create_task(ctrl_a.run())
    await asyncio.wait_for(trainer_a.hanging.wait(), 20)
    await asyncio.sleep(0.35)  # the slow generations finish meanwhile: drops and buffered groups after the checkpoint
    task.cancel()  # the kill: nothing after this point is saved
    with pytest.raises(asyncio.CancelledError):
        await task
    ctrl_a.ledger.close(finished=False)
    killed_lines = ledger_mod.read(path)
    assert [r["version"] for r in killed_lines] == [1, 2, 3]

    state, _ckpt = load_state(str(tmp_path))
    assert state.version == 2 and state.pending, state
    before = [r for r in killed_lines if r["version"] <= 2]
    resolved_before = {i for r in before for i in r["trained"]} | {d["index"] for r in before for d in r["dropped"]}
    assert not resolved_before & set(state.pending)
    assert set(range(state.data_position)) == resolved_before | set(state.pending)  # every draw so far: one place

    truncate(path, state.version)
    pending = list(state.pending)
    servers_b, trainer_b = FakeServers(finish, seed=2), FakeTrainer()
    servers_b.version = state.version  # the run brings restarted servers to the resumed version first
    ctrl_b = controller(tmp_path, servers_b, trainer_b, state=state, schedule=ScheduleConfig(total_steps=7, **sched))
    final = await ctrl_b.run()
    await ctrl_b.save_checkpoint()
    ctrl_b.finish(completed=True)
    recs = ledger_mod.read(path)
    check_invariant(recs)
    assert [r["version"] for r in recs if "version" in r] == list(range(1, 8))  # the killed run's 3 is gone
    after = recs[len(before) :]
    seen_after = (
        {i for r in after for i in r.get("trained", [])}
        | {d["index"] for r in after for d in r.get("dropped", [])}
        | set(after[-1]["unfinished"])
    )
    assert set(pending) <= seen_after  # every pending draw came back (and, by the invariant, only once)
    assert final.version == 7 and len(trained_ids(trainer_b)) == 5 * 2
    # the resumed stream handed the pending draws out first, with their own samples
    assert min(trained_ids(trainer_b)) in pending
    with open(os.path.join(tmp_path, "checkpoints", "latest.json")) as f:
        assert json.load(f)["version"] == 7


async def test_the_run_reward_gets_each_samples_meta(tmp_path, monkeypatch):
    """Per-sample reward settings (`Sample.meta`, e.g. the code reward's wall_s) reach the reward function through
    the run's ScoreFn and the reward worker process."""
    from areal_async.rewards.runner import RewardRunner
    from areal_async.run import make_score

    (tmp_path / "meta_reward.py").write_text(
        "def reward(completion, answer, *, prompt='', **meta):\n    return float(meta['wall_s']) + len(prompt)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    servers = FakeServers()
    async with RewardRunner(max_workers=1) as rr:
        wf = RLVRWorkflow(
            CharTokenizer(), make_score(rr, "meta_reward:reward", 30.0), SamplingParams(max_new_tokens=4), group_size=2
        )
        trajs = await wf.run(servers, Sample(id=1, prompt="abc", answer="2", meta={"wall_s": 2.5}))
    assert [t.reward for t in trajs] == [5.5, 5.5] and all("reward_error" not in t.info for t in trajs)


async def test_reward_options_reach_every_call_and_meta_overrides_them(tmp_path, monkeypatch):
    """`data.reward_options` are keyword options of every reward call; a sample's own meta takes precedence."""
    from areal_async.rewards.runner import RewardRunner
    from areal_async.run import make_score

    (tmp_path / "opt_reward.py").write_text(
        "def reward(completion, answer, **kw):\n    return float(kw['budget_s']) * 10 + float(kw.get('bonus', 0))\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    async with RewardRunner(max_workers=1) as rr:
        score = make_score(rr, "opt_reward:reward", 30.0, {"budget_s": 2, "bonus": 1})
        assert await score("x", "y", "p") == (21.0, None)
        assert await score("x", "y", "p", {"budget_s": 3}) == (31.0, None)


def test_reward_options_may_not_shadow_the_runners_arguments():
    from areal_async.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="data.reward_options"):
        load_config(None, ["data.reward_options={prompt: x}"])


async def test_periodic_evals_without_an_evaluator_are_skipped(tmp_path):
    """eval_every with no held-out set (eval.num_prompts=0: the run passes no evaluator) trains on, no eval."""
    ctrl = controller(
        tmp_path, FakeServers(), FakeTrainer(), schedule=ScheduleConfig(batch_size=2, total_steps=4, eval_every=2)
    )
    final = await asyncio.wait_for(ctrl.run(), 20)
    assert final.version == 4 and ctrl.evals == []

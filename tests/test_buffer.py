"""The admission rule and the buffer, driven on a real event loop."""

import asyncio

import pytest

from areal_async.rollout.buffer import BufferClosed, Group, StalenessBuffer
from areal_async.testing.staleness_sim import OldStragglerRule, SimConfig, simulate
from areal_async.types import Trajectory


def group(tag: int) -> Group:
    t = Trajectory(
        input_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], versions=[-1, 0], reward=float(tag), group_id=tag
    )
    return Group([t], start_version=0, finish_version=0)


async def fill(buf: StalenessBuffer, n: int) -> None:
    for _ in range(n):
        await buf.acquire_slot()


@pytest.mark.parametrize("eta,batch", [(0, 4), (1, 4), (3, 2)])
async def test_admission_rule_caps_started_groups(eta, batch):
    buf = StalenessBuffer(batch, eta, max_running=1000)
    assert buf.capacity() == (eta + 1) * batch
    await fill(buf, (eta + 1) * batch)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(buf.acquire_slot(), 0.05)
    # finishing groups does not free capacity, nor does taking a batch: accepted_total counts them
    for i in range(batch):
        await buf.finish(group(i))
    assert buf.capacity() == 0
    assert len(await buf.get_batch()) == batch
    assert buf.capacity() == 0
    # a new version does: exactly B more
    await buf.set_version(1)
    assert buf.capacity() == batch


async def test_rejected_group_frees_its_slot():
    buf = StalenessBuffer(2, 0, max_running=10)
    await fill(buf, 2)
    assert buf.capacity() == 0
    await buf.finish(None, 0)
    assert buf.capacity() == 1 and buf.rejected_total == 1


async def test_concurrency_cap_and_unbounded_eta():
    buf = StalenessBuffer(2, None, max_running=3)
    await fill(buf, 3)
    assert buf.capacity() == 0
    await buf.finish(group(0))
    assert buf.capacity() == 1


async def test_oldest_first_and_waiting_consumer():
    buf = StalenessBuffer(2, 4, max_running=10)
    consumer = asyncio.create_task(buf.get_batch())
    await asyncio.sleep(0)
    await fill(buf, 3)
    for i in range(3):
        await buf.finish(group(i))
    batch = await asyncio.wait_for(consumer, 1)
    assert [g.trajectories[0].group_id for g in batch] == [0, 1]
    assert len(buf) == 1


async def test_close_wakes_every_waiter():
    buf = StalenessBuffer(2, 0, max_running=10)
    await fill(buf, 2)
    waiters = [asyncio.create_task(buf.acquire_slot()), asyncio.create_task(buf.get_batch())]
    await asyncio.sleep(0.01)
    await buf.close(RuntimeError("servers gone"))
    for w in waiters:
        with pytest.raises(BufferClosed, match="servers gone"):
            await asyncio.wait_for(w, 1)


def test_restore_sets_accepted_total():
    buf = StalenessBuffer(4, 2, max_running=100)
    buf.restore(5)
    assert buf.accepted_total == 20
    assert buf.capacity() == (2 + 5 + 1) * 4 - 20  # no burst after resume


def test_bad_arguments():
    with pytest.raises(ValueError):
        StalenessBuffer(0, 1, 1)
    with pytest.raises(ValueError):
        StalenessBuffer(1, -1, 1)


def started_at(tag: int, version: int) -> Group:
    g = group(tag)
    g.start_version = version
    return g


async def test_batch_waits_for_a_straggler_and_takes_oldest_starts_first():
    """eta = 1: a group started under v = 0 that is still running blocks the batch of step 1 (else its tokens would
    be trained 2 versions old); once it lands, the batch takes it first although it finished last."""
    buf = StalenessBuffer(2, 1, max_running=100)
    v0 = [await buf.acquire_slot() for _ in range(4)]  # 4 groups under version 0 ((eta + 1) * B)
    assert v0 == [0, 0, 0, 0]
    await buf.finish(started_at(0, 0))
    await buf.finish(started_at(1, 0))
    assert [g.trajectories[0].reward for g in await buf.get_batch()] == [0.0, 1.0]  # step 0
    await buf.set_version(1)
    v1 = [await buf.acquire_slot() for _ in range(2)]
    assert v1 == [1, 1]
    await buf.finish(started_at(2, 0))  # one of version 0's groups lands; the other (3) is still running
    for tag in (10, 11):
        await buf.finish(started_at(tag, 1))
    waiter = asyncio.create_task(buf.get_batch())  # step 1: 3 groups ready, but group 3 (started at 0) runs
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await buf.finish(started_at(3, 0))
    batch = await asyncio.wait_for(waiter, 1.0)
    assert [g.start_version for g in batch] == [0, 0]
    assert sorted(g.trajectories[0].reward for g in batch) == [2.0, 3.0]
    assert buf.buffered_by_version() == {1: 2}


async def test_rejected_straggler_releases_the_batch():
    buf = StalenessBuffer(1, 0, max_running=10)
    assert await buf.acquire_slot() == 0
    waiter = asyncio.create_task(buf.get_batch())
    await asyncio.sleep(0.02)
    await buf.finish(None, 0)  # filtered out: nothing to wait for any more, but no batch yet either
    await buf.set_version(0)
    assert await buf.acquire_slot() == 0
    await buf.finish(started_at(7, 0))
    assert (await asyncio.wait_for(waiter, 1.0))[0].trajectories[0].reward == 7.0
    with pytest.raises(ValueError, match="start_version"):
        await buf.finish(None)


# ---- issue 10: the bound for eta >= 2 -------------------------------------------------------------------------------


async def test_eta2_b1_slow_old_groups_hold_the_fast_new_one():
    """The issue's first counterexample, by hand. Two slow groups start under 0; a fast one started under 1 is done
    at step 1. The old rule trained it there (and at step 3 a group started under 0, 3 versions old); now step 1
    waits, since two groups due by step 2 would otherwise be left for one step."""
    buf = StalenessBuffer(1, 2, max_running=100)
    assert [await buf.acquire_slot() for _ in range(3)] == [0, 0, 0]  # g0 fast, g1 and g2 slow
    await buf.finish(started_at(0, 0))
    trained = [(0, await buf.get_batch())]
    await buf.set_version(1)
    assert await buf.acquire_slot() == 1
    await buf.finish(started_at(3, 1))  # the fast group of version 1 is done
    step1 = asyncio.create_task(buf.get_batch())
    await asyncio.sleep(0.05)
    assert not step1.done() and buf.held_batches == 1  # B groups are there, but the rule holds them
    await buf.finish(started_at(1, 0))
    trained.append((1, await asyncio.wait_for(step1, 1)))
    assert trained[1][1][0].trajectories[0].reward == 1.0  # the old group, not the fast new one
    await buf.set_version(2)
    assert buf.capacity() == 1 and await buf.acquire_slot() == 2
    await buf.finish(started_at(4, 2))
    step2 = asyncio.create_task(buf.get_batch())
    await asyncio.sleep(0.05)
    assert not step2.done()  # g2 (started under 0) is due now: the straggler wait
    await buf.finish(started_at(2, 0))
    trained.append((2, await asyncio.wait_for(step2, 1)))
    await buf.set_version(3)
    trained.append((3, await asyncio.wait_for(buf.get_batch(), 1)))
    assert [[g.trajectories[0].reward for g in b] for _, b in trained] == [[0.0], [1.0], [2.0], [3.0]]
    assert [v - b[0].start_version for v, b in trained] == [0, 1, 2, 2]
    assert buf.held_s > 0


def fast_and_slow(slow: set[int], slow_s: float = 20.0):
    return lambda i, rng: slow_s if i in slow else 0.1


@pytest.mark.parametrize(
    "name,b,eta,cap,slow,old_worst",
    [
        ("eta2_b1", 1, 2, 100, {1, 2}, 3),  # two slow groups under 0
        ("eta4_b2", 2, 4, 100, set(range(2, 10)), 7),  # 8 slow of the 10 started under 0: steps 4..7 went 4..7 old
        ("defaults", 16, 4, 64, set(range(16, 64)), 6),  # B=16, eta=4, 64 concurrent: 48 slow groups under 0
    ],
)
def test_issue_counterexamples_hold_the_bound(name, b, eta, cap, slow, old_worst):
    """The issue's schedules on a simulated clock: the old rule reproduces the reported staleness, the new one stays
    at eta (and reaches it: the old groups are trained exactly at their deadline)."""
    cfg = SimConfig(b, eta, cap, steps=3 * eta + 4, duration=fast_and_slow(slow))
    old = simulate(cfg, OldStragglerRule)
    assert old.max_staleness == old_worst
    new = simulate(cfg)
    assert not new.violations, new.violations
    assert new.max_staleness == eta
    assert [bt.version for bt in new.batches] == list(range(cfg.steps))


async def test_earliest_deadline_first_does_not_wait_for_a_group_that_has_time():
    """eta = 4, B = 1: a group started under 0 is still running at step 1, but steps 2..4 can still train it; the
    batch of step 1 (a group of version 1) goes ahead. Strict start order would wait here."""
    buf = StalenessBuffer(1, 4, max_running=100)
    assert [await buf.acquire_slot() for _ in range(2)] == [0, 0]
    await buf.finish(started_at(0, 0))
    await buf.get_batch()
    await buf.set_version(1)
    assert await buf.acquire_slot() == 1
    await buf.finish(started_at(5, 1))
    batch = await asyncio.wait_for(buf.get_batch(), 1)
    assert batch[0].start_version == 1 and buf.held_batches == 0
    assert buf.running_by_version() == {0: 1}


async def test_a_rejected_old_group_releases_the_held_batch():
    buf = StalenessBuffer(1, 2, max_running=100)
    for _ in range(3):
        await buf.acquire_slot()
    await buf.finish(started_at(0, 0))
    await buf.get_batch()
    await buf.set_version(1)
    await buf.acquire_slot()
    await buf.finish(started_at(3, 1))
    waiter = asyncio.create_task(buf.get_batch())
    await asyncio.sleep(0.02)
    assert not waiter.done()
    await buf.finish(None, 0)  # one of the two old groups is filtered out: the other still fits in step 2
    batch = await asyncio.wait_for(waiter, 1)
    assert batch[0].start_version == 1 and buf.rejected_total == 1


async def test_unbounded_eta_takes_oldest_starts_and_any_n():
    buf = StalenessBuffer(2, None, max_running=10)
    for _ in range(3):
        await buf.acquire_slot()
    await buf.finish(started_at(0, 0))
    await buf.set_version(1)  # no batch needed per version when nothing is bounded
    await buf.acquire_slot()
    await buf.finish(started_at(1, 1))
    await buf.finish(started_at(2, 0))
    batch = await asyncio.wait_for(buf.get_batch(3), 1)
    assert [g.start_version for g in batch] == [0, 0, 1]
    assert buf.trained_total == 3


async def test_protocol_errors_are_clear():
    buf = StalenessBuffer(2, 1, max_running=10)
    with pytest.raises(ValueError, match="batch_size=2"):
        await buf.get_batch(1)
    with pytest.raises(ValueError, match="before the batch of step 0"):
        await buf.set_version(1)
    with pytest.raises(ValueError, match="one step at a time"):
        await buf.set_version(2)
    with pytest.raises(ValueError, match="no group started under version 0"):
        await buf.finish(None, 0)
    assert await buf.acquire_slot() == 0
    with pytest.raises(ValueError, match="the group says 0"):
        await buf.finish(started_at(0, 0), 1)
    with pytest.raises(ValueError, match="restore"):
        buf.restore(3)
    with pytest.raises(ValueError, match="max_running"):
        StalenessBuffer(1, 1, 0)


async def test_restore_then_steps_from_there():
    buf = StalenessBuffer(2, 1, max_running=100)
    buf.restore(7)
    assert buf.trained_total == 14 and buf.capacity() == (1 + 7 + 1) * 2 - 14
    starts = [await buf.acquire_slot() for _ in range(4)]
    assert starts == [7] * 4
    for i in range(4):
        await buf.finish(started_at(i, 7))
    assert [g.start_version for g in await buf.get_batch()] == [7, 7]
    await buf.set_version(8)
    assert buf.capacity() == 2 and len(buf) == 2  # B more may start; the other two wait for step 8


async def test_a_finish_wakes_waiters_only_when_it_can_change_what_they_do():
    # under the staleness bound a finish frees no slot: the submit side must not be woken for it, but a waiting
    # trainer still is, once its B groups are there (to time how long the batch rule holds them) and when ready
    buf = StalenessBuffer(2, eta=1, max_running=100)
    await fill(buf, 4)  # (eta + 1) x B: admission closed until version 1
    notified = []
    real_notify = buf._cond.notify_all
    buf._cond.notify_all = lambda: (notified.append(len(buf)), real_notify())[1]  # type: ignore[method-assign]
    slot = asyncio.create_task(buf.acquire_slot())
    batch = asyncio.create_task(buf.get_batch())
    await asyncio.sleep(0)
    await buf.finish(group(0))  # one of B: neither waiter can proceed
    await buf.finish(group(1))  # B groups: the batch rule allows them (no older group runs), the trainer wakes
    assert len(await asyncio.wait_for(batch, 1)) == 2
    await buf.finish(group(2))  # the trainer is not waiting, and the submit loop still has no slot
    await asyncio.sleep(0)
    assert notified == [2] and not slot.done()
    await buf.set_version(1)  # a new version opens B slots: the waiter is woken and gets one
    assert await asyncio.wait_for(slot, 1) == 1
    # a held batch is still counted as held, from the finish that completed it
    buf2 = StalenessBuffer(1, eta=1, max_running=100)
    await fill(buf2, 2)  # one group under version 0 ...
    await buf2.finish(Group(group(0).trajectories, start_version=0, finish_version=0))
    assert len(await buf2.get_batch()) == 1
    await buf2.set_version(1)
    await buf2.acquire_slot()  # ... one old straggler of version 0 runs, one new group of version 1 starts
    waiting = asyncio.create_task(buf2.get_batch())
    await asyncio.sleep(0)
    await buf2.finish(Group(group(1).trajectories, start_version=1, finish_version=1))
    await asyncio.sleep(0)
    assert buf2.held_batches == 1 and not waiting.done()  # B groups there, held for the straggler
    await buf2.finish(Group(group(2).trajectories, start_version=0, finish_version=1))
    assert (await asyncio.wait_for(waiting, 1))[0].start_version == 0

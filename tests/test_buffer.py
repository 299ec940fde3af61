"""The admission rule and the buffer, driven on a real event loop."""

import asyncio

import pytest

from areal_async.rollout.buffer import BufferClosed, Group, StalenessBuffer
from areal_async.types import Trajectory


def group(tag: int) -> Group:
    t = Trajectory(input_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], versions=[-1, 0], reward=float(tag),
                   group_id=tag)
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
    # finishing groups does not free capacity: accepted_total counts them
    for i in range(batch):
        await buf.finish(group(i))
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
    assert [g.start_version for g in buf._groups] == [1, 1]


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

"""The rollout manager runs Python's garbage collector from the event loop while it is started (GCPacer): automatic
collection off, young generations collected on a timer, pre-rollout objects frozen, and everything restored on stop;
a freeze the process made itself (tests/conftest.py freezes what the test run imported) is left as it is.
Speed is measured in benchmarks/controller_overhead.py; these tests check the bookkeeping and that cycles still die.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

from areal_async.rollout.buffer import StalenessBuffer
from areal_async.rollout.gc_pacer import GCPacer
from areal_async.rollout.manager import RolloutManager
from areal_async.rollout.samples import SampleStream
from areal_async.types import Sample


class _Node:
    """A reference cycle: only the cyclic collector can free it."""

    def __init__(self) -> None:
        self.me = self


def _freeze_kept(frozen: int) -> bool:
    """The freeze in force before is in force now, neither undone nor added to (frozen objects that died since
    have left the count: they are freed by reference counting like any other)."""
    n = gc.get_freeze_count()
    return 0 < n <= frozen if frozen else n == 0


async def _wait_dead(ref: weakref.ref, timeout: float = 2.0) -> bool:
    for _ in range(int(timeout / 0.01)):
        if ref() is None:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_pacer_takes_over_collection_and_restores_it():
    was_enabled = gc.isenabled()
    gc.unfreeze()  # a process that froze nothing (the test runner's freeze is made again below)
    try:
        pacer = GCPacer(young_every_s=0.01)
        pacer.start()
        try:
            assert not gc.isenabled()
            assert gc.get_freeze_count() > 0  # what existed before the start is out of every scan
            ref = weakref.ref(_Node())  # garbage from the start: only a collection can free it
            assert await _wait_dead(ref), "the pacer's young collections did not free a fresh cycle"
        finally:
            pacer.stop()
        assert gc.isenabled() == was_enabled and gc.get_freeze_count() == 0
        pacer.stop()  # a second stop is a no-op
        assert gc.isenabled() == was_enabled
    finally:
        gc.freeze()


async def test_pacer_leaves_a_freeze_the_process_made_alone():
    """gc.unfreeze() is all or nothing: a pacer that undid a freeze it did not make would put a forking server's
    (or a test runner's) frozen objects back into every full collection."""
    was_enabled = gc.isenabled()
    gc.freeze()
    frozen = gc.get_freeze_count()
    pacer = GCPacer(young_every_s=0.01)
    pacer.start()
    try:
        assert not gc.isenabled() and _freeze_kept(frozen)
        ref = weakref.ref(_Node())
        assert await _wait_dead(ref), "the pacer's young collections did not free a fresh cycle"
    finally:
        pacer.stop()
    assert gc.isenabled() == was_enabled and _freeze_kept(frozen)


async def test_pacer_runs_full_collections_for_old_cycles():
    pacer = GCPacer(young_every_s=0.01, full_every_s=0.05)
    pacer.start()
    try:
        node = _Node()
        ref = weakref.ref(node)
        await asyncio.sleep(0.05)  # survives young collections: now in the oldest generation
        del node
        assert await _wait_dead(ref), "a cycle that became garbage in the old generation was never freed"
    finally:
        pacer.stop()


async def test_nested_pacers_restore_only_at_the_last_stop():
    was_enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    a, b = GCPacer(), GCPacer()
    a.start()
    b.start()
    a.stop()
    assert not gc.isenabled()  # b still runs the rollout
    b.stop()
    assert gc.isenabled() == was_enabled and _freeze_kept(frozen)


class _Reject:
    """A workflow that returns nothing: the manager counts the group as rejected and starts the next."""

    async def run(self, client, sample):
        await asyncio.sleep(0.001)
        return None


async def test_rollout_manager_paces_gc_only_while_started():
    was_enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    buffer = StalenessBuffer(batch_size=2, eta=None, max_running=4)
    stream = SampleStream([Sample(id=i, prompt="p", answer="a") for i in range(3)])
    manager = RolloutManager(client=None, workflow=_Reject(), stream=stream, buffer=buffer)  # type: ignore[arg-type]
    assert manager.pace_gc and gc.isenabled() == was_enabled
    manager.start()
    await asyncio.sleep(0.05)
    assert not gc.isenabled()
    await manager.stop()
    assert gc.isenabled() == was_enabled and _freeze_kept(frozen)
    assert manager.stats.rejected > 0

    off = RolloutManager(
        client=None,
        workflow=_Reject(),
        stream=stream,  # type: ignore[arg-type]
        buffer=StalenessBuffer(batch_size=2, eta=None, max_running=4),
        pace_gc=False,
    )
    off.start()
    await asyncio.sleep(0.01)
    assert gc.isenabled() == was_enabled and _freeze_kept(frozen)
    await off.stop()

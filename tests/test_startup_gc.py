"""The collector during a process's start-up (areal_async/host/startup_gc.py, used by the trainer rank's and the
embedded server's `main`): off inside the block; on leaving it, start-up garbage is freed, not frozen, the survivors
are frozen out of later scans, and the collector is back as it was, also when the start-up fails."""

from __future__ import annotations

import gc
import weakref

import pytest

from areal_async.host.startup_gc import collector_paused


class _Node:
    """A reference cycle: only the cyclic collector can free it."""

    def __init__(self) -> None:
        self.me = self


def test_start_up_garbage_is_freed_and_the_survivors_frozen():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        dead = weakref.ref(_Node())  # start-up garbage in a cycle
        kept = _Node()
        for _ in range(50_000):  # far past a young collection's threshold: with the collector on, one would run
            _Node()
        assert dead() is not None  # nothing collected inside the block
    assert gc.isenabled()
    assert dead() is None  # collected on the way out, not frozen with the survivors
    assert gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # frozen: in none of the generations the collector scans


def test_a_failed_start_up_still_restores_the_collector():
    with pytest.raises(RuntimeError):
        with collector_paused():
            raise RuntimeError("the model did not load")
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off():
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()

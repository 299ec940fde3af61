"""An asyncio event loop whose clock jumps to the next scheduled event instead of waiting for it.

Why: the planner runs the real controller, rollout manager and staleness buffer, which are ordinary asyncio code
that measure time with the loop's clock and wait with `asyncio.sleep` or on futures. If the loop's `time()` is a
number we own and the selector, instead of blocking for `timeout` seconds, adds `timeout` to that number, every
sleep and timer fires in order at its virtual instant and an hour-long run takes as long as its callbacks take to
execute. Nothing else of asyncio changes: tasks, futures, conditions and cancellation behave exactly as in a live run.

The simulated parts must not use threads, sockets or subprocesses (their readiness would never be polled), and
every wait must end in a timer or another task's action: a loop with nothing ready and nothing scheduled can never
make progress, so it raises `SimulationStalled` rather than hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Every task waits and no timer is pending: in a live run this would hang forever."""


class _JumpSelector(selectors.SelectSelector):
    """Registers file objects like any selector (the loop's self-pipe), but a select never blocks: it moves the
    owning loop's clock forward by the timeout the loop asked for, which is exactly the gap to its next timer."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        assert self.loop is not None
        if timeout is None:
            raise SimulationStalled("no task is ready and no timer is scheduled: the simulation cannot progress")
        if timeout > 0:
            self.loop.advance(timeout)
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop on a virtual clock that starts at `start` seconds."""

    def __init__(self, start: float = 0.0) -> None:
        selector = _JumpSelector()
        self._now = float(start)
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward; the loop calls this through its selector, a test may call it directly."""
        if seconds < 0:
            raise ValueError("the virtual clock only moves forward")
        self._now += seconds


def run_virtual(coro: Coroutine[Any, Any, T], start: float = 0.0) -> T:
    """Run `coro` to completion on a fresh virtual-clock loop and close the loop; returns its result."""
    loop = VirtualClockLoop(start)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

"""An asyncio event loop whose clock jumps to the next scheduled event instead of waiting for it.

Why: the planner runs the real controller, rollout manager and staleness buffer, which are ordinary asyncio code
that measure time with the loop's clock and wait with `asyncio.sleep` or on futures. If the loop's `time()` is a
number we own and the loop, instead of blocking for `timeout` seconds until its next timer, adds `timeout` to that
number, every sleep and timer fires in order at its virtual instant and an hour-long run takes as long as its
callbacks take to execute. Nothing else of asyncio changes: tasks, futures, conditions and cancellation behave exactly
as in a live run, and timers fire in the order asyncio's own loop fires them (ties included; `VirtualClockLoop`).

The simulated parts must not use threads, sockets or subprocesses (their readiness would never be polled), and
every wait must end in a timer or another task's action: a loop with nothing ready and nothing scheduled can never
make progress, so it raises `SimulationStalled` rather than hanging.
"""

from __future__ import annotations

import asyncio
import heapq
import selectors
from asyncio import events
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Every task waits and no timer is pending: in a live run this would hang forever."""


class _JumpSelector(selectors.SelectSelector):
    """Registers file objects like any selector (the loop's self-pipe), but a select never blocks: it moves the
    owning loop's clock forward by the timeout the loop asked for, which is exactly the gap to its next timer.
    (`VirtualClockLoop._run_once` makes the same jump itself and never polls; asyncio's own `_run_once` on this
    selector, which tests compare it with, polls here.)"""

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

    # ---- the timer heap, lean -----------------------------------------------------------------------------------
    # Why: a large plan runs millions of timers, and asyncio's heap orders TimerHandles through their Python-level
    # __lt__ (a frame per comparison). Here the heap holds (when, handle) pairs, compared in C. The order is the
    # same: a pair compares as its handle does (by `when`; equal whens compare as "not less" either way), so every
    # push and pop moves the same entries and timers fire in exactly the order asyncio's own loop fires them.
    # `_run_once` is asyncio's own iteration (3.10-3.13) less the I/O poll, which here never has anything to report:
    # no threads, sockets or signals in a simulation (module docstring); its clock jump is the selector's.

    def call_at(
        self, when: float, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()
        timer = events.TimerHandle(when, callback, args, self, context)
        if timer._source_traceback:
            del timer._source_traceback[-1]
        heapq.heappush(self._scheduled, (timer._when, timer))  # type: ignore[misc]
        timer._scheduled = True
        return timer

    def _run_once(self) -> None:
        sched: list[tuple[float, asyncio.TimerHandle]] = self._scheduled  # type: ignore[assignment]
        count = len(sched)
        if count > 100 and self._timer_cancelled_count / count > 0.5:  # asyncio's purge of cancelled timers
            kept = []
            for item in sched:
                if item[1]._cancelled:
                    item[1]._scheduled = False
                else:
                    kept.append(item)
            heapq.heapify(kept)
            self._scheduled = sched = kept  # type: ignore[assignment]
            self._timer_cancelled_count = 0
        else:
            while sched and sched[0][1]._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(sched)[1]._scheduled = False
        ready = self._ready  # type: ignore[attr-defined]
        if not (ready or self._stopping):  # type: ignore[attr-defined]
            if not sched:
                raise SimulationStalled("no task is ready and no timer is scheduled: the simulation cannot progress")
            timeout = min(max(0, sched[0][0] - self._now), _MAX_JUMP_S)
            if timeout > 0:
                self._now += timeout
        end_time = self._now + self._clock_resolution  # type: ignore[attr-defined]
        while sched and sched[0][0] < end_time:
            handle = heapq.heappop(sched)[1]
            handle._scheduled = False
            ready.append(handle)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()
        handle = None  # break a cycle should a callback have raised


_MAX_JUMP_S = 24 * 3600.0  # asyncio's MAXIMUM_SELECT_TIMEOUT: the longest wait one iteration makes


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

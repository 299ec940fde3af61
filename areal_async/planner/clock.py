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
from asyncio import events, format_helpers
from collections.abc import Callable, Coroutine
from contextvars import copy_context
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
            raise SimulationStalled(_STALLED)
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

    # ---- the timer heap and the handles, lean ---------------------------------------------------------------------
    # Why: a large plan runs millions of timers and callbacks, and asyncio's loop spends a Python frame or three on
    # each beside the callback's own work. Here the heap holds (when, handle) pairs, compared in C, where asyncio's
    # orders TimerHandles through their Python-level __lt__. The order is the same: a pair compares as its handle
    # does (by `when`; equal whens compare as "not less" either way), so every push and pop moves the same entries
    # and timers fire in exactly the order asyncio's own loop fires them. Handles are the stock Handle and
    # TimerHandle (a subclass with a one-frame cancel), their fields set as the constructors set them (outside
    # debug mode, where those constructors run), and `_run_once` runs each callback as Handle._run does, less that
    # frame. `_run_once` is asyncio's own iteration (3.10-3.13) less the I/O poll, which here never has anything to
    # report: no threads, sockets or signals in a simulation (module docstring); its clock jump is the selector's.

    def call_soon(self, callback: Callable[..., object], *args: Any, context: Any = None) -> asyncio.Handle:
        if self._debug:  # type: ignore[attr-defined]
            return super().call_soon(callback, *args, context=context)
        if self._closed:  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")
        handle = _new_handle(events.Handle)
        handle._context = copy_context() if context is None else context
        handle._loop = self
        handle._callback = callback
        handle._args = args
        handle._cancelled = False
        handle._repr = None
        handle._source_traceback = None
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle

    def call_at(
        self, when: float, callback: Callable[..., object], *args: Any, context: Any = None
    ) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        if self._debug:  # type: ignore[attr-defined]
            self._check_closed()  # type: ignore[attr-defined]
            timer = events.TimerHandle(when, callback, args, self, context)
            if timer._source_traceback:
                del timer._source_traceback[-1]
        else:
            if self._closed:  # type: ignore[attr-defined]
                raise RuntimeError("Event loop is closed")
            timer = _new_handle(_Timer)
            timer._context = copy_context() if context is None else context
            timer._loop = self
            timer._callback = callback
            timer._args = args
            timer._cancelled = False
            timer._repr = None
            timer._source_traceback = None
            timer._when = when
        heapq.heappush(self._scheduled, (timer._when, timer))  # type: ignore[misc]
        timer._scheduled = True
        return timer

    def _run_once(self) -> None:
        # asyncio's run_forever calls _run_once, then leaves once `_stopping` is set; iterating here until then is
        # the same sequence of iterations, less a call and this setup per iteration
        ready = self._ready  # type: ignore[attr-defined]
        resolution = self._clock_resolution  # type: ignore[attr-defined]
        heappop = heapq.heappop
        while True:
            sched: list[tuple[float, asyncio.TimerHandle]] = self._scheduled  # type: ignore[assignment]
            count = len(sched)
            # asyncio's purge of cancelled timers, when more than half are (an exact form of cancelled / count > 0.5)
            if count > 100 and 2 * self._timer_cancelled_count > count:
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
                    heappop(sched)[1]._scheduled = False
            if not (ready or self._stopping):  # type: ignore[attr-defined]
                if not sched:
                    raise SimulationStalled(_STALLED)
                timeout = sched[0][0] - self._now  # min(max(0, gap), _MAX_JUMP_S), as asyncio's, added if > 0
                if timeout > 0:
                    self._now += _MAX_JUMP_S if _MAX_JUMP_S < timeout else timeout
            end_time = self._now + resolution
            while sched and sched[0][0] < end_time:
                handle = heappop(sched)[1]
                handle._scheduled = False
                ready.append(handle)
            for _ in range(len(ready)):
                handle = ready.popleft()
                if not handle._cancelled:
                    try:  # Handle._run, inline
                        handle._context.run(handle._callback, *handle._args)
                    except (SystemExit, KeyboardInterrupt):
                        raise
                    except BaseException as exc:
                        _report(handle, exc)
            handle = None  # break a cycle should a callback have raised
            if self._stopping:  # type: ignore[attr-defined]
                return


class _Timer(events.TimerHandle):
    """A TimerHandle whose cancel() is one frame: what TimerHandle.cancel, the loop's _timer_handle_cancelled and
    Handle.cancel do, in that order (a simulated server moves its one timer on most of its events)."""

    __slots__ = ()

    def cancel(self) -> None:
        if not self._cancelled:
            if self._scheduled:
                self._loop._timer_cancelled_count += 1  # type: ignore[attr-defined]
            self._cancelled = True
            if self._loop.get_debug():
                self._repr = repr(self)  # type: ignore[attr-defined]
            self._callback = None  # type: ignore[assignment]
            self._args = None  # type: ignore[assignment]


def _report(handle: asyncio.Handle, exc: BaseException) -> None:
    """What Handle._run does with a callback's exception: the loop's exception handler gets it."""
    cb = format_helpers._format_callback_source(handle._callback, handle._args)  # type: ignore[attr-defined]
    context: dict[str, Any] = {"message": f"Exception in callback {cb}", "exception": exc, "handle": handle}
    if handle._source_traceback:  # type: ignore[attr-defined]
        context["source_traceback"] = handle._source_traceback  # type: ignore[attr-defined]
    handle._loop.call_exception_handler(context)  # type: ignore[attr-defined]


_new_handle = object.__new__  # a Handle without its constructor (call_soon and call_at set every field)


_STALLED = "no task is ready and no timer is scheduled: the simulation cannot progress"
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

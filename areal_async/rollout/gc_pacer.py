"""Pacing CPython's garbage collector from an asyncio event loop, for processes that hold thousands of requests."""

from __future__ import annotations

import asyncio
import gc
import time


class GCPacer:
    """Runs CPython's cyclic garbage collector from the event loop instead of on allocation counts.

    Why: each in-flight rollout holds ~100 GC-tracked objects (its task and coroutines, aiohttp's request, timer and
    headers) that live as long as the request, so they all outlive the young generations. CPython 3.11 then
    (a) counts the frees of old objects against new allocations, so young collections come rarely and each one scans
    tens of thousands of objects (50-200 ms at 10k in flight), and (b) starts a full collection whenever the old
    generation has grown by a quarter: every few seconds, a scan of the whole in-flight heap (~1M objects, seconds)
    that finds nothing, because request objects die by reference counting. Both stall every rollout at once.

    While started: automatic collection is off; every `young_every_s` the young generations are collected (the
    pause is bounded by what was allocated since the last one, ~1 ms); a full collection runs every `full_every_s`
    to reclaim long-lived cycles; and everything that existed before the start (dataset, tokenizer, modules) is
    frozen out of every scan. `stop()` restores the collector. Process-wide, so starts are counted: the last
    `stop()` restores. Young cycles (exceptions with tracebacks, say) are still freed within `young_every_s`.

    A process that has frozen objects itself (`gc.freeze()`: a server that forks, a test runner) keeps its freeze:
    the pacer then neither freezes nor unfreezes, since `gc.unfreeze()` cannot tell its objects from the owner's.
    """

    _users = 0
    _task: asyncio.Task | None = None
    _was_enabled = True
    _froze = False  # this pacer made the freeze in force, so its last stop undoes it

    def __init__(self, young_every_s: float = 0.05, full_every_s: float = 600.0) -> None:
        self.young_every_s = young_every_s
        self.full_every_s = full_every_s
        self._started = False

    def start(self) -> None:
        """Take over collection (inside a running loop)."""
        if self._started:
            return
        self._started = True
        cls = GCPacer
        cls._users += 1
        if cls._users == 1:
            cls._was_enabled = gc.isenabled()
            cls._froze = gc.get_freeze_count() == 0
            if cls._froze:
                gc.collect()  # before the rollout starts, a full collection stalls nothing; garbage is not frozen
                gc.freeze()
            gc.disable()
        loop = asyncio.get_running_loop()
        # one pacer task, on the loop of the latest start (a loop that died without stop() leaves a dead task)
        if cls._task is None or cls._task.done() or cls._task.get_loop() is not loop:
            cls._task = loop.create_task(self._run(), name="gc-pacer")

    async def _run(self) -> None:
        last_full = time.monotonic()
        while True:
            await asyncio.sleep(self.young_every_s)
            if time.monotonic() - last_full >= self.full_every_s:
                gc.collect()
                last_full = time.monotonic()
            else:
                gc.collect(1)

    def stop(self) -> None:
        """Hand collection back to CPython (when no other pacer user is left)."""
        if not self._started:
            return
        self._started = False
        cls = GCPacer
        cls._users -= 1
        if cls._users == 0:
            if cls._task is not None:
                cls._task.cancel()
                cls._task = None
            if cls._froze:
                gc.unfreeze()
                cls._froze = False
            if cls._was_enabled:
                gc.enable()

"""The staleness-bounded rollout buffer.

Two things live here, because they are one piece of state:

* the admission rule (AReaL's): a new prompt group may start only while

      accepted_total + running + 1 <= (eta + v + 1) * B

  where v is the current policy version, B the batch size in groups, accepted_total every group ever accepted (taking
  a batch out does not lower it) and running the groups in flight. Then every group trained at step v was *started*
  under a policy no older than v - eta. eta = 0 is synchronous RL; eta = None is unbounded (only the concurrency cap).
* the buffer of finished groups, handed out oldest first.

Everything is driven from one asyncio event loop; an `asyncio.Condition` wakes whoever waits (the submitter for
capacity, the trainer for a batch). `close()` wakes every waiter, which then raises `BufferClosed`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from areal_async.types import Trajectory


class BufferClosed(RuntimeError):
    """Raised in waiters once the buffer is closed (shutdown or a fatal error elsewhere)."""


@dataclass
class Group:
    """One accepted prompt group and when/under which version it was started and finished."""

    trajectories: list[Trajectory]
    start_version: int
    finish_version: int
    accepted_at: float = field(default_factory=time.monotonic)


class StalenessBuffer:
    def __init__(self, batch_size: int, eta: int | None, max_running: int) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if eta is not None and eta < 0:
            raise ValueError("eta must be >= 0 or None")
        self.batch_size = batch_size
        self.eta = eta
        self.max_running = max_running
        self.version = 0
        self.accepted_total = 0
        self.rejected_total = 0
        self.running = 0
        self._groups: deque[Group] = deque()
        self._cond = asyncio.Condition()
        self._closed: BaseException | None = None

    # ---- admission ----------------------------------------------------------------------------------------------

    def capacity(self) -> int:
        """How many more groups may start now."""
        cap = self.max_running - self.running
        if self.eta is not None:
            cap = min(cap, (self.eta + self.version + 1) * self.batch_size - self.accepted_total - self.running)
        return max(cap, 0)

    async def acquire_slot(self) -> int:
        """Wait until the admission rule allows one more group; count it as running; return the version it starts
        under."""
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed is not None or self.capacity() > 0)
            self._raise_if_closed()
            self.running += 1
            return self.version

    async def finish(self, group: Group | None) -> None:
        """A started group is done: accept it into the buffer, or (None) reject it, freeing its slot."""
        async with self._cond:
            self.running -= 1
            if group is None:
                self.rejected_total += 1
            else:
                self.accepted_total += 1
                self._groups.append(group)
            self._cond.notify_all()

    # ---- consumption --------------------------------------------------------------------------------------------

    async def get_batch(self, n: int | None = None) -> list[Group]:
        """Wait for n (default B) groups and return the oldest ones."""
        n = n or self.batch_size
        async with self._cond:
            await self._cond.wait_for(lambda: self._closed is not None or len(self._groups) >= n)
            self._raise_if_closed()
            return [self._groups.popleft() for _ in range(n)]

    async def set_version(self, version: int) -> None:
        """A new policy version is live: capacity grows by B."""
        async with self._cond:
            self.version = version
            self._cond.notify_all()

    def restore(self, version: int) -> None:
        """After resuming from a checkpoint at version v: accepted_total = v * B (AReaL issue 1388: leaving it at 0
        lets capacity burst to (eta + v + 1) * B at once)."""
        self.version = version
        self.accepted_total = version * self.batch_size

    def __len__(self) -> int:
        return len(self._groups)

    # ---- shutdown -----------------------------------------------------------------------------------------------

    async def close(self, reason: BaseException | None = None) -> None:
        async with self._cond:
            self._closed = reason or BufferClosed("buffer closed")
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            if isinstance(self._closed, BufferClosed):
                raise self._closed
            raise BufferClosed(str(self._closed)) from self._closed

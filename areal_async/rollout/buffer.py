"""The staleness-bounded rollout buffer.

Two things live here, because they are one piece of state:

* the admission rule (AReaL's): a new prompt group may start only while

      accepted_total + running + 1 <= (eta + v + 1) * B

  where v is the current policy version, B the batch size in groups, accepted_total every group ever accepted (taking
  a batch out does not lower it) and running the groups in flight. eta = 0 is synchronous RL; eta = None is unbounded
  (only the concurrency cap).
* the buffer of finished groups, handed out oldest *start* first, with one wait: the batch for step v is taken only
  once no group started under version v - eta or older is still running.

Why the wait: the admission rule bounds how many groups start under each version, not the order they finish in. A
slow group started under v - eta can miss the batch of step v while faster, newer groups fill it, and its tokens would
then be trained at v + 1, eta + 1 versions old (measured: 2 at eta = 1 on the default task before this rule). With the
rule every trained token is at most eta versions old: groups started under <= v - eta number at most (v + 1) * B, v * B
of them were trained before (oldest first), so the rest fit in this batch. The wait is short in practice: with
interruptible generation a straggler keeps running under the new weights while the trainer works.
Everything is driven from one asyncio event loop; an `asyncio.Condition` wakes whoever waits (the submitter for
capacity, the trainer for a batch). `close()` wakes every waiter, which then raises `BufferClosed`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
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
        self._running_at: Counter[int] = Counter()  # start version -> groups of it still running
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
            self._running_at[self.version] += 1
            return self.version

    async def finish(self, group: Group | None, start_version: int | None = None) -> None:
        """A started group is done: accept it into the buffer, or (None) reject it, freeing its slot.

        `start_version` (what `acquire_slot` returned) is required with None; an accepted group carries its own."""
        async with self._cond:
            started = group.start_version if group is not None else start_version
            if started is None:
                raise ValueError("finish(None) needs the start_version acquire_slot returned")
            self.running -= 1
            self._running_at[started] -= 1
            if self._running_at[started] <= 0:
                del self._running_at[started]
            if group is None:
                self.rejected_total += 1
            else:
                self.accepted_total += 1
                self._groups.append(group)
            self._cond.notify_all()

    # ---- consumption --------------------------------------------------------------------------------------------

    def _straggler(self) -> bool:
        """A group started under version <= v - eta is still running (the batch must wait for it)."""
        if self.eta is None or not self._running_at:
            return False
        return min(self._running_at) <= self.version - self.eta

    async def get_batch(self, n: int | None = None) -> list[Group]:
        """Wait for n (default B) groups and for any straggler (see the module docstring); return the n groups with
        the oldest start versions (ties: the first finished)."""
        n = n or self.batch_size
        async with self._cond:
            await self._cond.wait_for(
                lambda: self._closed is not None or (len(self._groups) >= n and not self._straggler()))
            self._raise_if_closed()
            order = sorted(range(len(self._groups)), key=lambda i: self._groups[i].start_version)  # stable
            take = set(order[:n])
            batch = [g for i, g in enumerate(self._groups) if i in take]
            self._groups = deque(g for i, g in enumerate(self._groups) if i not in take)
            return sorted(batch, key=lambda g: g.start_version)

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

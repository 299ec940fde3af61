"""The staleness-bounded rollout buffer: AReaL's admission rule, the earliest-deadline batch rule, and the finished
groups between them, as one piece of state on the controller's event loop.

The rules, the step protocol they assume (one batch of B groups per version, versions one step at a time) and the
proof that every trained token is at most eta versions old are in docs/design.md, "The staleness bound".
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from dataclasses import dataclass

from areal_async.types import Trajectory


class BufferClosed(RuntimeError):
    """Raised in waiters once the buffer is closed (shutdown or a fatal error elsewhere)."""


@dataclass
class Group:
    """One accepted prompt group and the versions it was started and finished under."""

    trajectories: list[Trajectory]
    start_version: int
    finish_version: int


class StalenessBuffer:
    """The admission rule, the finished groups and the batch rule (docs/design.md, "The staleness bound").

    Protocol, per step: `get_batch()` while the version is v, train, then `set_version(v + 1)`; `restore(v)` before
    any group starts when resuming. Counters: `accepted_total`, `rejected_total`, `trained_total` (groups handed
    out, plus v * B booked by `restore`), `held_batches` / `held_s` (how often and how long B finished groups were
    there but the batch rule made the trainer wait, in event-loop seconds).
    """

    def __init__(self, batch_size: int, eta: int | None, max_running: int) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if eta is not None and eta < 0:
            raise ValueError("eta must be >= 0 or None")
        if max_running < 1:
            raise ValueError("max_running must be >= 1")
        self.batch_size = batch_size
        self.eta = eta
        self.max_running = max_running
        self.version = 0
        self.accepted_total = 0
        self.rejected_total = 0
        self.trained_total = 0
        self.running = 0
        self.held_batches = 0
        self.held_s = 0.0
        self._buffered: dict[int, deque[Group]] = {}  # start version -> finished groups, first finished first
        self._n_buffered = 0
        self._running_at: Counter[int] = Counter()  # start version -> groups of it still running
        self._taken_at_version = 0  # groups handed out while the version is self.version
        self._cond = asyncio.Condition()
        self._closed: BaseException | None = None
        # who waits on the condition, so that a finished group wakes them only when it can change what they do
        self._slot_waiters = 0  # acquire_slot calls in their wait
        self._batch_waiters: list[list[int]] = []  # [n, held] of each get_batch in its wait

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
            self._slot_waiters += 1
            try:
                await self._cond.wait_for(lambda: self._closed is not None or self.capacity() > 0)
            finally:
                self._slot_waiters -= 1
            self._raise_if_closed()
            self.running += 1
            self._running_at[self.version] += 1
            return self.version

    def rebook(self, started: int, earlier: int) -> None:
        """A group that `acquire_slot` booked under `started` resumes with tokens made under version `earlier`
        (a resume continuing the group from its journal): count it as started then, so that the batch rule trains
        it by `earlier + eta` like any group started under `earlier` (docs/design.md, "Resumed groups").

        Synchronous (no wait in between, so the admission totals never see the group twice). Raises ValueError
        when `earlier` is outside the staleness window: such a group must be dropped, not trained."""
        if earlier > started or self._running_at[started] <= 0:
            raise ValueError(f"rebook: no group started under version {started} to move to {earlier}")
        if self.eta is not None:
            if earlier < self.version - self.eta:
                raise ValueError(
                    f"rebook: version {earlier} is more than eta={self.eta} versions behind version {self.version}"
                )
            for u in range(earlier, self.version):  # I(v) part 2 must still hold with this group counted under u
                untrained = sum(n for w, n in self._running_at.items() if w <= u)
                untrained += sum(len(q) for w, q in self._buffered.items() if w <= u)
                if untrained + 1 > (u + self.eta - self.version + 1) * self.batch_size:
                    raise ValueError(
                        f"rebook: no room under version {u}: {untrained} untrained groups started by then already "
                        f"fill what steps {self.version}..{u + self.eta} can train"
                    )
        self._running_at[started] -= 1
        if self._running_at[started] == 0:
            del self._running_at[started]
        self._running_at[earlier] += 1

    async def finish(self, group: Group | None, start_version: int | None = None) -> None:
        """A started group is done: accept it into the buffer, or (None) reject it, freeing its slot.

        `start_version` (what `acquire_slot` returned) is required with None; an accepted group carries its own."""
        async with self._cond:
            started = group.start_version if group is not None else start_version
            if started is None:
                raise ValueError("finish(None) needs the start_version acquire_slot returned")
            if group is not None and start_version is not None and start_version != group.start_version:
                raise ValueError(f"finish: start_version {start_version} but the group says {group.start_version}")
            if self._running_at[started] <= 0:
                self._running_at.pop(started, None)
                raise ValueError(f"finish: no group started under version {started} is running")
            self.running -= 1
            self._running_at[started] -= 1
            if self._running_at[started] == 0:
                del self._running_at[started]
            if group is None:
                self.rejected_total += 1
            else:
                self.accepted_total += 1
                self._buffered.setdefault(started, deque()).append(group)
                self._n_buffered += 1
            if self._finish_wakes():
                self._cond.notify_all()

    def _finish_wakes(self) -> bool:
        """Whether a group just finished can change what a waiter does: a slot waiter proceeds once capacity is
        positive; a batch waiter once the batch rule allows its batch, and it first notes the moment its n groups
        are there (`held_s`). Any other wake-up would find its predicate false and wait again with nothing changed
        (no state, no order: the waiters re-queue as they were), so it is skipped.

        Why: under the staleness bound a finish frees no admission slot (the accepted count rises as the running
        count falls), so with thousands of groups in flight every finish woke the submit loop and the trainer only
        for both to sleep again: most of the buffer's cost in a large run, and of the planner's at 1,024 GPUs."""
        if self._closed is not None:
            return True
        if self._slot_waiters and self.capacity() > 0:
            return True
        for n, held in self._batch_waiters:
            if self._n_buffered >= n and (not held or self._ready(n)):
                return True
        return False

    # ---- consumption --------------------------------------------------------------------------------------------

    def _candidate_counts(self, n: int) -> dict[int, int]:
        """start version -> how many groups of it the candidate batch (the n earliest deadlines) takes."""
        take: dict[int, int] = {}
        for s in sorted(self._buffered):
            if n <= 0:
                break
            k = min(n, len(self._buffered[s]))
            take[s] = k
            n -= k
        return take

    def _ready(self, n: int) -> bool:
        """The batch rule: n groups are buffered and taking the candidate leaves every window step feasible."""
        if self._n_buffered < n:
            return False
        if self.eta is None:
            return True
        v, eta, b = self.version, self.eta, self.batch_size
        take = self._candidate_counts(n)
        left = 0  # L(u): known untrained groups started under <= u that the candidate leaves behind
        for u in range(v - eta, v):
            left += self._running_at.get(u, 0) + len(self._buffered.get(u, ())) - take.get(u, 0)
            if left > (u + eta - v) * b:
                return False
        return True

    async def get_batch(self, n: int | None = None) -> list[Group]:
        """Wait until the batch rule (docs/design.md) allows a batch; return the n (default B) groups with the
        earliest deadlines, i.e. the oldest start versions (ties: the first finished), sorted by start version.

        With a bounded eta, n must be B: the bound's proof counts B groups per step."""
        n = self.batch_size if n is None else n
        if n < 1:
            raise ValueError("get_batch: n must be >= 1")
        if self.eta is not None and n != self.batch_size:
            raise ValueError(
                f"get_batch: n={n}, but with a bounded eta every step takes batch_size="
                f"{self.batch_size} groups (the staleness bound counts on it)"
            )
        loop = asyncio.get_running_loop()
        async with self._cond:
            held_since: float | None = None
            waiter = [n, 0]  # what _finish_wakes knows of this wait: its n, and whether held_since is set
            self._batch_waiters.append(waiter)
            try:
                while self._closed is None and not self._ready(n):
                    if held_since is None and self._n_buffered >= n:
                        held_since = loop.time()
                        self.held_batches += 1
                        waiter[1] = 1
                    await self._cond.wait()
            finally:
                self._batch_waiters = [w for w in self._batch_waiters if w is not waiter]
            if held_since is not None:
                self.held_s += loop.time() - held_since
            self._raise_if_closed()
            batch: list[Group] = []
            for s, k in self._candidate_counts(n).items():
                q = self._buffered[s]
                batch.extend(q.popleft() for _ in range(k))
                if not q:
                    del self._buffered[s]
            self._n_buffered -= n
            self.trained_total += n
            self._taken_at_version += n
            return batch

    async def set_version(self, version: int) -> None:
        """A new policy version is live (capacity grows by B); the same version again just wakes the waiters.

        One step at a time, and with a bounded eta only after the batch of the current version was taken: the
        bound's proof counts B trained groups per version."""
        async with self._cond:
            if version not in (self.version, self.version + 1):
                raise ValueError(
                    f"set_version({version}) at version {self.version}: versions move one step at a "
                    "time (use restore() when resuming)"
                )
            if version == self.version + 1:
                if self.eta is not None and self._taken_at_version < self.batch_size:
                    raise ValueError(f"set_version({version}) before the batch of step {self.version} was taken")
                self.version = version
                self._taken_at_version = 0
            self._cond.notify_all()

    def restore(self, version: int) -> None:
        """After resuming from a checkpoint at version v (before any group starts): the v * B groups trained before
        count as accepted and trained (AReaL issue 1388: leaving accepted_total at 0 lets capacity burst to
        (eta + v + 1) * B at once)."""
        if version < 0:
            raise ValueError("restore: version must be >= 0")
        booked = self.version * self.batch_size
        if (
            self.running
            or self._n_buffered
            or self.rejected_total
            or self.accepted_total != booked
            or self.trained_total != booked
        ):
            raise ValueError("restore() must come before any group starts or any batch is taken")
        self.version = version
        self.accepted_total = version * self.batch_size
        self.trained_total = version * self.batch_size

    def running_by_version(self) -> dict[int, int]:
        """start version -> groups of it still running (a copy)."""
        return dict(self._running_at)

    def buffered_by_version(self) -> dict[int, int]:
        """start version -> finished groups of it waiting in the buffer."""
        return {s: len(q) for s, q in self._buffered.items()}

    def __len__(self) -> int:
        return self._n_buffered

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

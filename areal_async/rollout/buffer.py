"""The staleness-bounded rollout buffer: the admission rule and the batch rule, one piece of state.

Notation: B is the batch size in groups, v the current policy version, eta the staleness bound. Step v trains the
batch taken while the version is v; afterwards the version becomes v + 1. A group *starts under* s when it gets its
slot while the version is s; the servers already serve s then (the version moves only after the weights are
loaded), so every token of the group has version >= s and training it at step v stays within the bound iff
v - s <= eta. Its *deadline* is s + eta, the last step that may train it.

Admission (AReaL's): a new group may start only while

    accepted_total + running + 1 <= (eta + v + 1) * B

where accepted_total counts every group ever accepted (taking a batch out does not lower it; `restore(v)` sets it to
v * B) and running the groups in flight. eta = 0 is synchronous RL; eta = None is unbounded (only the concurrency
cap `max_running` applies, and the batch rule below is just "oldest start first").

The batch rule (earliest deadline first, with a feasibility window): the candidate batch for step v is the B
buffered groups with the earliest deadlines (oldest starts; ties: first finished). It is taken only if, for every
u in [v - eta, v - 1],

    L(u) = (running + buffered groups started under <= u) - (candidate groups started under <= u) <= (u + eta - v) * B

L(u) is what stays known and untrained with a deadline <= u + eta, and the steps v + 1 .. u + eta train
(u + eta - v) * B groups. At u = v - eta it says nothing due now may be left behind (a running group started under
v - eta blocks the batch, as a straggler should). Otherwise the trainer waits for the next finish.

Why this bounds every trained token by eta (and where the old rule, "wait only for groups due now", was wrong):

(A) accepted_total + running <= (eta + v + 1) * B holds at every moment: acquire_slot checks it, a finish keeps the
    sum (accepted) or lowers it (rejected), versions only grow. At the moment the version leaves u every group
    started under <= u is accepted, running or rejected, so at most (eta + u + 1) * B of them are ever accepted
    (counting the v0 * B that restore(v0) books as accepted and trained before v0).
(B) Every step takes exactly B groups and the version moves one step at a time (both enforced below), so when step
    v takes its batch, v * B groups were trained before it, all started under <= v - 1.
Invariant I(v), throughout step v until its batch is taken: nothing untrained started under < v - eta, and for every
u in [v - eta, v - 1] the untrained groups (running or buffered) started under <= u number U(u) <= (u + eta - v + 1)
* B.
  * Safety: by I(v) every buffered group started under >= v - eta, so the batch of step v is within the bound.
  * I(v) -> I(v + 1): the check at u = v - eta leaves nothing started under <= v - eta; at u in [v + 1 - eta, v - 1]
    it leaves at most (u + eta - v) * B, which is I(v + 1)'s limit. The rest of step v only starts groups under v,
    finishes or rejects groups, none of which raises these counts. For u = v: after the batch (v + 1) * B groups
    were trained, all started under <= v, so by (A) at most (eta + v + 1) * B - (v + 1) * B = eta * B untrained
    remain. I(v0) holds trivially: nothing is untrained when a run starts or resumes.
  * Liveness (given that every started group finishes or is rejected in finite time): under I(v), once every group
    started under <= v - 1 has landed and B are buffered, the check passes: with none of them running, the
    candidate takes min(B, U(u)) of the U(u) groups started under <= u, so L(u) = max(0, U(u) - B) <= (u + eta - v)
    * B. Groups started under v never enter the check, and B groups do arrive: accepted_total = v * B + buffered,
    so admission allows (eta + 1) * B - buffered - running > 0 more while fewer than B are buffered and none run
    (and max_running >= 1). So the trainer waits at most for groups already running and for B finished ones; the
    buffer never deadlocks.
  * No needless wait: the candidate holds, for every u at once, the most groups started under <= u that any B
    buffered groups could, so when it fails every batch fails; and a failing L(u) means that, should the running
    groups be accepted, more groups are due by step u + eta than steps v + 1 .. u + eta can train. In particular,
    under I(v) a batch is taken whenever strict start order (no running group older than a taken one) would take
    one: what it takes leaves nothing older than its youngest group, and B fewer of everything else.
  * Rejections (failed, empty or filtered groups) only lower running and never raise accepted_total: (A) gets
    slacker, and the capacity a rejection frees is counted by (A) under the version that reuses it.
The old rule waited only for running groups started under <= v - eta, so at earlier steps newer groups were trained
ahead of old groups still running, and more than B old groups could be left for one step: at eta = 2, B = 1, two
slow groups start under 0, a fast group started under 1 is trained at step 1, and at step 3 the trainer took a group
started under 0, 3 versions old (eta = 4, B = 2: 7; the worst case grows like 2 * eta - 1). Under the new rule
step 1 waits for the slow groups. For eta <= 1 the two rules coincide.

Everything is driven from one asyncio event loop; an `asyncio.Condition` wakes whoever waits (the submitter for
capacity, the trainer for a batch). `close()` wakes every waiter, which then raises `BufferClosed`.
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
    """The admission rule, the finished groups and the batch rule (see the module docstring).

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
            self._cond.notify_all()

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
        """Wait until the batch rule (module docstring) allows a batch; return the n (default B) groups with the
        earliest deadlines, i.e. the oldest start versions (ties: the first finished), sorted by start version.

        With a bounded eta, n must be B: the bound's proof counts B groups per step."""
        n = self.batch_size if n is None else n
        if n < 1:
            raise ValueError("get_batch: n must be >= 1")
        if self.eta is not None and n != self.batch_size:
            raise ValueError(f"get_batch: n={n}, but with a bounded eta every step takes batch_size="
                             f"{self.batch_size} groups (the staleness bound counts on it)")
        loop = asyncio.get_running_loop()
        async with self._cond:
            held_since: float | None = None
            while self._closed is None and not self._ready(n):
                if held_since is None and self._n_buffered >= n:
                    held_since = loop.time()
                    self.held_batches += 1
                await self._cond.wait()
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
                raise ValueError(f"set_version({version}) at version {self.version}: versions move one step at a "
                                 "time (use restore() when resuming)")
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
        if self.running or self._n_buffered or self.rejected_total or self.accepted_total != booked \
                or self.trained_total != booked:
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

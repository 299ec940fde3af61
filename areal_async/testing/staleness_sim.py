"""A test helper: drive a real `StalenessBuffer` with simulated rollout workers and a simulated trainer, on a
virtual clock, and audit the schedule.

The workers and the trainer follow the controller's protocol (acquire a slot, run, finish or reject; get_batch,
train, set_version), but their durations are simulated seconds: `VirtualClockLoop` jumps to the next timer whenever
nothing is ready, so a schedule of hours runs in milliseconds and the same seed gives the same schedule. The moment
the loop would jump is also the moment every task has seen every wake-up, so that is where the audits run:

* the staleness bound, from the per-token versions of every batch the trainer takes;
* the admission invariant and the concurrency cap;
* starvation: while the trainer waits with B finished groups buffered, strict start order (take groups only when no
  running group is older) must not be able to take a batch, and no batch of the buffered groups may be safe
  (checked against an offline earliest-deadline schedule of the known groups, all running ones assumed accepted);
* liveness: a loop with nothing ready and no timer is a deadlock, and the run must end within a simulated-time
  budget.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import selectors
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_async.rollout.buffer import Group, StalenessBuffer
from areal_async.types import Trajectory


class Deadlock(RuntimeError):
    """Nothing can run and no timer is due: every task waits on something that will never happen."""


class OutOfTime(RuntimeError):
    """The simulated run did not reach its step count within its budget."""


class _VirtualSelector(selectors.BaseSelector):
    """A real selector that never blocks: a wait of t seconds advances the loop's clock by t instead."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        self._real = selectors.DefaultSelector()
        self._loop = loop

    def register(self, fileobj, events, data=None):  # type: ignore[no-untyped-def]
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):  # type: ignore[no-untyped-def]
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):  # type: ignore[no-untyped-def]
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None):  # type: ignore[no-untyped-def]
        if timeout is None or timeout > 0:
            self._loop._idle(timeout)
        return self._real.select(0)

    def get_map(self):  # type: ignore[no-untyped-def]
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on simulated time. `on_idle()` runs each time the loop is about to jump forward (every task
    has run to its next wait); it may raise to stop the run. No threads: a wait without a timer is a `Deadlock`."""

    def __init__(self, on_idle: Callable[[], None] | None = None) -> None:
        self._now = 0.0
        self.on_idle = on_idle
        super().__init__(_VirtualSelector(self))
        self._clock_resolution = 1e-6

    def time(self) -> float:
        return self._now

    def _idle(self, timeout: float | None) -> None:
        if self.on_idle is not None:
            self.on_idle()
        if timeout is None:
            raise Deadlock(f"deadlock at simulated t={self._now:.3f}s: nothing ready and no timer")
        self._now += timeout


# ---- rules to compare with ---------------------------------------------------------------------------------------


class OldStragglerRule(StalenessBuffer):
    """A simpler batch rule, kept to show the tests catch it: wait only for running groups started under
    <= v - eta. Unsafe for eta >= 2 (docs/design.md says why)."""

    def _ready(self, n: int) -> bool:
        if len(self) < n:
            return False
        running = self.running_by_version()
        if self.eta is None or not running:
            return True
        return min(running) > self.version - self.eta


class StrictStartOrder(StalenessBuffer):
    """The simple safe rule: take groups only when no running group has an older start version (the trainer then
    waits for the slowest old group at every step)."""

    def _ready(self, n: int) -> bool:
        if self.eta is None:
            return len(self) >= n
        return strict_order_takes(self.running_by_version(), self.buffered_by_version(), n)


# ---- the simulated run ----------------------------------------------------------------------------------------------


@dataclass
class SimConfig:
    batch_size: int
    eta: int | None
    max_running: int
    steps: int
    seed: int = 0
    train_s: float = 1.0  # one train step plus its weight sync
    # start index, rng -> simulated seconds the group takes
    duration: Callable[[int, random.Random], float] = lambda i, rng: rng.expovariate(1.0)
    # start index, duration, rng -> the group is rejected (failed, empty or filtered) instead of accepted
    reject: Callable[[int, float, random.Random], bool] = lambda i, d, rng: False
    start_at: int = 0  # restore(start_at) before anything starts (a resumed run)
    crash_at: int | None = None  # after this step: cancel everything, new buffer, restore (a crash and resume)
    # at the crash, the groups in flight (running, or finished and untrained) continue after the resume from where
    # they were, under their old start version (StalenessBuffer.rebook, as a journaled resume does), instead of
    # being lost; rebooks the buffer refuses are dropped and counted
    resume_in_flight: bool = False
    budget_s: float = 1e6
    audit_starvation: bool = True


@dataclass
class Batch:
    version: int
    start_versions: list[int]
    min_token_version: int
    max_token_version: int

    @property
    def staleness(self) -> int:
        return self.version - self.min_token_version


@dataclass
class SimResult:
    batches: list[Batch] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)  # audit failures, first ones only
    trainer_wait_s: float = 0.0
    held_s: float = 0.0
    groups_started: int = 0
    groups_rejected: int = 0
    groups_resumed: int = 0
    groups_refused_on_resume: int = 0
    sim_s: float = 0.0

    @property
    def max_staleness(self) -> int:
        return max((b.staleness for b in self.batches), default=0)


def _group(start: int, versions: list[int], tag: int) -> Group:
    t = Trajectory(
        input_ids=[1] * (len(versions) + 1),
        loss_mask=[0] + [1] * len(versions),
        logprobs=[0.0] * (len(versions) + 1),
        versions=[-1] + versions,
        reward=0.0,
        group_id=tag,
    )
    return Group([t], start_version=start, finish_version=versions[-1])


def safe_after_taking(
    take: dict[int, int], running: dict[int, int], buffered: dict[int, int], v: int, eta: int, b: int
) -> bool:
    """Offline check, independent of the buffer's code: after step v takes `take` (start version -> count), can the
    steps v + 1, v + 2, ... (b groups each, earliest deadline first) train every known group, the running ones
    assumed accepted and available, by its deadline (start + eta)? Groups that start later have deadlines >= v + eta,
    behind every known group whose deadline is tighter, and admission leaves room for them (docs/design.md, the
    admission rule)."""
    if any(s + eta < v for s in take):
        return False
    deadlines = sorted(
        [s + eta for s, k in running.items() for _ in range(k)]
        + [s + eta for s, k in buffered.items() for _ in range(k - take.get(s, 0))]
    )
    step = v + 1
    for i in range(0, len(deadlines), b):  # step `step` trains deadlines[i:i + b]
        if deadlines[i] < step:
            return False
        step += 1
    return True


def _choices(buffered: dict[int, int], b: int, limit: int = 24) -> list[dict[int, int]] | None:
    """Every way to take b groups from `buffered` (by start version; groups of one version are interchangeable), or
    None when there are more than `limit`."""
    keys = sorted(buffered)
    tail = [0] * (len(keys) + 1)  # groups available from keys[i] on
    for i in range(len(keys) - 1, -1, -1):
        tail[i] = tail[i + 1] + buffered[keys[i]]
    out: list[dict[int, int]] = []

    def rec(i: int, need: int, cur: dict[int, int]) -> bool:
        if need == 0:
            out.append(dict(cur))
            return len(out) <= limit
        if tail[i] < need:
            return True
        for k in range(min(need, buffered[keys[i]]), -1, -1):
            if k:
                cur[keys[i]] = k
            if not rec(i + 1, need - k, cur):
                return False
            cur.pop(keys[i], None)
        return True

    return out if rec(0, b, {}) else None


def strict_order_takes(running: dict[int, int], buffered: dict[int, int], b: int) -> bool:
    """Would strict start order take a batch now: b buffered groups, none younger than a running one?"""
    if sum(buffered.values()) < b:
        return False
    oldest_running = min(running, default=None)
    need = b
    for s in sorted(buffered):
        if oldest_running is not None and oldest_running < s:
            return False
        need -= buffered[s]
        if need <= 0:
            return True
    return False


def simulate(cfg: SimConfig, buffer_cls: type[StalenessBuffer] = StalenessBuffer) -> SimResult:
    """Run one simulated schedule to `cfg.steps` trained steps; return what the trainer took and what the audits
    found. Raises `Deadlock` or `OutOfTime` when the run cannot finish."""
    rng = random.Random(cfg.seed)
    res = SimResult()
    b, eta = cfg.batch_size, cfg.eta
    state: dict = {"buf": None, "trainer_waiting": False}
    loop = VirtualClockLoop()
    running: Counter = Counter()  # the simulation's own books: start version -> running
    buffered: dict[int, int] = {}  # start version -> finished, accepted, not yet trained
    index = itertools.count()

    def violation(msg: str) -> None:
        if len(res.violations) < 5:
            res.violations.append(msg)

    def audit() -> None:
        buf: StalenessBuffer | None = state["buf"]
        if loop.time() > cfg.budget_s:
            raise OutOfTime(f"{len(res.batches)} of {cfg.steps - cfg.start_at} steps after {cfg.budget_s}s (simulated)")
        if buf is None:
            return
        v = buf.version
        if buf.running > cfg.max_running:
            violation(f"t={loop.time():.2f}: {buf.running} running > cap {cfg.max_running}")
        if eta is not None and buf.accepted_total + buf.running > (eta + v + 1) * b:
            violation(f"t={loop.time():.2f}: admission invariant broken at v={v}")
        run_books = {s: k for s, k in running.items() if k}
        buf_books = {s: k for s, k in buffered.items() if k}
        if buf.running_by_version() != run_books or buf.buffered_by_version() != buf_books:
            violation(
                f"t={loop.time():.2f}: buffer books {buf.running_by_version()} / {buf.buffered_by_version()} "
                f"!= simulation's {run_books} / {buf_books}"
            )
        if not (cfg.audit_starvation and state["trainer_waiting"] and eta is not None):
            return
        if sum(buf_books.values()) < b:
            return
        if strict_order_takes(run_books, buf_books, b):
            violation(
                f"t={loop.time():.2f} v={v}: trainer waits though strict start order takes a batch "
                f"(running {run_books}, buffered {buf_books})"
            )
        choices = _choices(buf_books, b)
        if choices is None:  # too many to enumerate: the earliest-deadline candidate dominates every other
            choices = [_edf(buf_books, b)]
        for take in choices:
            if safe_after_taking(take, run_books, buf_books, v, eta, b):
                violation(
                    f"t={loop.time():.2f} v={v}: trainer waits though taking {take} is safe (running "
                    f"{run_books}, buffered {buf_books})"
                )
                break

    in_flight: dict[int, dict] = {}  # worker index -> what a resume would carry of it (resume_in_flight)

    async def worker(buf: StalenessBuffer, start: int, carried: dict | None = None) -> None:
        i = next(index) if carried is None else carried["i"]
        d = cfg.duration(i, rng) if carried is None else carried["left"]
        rejected = cfg.reject(i, d, rng) if carried is None else False
        mine = in_flight[i] = {"i": i, "start": start, "end": loop.time() + d, "mid": carried and carried["mid"]}
        if mine["mid"] is None:
            await asyncio.sleep(d / 2)
            mine["mid"] = buf.version  # tokens after an interruption carry the version then live
            await asyncio.sleep(d / 2)
        else:
            await asyncio.sleep(d)
        running[start] -= 1
        if rejected:
            in_flight.pop(i, None)
            res.groups_rejected += 1
            await buf.finish(None, start)
        else:
            mine["end"] = loop.time()  # finished: buffered until trained (a resume replays it at once)
            mine["fin"] = buf.version
            buffered[start] = buffered.get(start, 0) + 1
            await buf.finish(_group(start, [start, start, mine["mid"], buf.version], i))

    async def resumer(buf: StalenessBuffer, carried: list[dict], tasks: set) -> None:
        """The carried groups first (a resume draws them again before fresh ones), each booked under its start."""
        for c in carried:
            got = await buf.acquire_slot()
            try:
                buf.rebook(got, c["start"])
            except ValueError:
                res.groups_refused_on_resume += 1
                await buf.finish(None, got)
                continue
            running[c["start"]] += 1
            res.groups_resumed += 1
            t = asyncio.ensure_future(worker(buf, c["start"], c))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def submitter(buf: StalenessBuffer, tasks: set) -> None:
        while True:
            start = await buf.acquire_slot()
            running[start] += 1
            res.groups_started += 1
            t = asyncio.ensure_future(worker(buf, start))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

    async def segment(first: int, last: int, carried: list[dict] | None = None) -> None:
        buf = buffer_cls(b, eta, cfg.max_running)
        buf.restore(first)
        running.clear()
        buffered.clear()
        in_flight.clear()
        state["buf"] = buf
        tasks: set = set()
        if carried:
            await resumer(buf, carried, tasks)
        sub = asyncio.ensure_future(submitter(buf, tasks))
        try:
            for v in range(first, last):
                assert buf.version == v
                t0 = loop.time()
                state["trainer_waiting"] = True
                groups = await buf.get_batch()
                state["trainer_waiting"] = False
                res.trainer_wait_s += loop.time() - t0
                if len(groups) != b:
                    violation(f"step {v}: batch of {len(groups)} groups")
                for g in groups:
                    buffered[g.start_version] -= 1
                    in_flight.pop(g.trajectories[0].group_id, None)
                vers = [ver for g in groups for t in g.trajectories for m, ver in zip(t.loss_mask, t.versions) if m]
                res.batches.append(Batch(v, [g.start_version for g in groups], min(vers), max(vers)))
                if max(vers) > v:
                    violation(f"step {v}: a token from the future (version {max(vers)})")
                await asyncio.sleep(cfg.train_s)
                await buf.set_version(v + 1)
        finally:
            res.held_s += buf.held_s
            sub.cancel()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(sub, *tasks, return_exceptions=True)
            state["buf"] = None

    async def main() -> None:
        if cfg.crash_at is not None and cfg.start_at < cfg.crash_at < cfg.steps:
            await segment(cfg.start_at, cfg.crash_at)
            now = loop.time()
            carried = [
                {**c, "left": max(c["end"] - now, 0.0)} for c in sorted(in_flight.values(), key=lambda c: c["i"])
            ]
            await segment(cfg.crash_at, cfg.steps, carried if cfg.resume_in_flight else None)
        else:
            await segment(cfg.start_at, cfg.steps)

    loop.on_idle = audit
    try:
        loop.run_until_complete(main())
        res.sim_s = loop.time()
    finally:  # after a Deadlock or OutOfTime the tasks are still pending: cancel them and let them unwind
        loop.on_idle = None
        pending = asyncio.all_tasks(loop)
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()
    if eta is not None:
        for bt in res.batches:
            if bt.staleness > eta:
                violation(
                    f"step {bt.version}: trained a token {bt.staleness} versions old (eta={eta}); batch "
                    f"start versions {bt.start_versions}"
                )
                break
    return res


def _edf(buffered: dict[int, int], b: int) -> dict[int, int]:
    take: dict[int, int] = {}
    for s in sorted(buffered):
        k = min(b, buffered[s])
        if k:
            take[s] = k
        b -= k
        if b == 0:
            break
    return take

"""The rollout side of the schedule: keep the servers busy within the staleness bound.

Starts a workflow task whenever the buffer admits a group (buffer.acquire_slot), numbers each accepted group by its
draw index, and drops (with the reason, in the ledger) groups that failed, came back empty, aborted, malformed or,
with filtering, with uniform rewards; too many failures in a row close the buffer. docs/design.md, "The schedule",
says why each drop exists and how this loop meets the train loop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from areal_async.rollout.buffer import BufferClosed, Group, StalenessBuffer
from areal_async.rollout.gc_pacer import GCPacer
from areal_async.rollout.journal import GenerationJournal
from areal_async.rollout.journal_client import JournaledGenerator
from areal_async.rollout.ledger import SampleLedger
from areal_async.rollout.samples import Draw, SampleStream
from areal_async.rollout.workflow_api import Generator, Workflow
from areal_async.types import Trajectory

log = logging.getLogger(__name__)


@dataclass
class RolloutStats:
    started: int = 0
    accepted: int = 0
    filtered: int = 0  # dropped by dynamic filtering (all rewards equal)
    rejected: int = 0  # the workflow returned None / nothing
    aborted: int = 0  # a trajectory's generation was aborted
    invalid: int = 0  # a malformed trajectory, or one without a generated token
    failed: int = 0  # the workflow raised
    samples: int = 0  # trajectories accepted
    generated_tokens: int = 0


def invalid_reason(trajs: list[Trajectory]) -> str | None:
    """Why these trajectories cannot be trained (the trainer would reject the whole batch), or None."""
    for i, t in enumerate(trajs):
        n = len(t.input_ids)
        if n < 2 or len(t.loss_mask) != n or len(t.logprobs) != n or len(t.versions) != n:
            return f"trajectory {i}: lengths {n}/{len(t.loss_mask)}/{len(t.logprobs)}/{len(t.versions)}"
        if t.loss_mask[0]:
            return f"trajectory {i}: loss_mask[0] must be 0"
        if not any(t.loss_mask):
            return f"trajectory {i}: no generated token"
    return None


class RolloutManager:
    """Keeps prompt groups running within the buffer's admission rule. `pace_gc` (default on) runs the garbage
    collector from the loop while started (see `GCPacer`); turn it off if the process manages its own collector.
    `ledger` records every draw and drop (an in-memory one by default). `journal`: every group's generations are
    recorded in it, and a group a resume kept continues from its record (journal.py)."""

    def __init__(
        self,
        client: Generator,
        workflow: Workflow,
        stream: SampleStream,
        buffer: StalenessBuffer,
        *,
        filter_uniform_reward: bool = False,
        max_consecutive_failures: int = 50,
        pace_gc: bool = True,
        ledger: SampleLedger | None = None,
        journal: GenerationJournal | None = None,
    ) -> None:
        self.client = client
        self.workflow = workflow
        self.stream = stream
        self.buffer = buffer
        self.filter_uniform_reward = filter_uniform_reward
        self.max_consecutive_failures = max_consecutive_failures
        self.ledger = ledger if ledger is not None else SampleLedger()
        self.journal = journal
        self.stats = RolloutStats()
        self._consecutive_failures = 0
        self._gave_up = False
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.pace_gc = pace_gc
        self._gc = GCPacer() if pace_gc else None
        self._admitting: asyncio.Event | None = None  # cleared: no new group starts (made on the loop, lazily)

    def _admission(self) -> asyncio.Event:
        if self._admitting is None:
            self._admitting = asyncio.Event()
            self._admitting.set()
        return self._admitting

    def hold(self) -> None:
        """Start no new group until `release` (the groups running go on, and one the admission rule has already
        let through still starts). eval.mode=stop holds generation this way for an eval; no slot is taken while
        held, so the staleness accounting is unchanged."""
        self._admission().clear()

    def release(self) -> None:
        self._admission().set()

    def start(self) -> None:
        if self._loop_task is None:
            if self._gc is not None:
                self._gc.start()
            self._loop_task = asyncio.create_task(self._submit_loop(), name="rollout-submit")

    async def _submit_loop(self) -> None:
        try:
            while True:
                await self._admission().wait()
                start_version = await self.buffer.acquire_slot()
                draw = self.stream.draw()
                self.ledger.drawn(draw.index)
                self.stats.started += 1
                task = asyncio.create_task(self._run_group(draw, start_version))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except BufferClosed:
            pass

    def _drop_reason(self, trajs: list[Trajectory] | None) -> str | None:
        if not trajs:
            self.stats.rejected += 1
            return "rejected: the workflow returned no trajectory"
        if any(t.info.get("finish") == "abort" for t in trajs):
            self.stats.aborted += 1
            return "aborted: a generation came back aborted"
        bad = invalid_reason(trajs)
        if bad is not None:
            self.stats.invalid += 1
            return f"invalid: {bad}"
        if self.filter_uniform_reward and len({t.reward for t in trajs}) == 1:
            self.stats.filtered += 1
            return "filtered: every reward equal"
        return None

    def _resumed_client(self, draw: Draw, start_version: int) -> tuple[Generator, int] | None:
        """The client this group generates through, and the version its slot counts under: with a journal, the
        journaled client, booked under the oldest version of the tokens a resume kept for it. None: the kept tokens
        are past the staleness bound now (an eta lowered across the resume): the draw is dropped."""
        if self.journal is None:
            return self.client, start_version
        self.journal.start(draw.index, start_version)
        client = JournaledGenerator(self.client, self.journal, draw.index)
        oldest = client.kept_versions()
        if oldest is None or oldest >= start_version:
            return client, start_version
        try:
            self.buffer.rebook(start_version, oldest)
        except ValueError as e:
            self.journal.forget([draw.index])
            self.ledger.dropped(draw.index, f"stale on resume: {e}")
            return None
        return client, oldest

    async def _run_group(self, draw: Draw, start_version: int) -> None:
        group: Group | None = None
        try:
            chosen = self._resumed_client(draw, start_version)
            if chosen is None:
                self.stats.rejected += 1
                return
            client, start_version = chosen
            try:
                trajs = await self.workflow.run(client, draw.sample)
            except asyncio.CancelledError:
                raise  # a stop: the draw stays outstanding (unfinished, drawn again by a resume)
            except Exception as e:  # a broken workflow or reward loses one group, never the run
                self.stats.failed += 1
                self._forget(draw)
                self.ledger.dropped(draw.index, f"failed: {type(e).__name__}: {e}")
                log.warning("workflow failed on sample %s: %s: %s", draw.sample.id, type(e).__name__, e)
                await self._count_failure(f"{type(e).__name__}: {e}")
                return
            if isinstance(client, JournaledGenerator) and self.journal is not None:
                self.journal.report.drop_tokens("asked for no more by the restarted workflow", client.unused_tokens())
            why = self._drop_reason(trajs)
            if why is not None:
                self._forget(draw)
                self.ledger.dropped(draw.index, why)
                if why.startswith("aborted"):
                    await self._count_failure(why)
                else:
                    self._consecutive_failures = 0
                return
            self._consecutive_failures = 0
            assert trajs is not None
            for t in trajs:
                t.group_id = draw.index
            group = Group(trajs, start_version=start_version, finish_version=self.buffer.version)
            self.stats.accepted += 1
            self.stats.samples += len(trajs)
            self.stats.generated_tokens += sum(t.response_len for t in trajs)
        finally:
            if not self.buffer.closed:
                await self.buffer.finish(group, start_version)

    def _forget(self, draw: Draw) -> None:
        if self.journal is not None:
            self.journal.forget([draw.index])

    async def _count_failure(self, what: str) -> None:
        self._consecutive_failures += 1
        if self._consecutive_failures >= self.max_consecutive_failures and not self._gave_up:
            self._gave_up = True  # the first reason stands: later failures are the same outage
            await self.buffer.close(
                RuntimeError(f"{self._consecutive_failures} prompt groups failed in a row; last error: {what}")
            )

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def stop(self) -> None:
        """Cancel submission and every running group (their servers see client disconnects and abort them)."""
        tasks = [t for t in ([self._loop_task] + list(self._tasks)) if t is not None]
        for t in tasks:
            t.cancel()
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._loop_task = None
            if self._gc is not None:
                self._gc.stop()

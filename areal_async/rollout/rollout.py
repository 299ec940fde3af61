"""The rollout side of the schedule: keep the servers busy, within the staleness bound.

    loop:  wait for buffer.acquire_slot()   (admission rule + concurrency cap; see buffer.py)
           take the next sample, start workflow.run(client, sample) as its own task
    task:  trajectories -> filter (optional: all rewards equal) -> buffer.finish(group or None)

A workflow that raises is logged and rejected; it never kills the run. But when many groups in a row fail (every
server gone, say) the manager closes the buffer with the last error, so the trainer side stops with a clear reason
instead of waiting forever.

While it runs, the manager paces Python's garbage collector from the event loop (`GCPacer`, gc_pacer.py): with thousands
of rollouts in flight the collector's own schedule, not our code, is what stalls the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass

from areal_async.rollout.buffer import BufferClosed, Group, StalenessBuffer
from areal_async.rollout.gc_pacer import GCPacer
from areal_async.rollout.samples import SampleStream
from areal_async.rollout.workflow_api import Generator, Workflow

log = logging.getLogger(__name__)


@dataclass
class RolloutStats:
    started: int = 0
    accepted: int = 0
    filtered: int = 0  # dropped by dynamic filtering (all rewards equal)
    rejected: int = 0  # the workflow returned None / nothing
    failed: int = 0  # the workflow raised
    samples: int = 0  # trajectories accepted
    generated_tokens: int = 0


class RolloutManager:
    """Keeps prompt groups running within the buffer's admission rule. `pace_gc` (default on) runs the garbage
    collector from the loop while started (see `GCPacer`); turn it off if the process manages its own collector."""

    def __init__(self, client: Generator, workflow: Workflow, stream: SampleStream, buffer: StalenessBuffer, *,
                 filter_uniform_reward: bool = False, max_consecutive_failures: int = 50,
                 pace_gc: bool = True) -> None:
        self.client = client
        self.workflow = workflow
        self.stream = stream
        self.buffer = buffer
        self.filter_uniform_reward = filter_uniform_reward
        self.max_consecutive_failures = max_consecutive_failures
        self.stats = RolloutStats()
        self._group_ids = itertools.count()
        self._consecutive_failures = 0
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.pace_gc = pace_gc
        self._gc = GCPacer() if pace_gc else None

    def start(self) -> None:
        if self._loop_task is None:
            if self._gc is not None:
                self._gc.start()
            self._loop_task = asyncio.create_task(self._submit_loop(), name="rollout-submit")

    async def _submit_loop(self) -> None:
        try:
            while True:
                start_version = await self.buffer.acquire_slot()
                sample = self.stream.next()
                self.stats.started += 1
                task = asyncio.create_task(self._run_group(sample, start_version))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except BufferClosed:
            pass

    async def _run_group(self, sample, start_version: int) -> None:
        group: Group | None = None
        try:
            trajs = await self.workflow.run(self.client, sample)
            self._consecutive_failures = 0
            if not trajs:
                self.stats.rejected += 1
            elif self.filter_uniform_reward and len({t.reward for t in trajs}) == 1:
                self.stats.filtered += 1
            else:
                gid = next(self._group_ids)
                for t in trajs:
                    t.group_id = gid
                group = Group(trajs, start_version=start_version, finish_version=self.buffer.version)
                self.stats.accepted += 1
                self.stats.samples += len(trajs)
                self.stats.generated_tokens += sum(t.response_len for t in trajs)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a broken workflow or reward loses one group, never the run
            self.stats.failed += 1
            self._consecutive_failures += 1
            log.warning("workflow failed on sample %s: %s: %s", getattr(sample, "id", "?"), type(e).__name__, e)
            if self._consecutive_failures >= self.max_consecutive_failures:
                await self.buffer.close(RuntimeError(
                    f"{self._consecutive_failures} prompt groups failed in a row; last error: {type(e).__name__}: {e}"))
        finally:
            if not self.buffer.closed:
                await self.buffer.finish(group, start_version)

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


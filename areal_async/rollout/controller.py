"""The asynchronous RL schedule, on one asyncio event loop.

Two loops share a StalenessBuffer (buffer.py):

    rollout loop (RolloutManager, manager.py)       train loop (AsyncRLController.run, below)
    ------------------------------------------      -------------------------------------------------------
    wait: admission rule allows a group             wait: a batch the staleness rule allows (buffer.get_batch)
    draw a sample, run the workflow as a task       trainer.train_step(trajectories, v)      (RPC to all ranks)
    group done -> buffer.finish(group)              weights of v + 1 onto the servers (weight_sync.py):
      (or a drop, with its reason, in the ledger)     disk: publish an HF checkpoint, then load it
                                                      broadcast: torch.distributed from trainer rank 0
                                                      in flight: abort and resume / keep going in place / wait
                                                    v += 1 -> buffer.set_version(v); a line in trained_index.jsonl
                                                    every k steps: checkpoint, and a held-out eval that runs
                                                      beside the next train step (started once that step has its
                                                      batch; its weight sync waits for the eval)

Modes come from the same code: async (eta >= 1 or unbounded), sync (eta = 0: after B groups start, nothing else
starts until the weights of v + 1 are live, so rollout generation never overlaps training; held-out evals do, as in
every mode), and the three treatments of requests in flight at a weight update (`schedule.interruptible`,
`schedule.interrupt_mode`; see weight_sync.py).

Every draw is accounted for (ledger.py): trained, dropped with a reason, or unfinished at a stop. A checkpoint holds
the next fresh draw index and the draws it has not seen resolved; a resume draws those again, exactly once. The
checkpoint files, and rewinding a run directory to one, are checkpoints.py's; what a failure does: docs/recovery.md;
the weight transports: docs/weights.md.

Embedding: build an `InferenceClient` over your servers, a trainer (anything with the `Trainer` protocol; the
torchrun workers are reached through `areal_async.train.client.TrainerGroup`), a workflow, a `ScheduleConfig` and
a `SampleStream`, then `await AsyncRLController(...).run()`. Or drive `RolloutManager` + `StalenessBuffer` yourself
and consume batches with `buffer.get_batch()`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from areal_async.config import ScheduleConfig
from areal_async.rollout.buffer import StalenessBuffer

# the state on disk lives in checkpoints.py; its names stay importable from here (session/prepare.py, embedders)
from areal_async.rollout.checkpoints import (
    RunState,
    checkpoint_dir,
    discard_after,
    load_state,
    prune_checkpoints,
    rollback_target,
    save_state,
)
from areal_async.rollout.journal import GenerationJournal
from areal_async.rollout.ledger import SampleLedger
from areal_async.rollout.manager import RolloutManager
from areal_async.rollout.samples import SampleStream
from areal_async.rollout.weight_sync import DiskSync, WeightSync, interrupt_mode, update_weights
from areal_async.rollout.workflow_api import Generator, Workflow
from areal_async.types import CheckpointResult, PublishResult, TrainStepResult, Trajectory

log = logging.getLogger(__name__)

__all__ = [
    "AsyncRLController",
    "RunState",
    "ScheduleConfig",
    "Trainer",
    "InferenceAdmin",
    "discard_after",
    "load_state",
    "prune_checkpoints",
    "rollback_target",
    "save_state",
]


class Trainer(Protocol):
    async def train_step(self, trajectories: list[Trajectory], policy_version: int) -> TrainStepResult: ...

    async def publish(self, version: int, root: str, keep: int = 2) -> PublishResult: ...

    async def save_checkpoint(self, path: str) -> CheckpointResult: ...


class InferenceAdmin(Generator, Protocol):
    async def pause(self, mode: str = "abort") -> Any: ...

    async def resume(self) -> Any: ...

    async def update_weights_from_disk(self, path: str, version: int, *, flush_cache: bool = True) -> Any: ...


Evaluator = Callable[[], Awaitable[dict[str, float]]]


class AsyncRLController:
    def __init__(
        self,
        schedule: ScheduleConfig,
        client: InferenceAdmin,
        trainer: Trainer,
        workflow: Workflow,
        stream: SampleStream,
        run_dir: str,
        *,
        weights: WeightSync | None = None,
        evaluator: Evaluator | None = None,
        logger: Any = None,
        state: RunState | None = None,
        ledger: SampleLedger | None = None,
        busy_probe: Callable[[], Awaitable[float | None]] | None = None,
        keep_checkpoints: int = 0,
        checkpointed: bool = False,
        pace_gc: bool = True,
        journal: bool = False,
        eval_mode: str = "overlap",
        pinned_evals: Any = None,
    ) -> None:
        """`weights` defaults to disk sync under `run_dir/weights`; `ledger` to one without a file (the run passes
        one that writes trained_index.jsonl); `busy_probe` reads the servers' cumulative compute seconds.
        `keep_checkpoints`: complete checkpoints kept (0: all); `checkpointed`: `state` is what the checkpoint at
        its version holds (a resume or a rollback), so saving again at that version rewrites only our state.
        `pace_gc`: the rollout manager paces the garbage collector (off for a process that manages its own, such
        as the planner's virtual-time runs, where a pacer waking every 50 ms of virtual time would dominate).
        `journal`: keep a generation journal in `run_dir/journal` (rollout/journal.py) and the groups in flight in
        every checkpoint; with `checkpointed`, the groups the checkpoint left in flight continue from their tokens.
        `eval_mode` (eval.mode): what the periodic evals hold up (docs/design.md, "Evaluation"). "pinned" runs
        them through `pinned_evals` (a pinned_eval.PinnedEvals, typed Any: the planner imports this module and
        must not reach the inference client it holds), the base and final ones through `evaluator` as always."""
        schedule.validate("schedule")
        if eval_mode not in ("overlap", "stop", "pinned"):
            raise ValueError(f"eval_mode must be overlap, stop or pinned, not {eval_mode!r}")
        if eval_mode == "pinned" and pinned_evals is None:
            raise ValueError("eval_mode=pinned needs pinned_evals")
        self.eval_mode = eval_mode
        self.pinned_evals = pinned_evals
        if pinned_evals is not None:
            pinned_evals.on_result = self._pinned_result
        self.cfg = schedule
        self.client = client
        self.trainer = trainer
        self.workflow = workflow
        self.stream = stream
        self.run_dir = run_dir
        self.weights = weights if weights is not None else DiskSync(trainer, client, os.path.join(run_dir, "weights"))
        self.evaluator = evaluator
        self.logger = logger
        self.state = state or RunState()
        self.ledger = ledger if ledger is not None else SampleLedger()
        self.busy_probe = busy_probe
        self.buffer = StalenessBuffer(schedule.batch_size, schedule.effective_eta, schedule.max_concurrent_groups)
        self.buffer.restore(self.state.version)
        self.stream.seek(self.state.data_position)
        self.stream.redraw(self.state.pending)
        self.journal: GenerationJournal | None = None
        if journal and schedule.checkpoint_every:
            self.journal = GenerationJournal(run_dir, self.state.version, resume=checkpointed)
            if checkpointed:
                _log_resume(self.journal)
        self.rollout = RolloutManager(
            client,
            workflow,
            stream,
            self.buffer,
            filter_uniform_reward=schedule.filter_uniform_reward,
            max_consecutive_failures=schedule.max_consecutive_failures,
            pace_gc=pace_gc,
            ledger=self.ledger,
            journal=self.journal,
        )
        self.interrupt = interrupt_mode(schedule.interruptible, schedule.interrupt_mode)
        # eval_s: every eval's own duration; eval_wait_s: how long the train loop waited for a periodic eval
        self.timings = {
            "wait_batch_s": 0.0,
            "train_s": 0.0,
            "publish_s": 0.0,
            "weight_load_s": 0.0,
            "eval_s": 0.0,
            "eval_wait_s": 0.0,
            "checkpoint_trainer_s": 0.0,
            "checkpoint_controller_s": 0.0,
            "checkpoint_prune_s": 0.0,
            "checkpoints": 0,
        }
        self.evals: list[dict[str, float]] = []
        self._eval_due = False  # a periodic eval waits for the next batch, then runs beside that train step
        self._eval_task: asyncio.Task | None = None
        self.keep_checkpoints = keep_checkpoints
        self._saved_version: int | None = self.state.version if checkpointed else None

    # ---- the schedule -------------------------------------------------------------------------------------------

    async def run(self) -> RunState:
        st = self.state
        if st.base_accuracy is None and self.evaluator is not None:
            ev = await self._evaluate()
            st.base_accuracy = ev["accuracy"]
        busy0 = await self.busy_probe() if self.busy_probe else None
        t_start = _now() - st.wall_s
        self.rollout.start()
        try:
            while st.version < self.cfg.total_steps:
                if self.cfg.max_wall_s is not None and _now() - t_start >= self.cfg.max_wall_s:
                    log.info("max_wall_s reached at version %d", st.version)
                    break
                await self._train_one_step(t_start)
                st.wall_s = _now() - t_start
                if (
                    self.evaluator is not None
                    and self.cfg.eval_every
                    and st.version % self.cfg.eval_every == 0
                    and st.version < self.cfg.total_steps
                ):
                    await self._periodic_eval()
                if self.cfg.checkpoint_every and st.version % self.cfg.checkpoint_every == 0:
                    await self.save_checkpoint()
            await self._join_eval()
            self._eval_due = False  # a max_wall_s stop: the final eval below covers this version
            if self.pinned_evals is not None:
                await self.pinned_evals.drain()  # their figures belong before the final one
        finally:
            if self.pinned_evals is not None:
                await self.pinned_evals.close()
            if self._eval_task is not None and not self._eval_task.done():
                self._eval_task.cancel()
            await asyncio.gather(*(t for t in [self._eval_task] if t is not None), return_exceptions=True)
            self._eval_task = None
            await self.rollout.stop()
            await self.buffer.close()
        st.wall_s = _now() - t_start
        busy1 = await self.busy_probe() if self.busy_probe else None
        if busy0 is not None and busy1 is not None:
            self.timings["server_busy_s"] = busy1 - busy0
        if self.evaluator is not None:
            await self._evaluate()
        return st

    async def _train_one_step(self, t_start: float) -> None:
        st = self.state
        v = st.version
        t0 = _now()
        groups = await self.buffer.get_batch()
        t1 = _now()
        if self._eval_due:
            # now, not right after the last step: in sync mode the servers are idle from here until the weight sync,
            # so the eval costs no time; started earlier it would compete with the rollouts the trainer waits for
            self._eval_due = False
            self._eval_task = asyncio.create_task(self._evaluate(), name=f"eval-v{v}")
        trajs = [t for g in groups for t in g.trajectories]
        staleness = self._record_staleness(trajs, v)
        result = await self.trainer.train_step(trajs, v)
        t2 = _now()
        eval_wait = await self._join_eval()
        await self._sync_weights(v + 1)
        t3 = _now()
        st.version = v + 1
        st.trained_samples += len(trajs)
        st.trained_groups += len(groups)
        # the draw index of each group (manager.py numbers every group's trajectories with it)
        self.ledger.trained(st.version, [g.trajectories[0].group_id for g in groups])
        if self.journal is not None:
            self.journal.forget([g.trajectories[0].group_id for g in groups])
        await self.buffer.set_version(st.version)
        self.timings["wait_batch_s"] += t1 - t0
        self.timings["train_s"] += t2 - t1
        rewards = [t.reward for t in trajs]
        stats = self.rollout.stats
        record = {
            "version": st.version,
            "wall_s": _now() - t_start,
            "reward_mean": sum(rewards) / len(rewards),
            "response_len_mean": sum(t.response_len for t in trajs) / len(trajs),
            "staleness_mean": staleness[0],
            "staleness_max": staleness[1],
            "interrupted_frac": sum(1 for t in trajs if t.info.get("interruptions", 0)) / len(trajs),
            "multi_version_frac": sum(1 for t in trajs if _spans_versions(t)) / len(trajs),
            "wait_batch_s": t1 - t0,
            "train_step_s": t2 - t1,
            "weight_sync_s": t3 - t2 - eval_wait,
            "eval_wait_s": eval_wait,
            "trained_samples": st.trained_samples,
            "samples_per_s": st.trained_samples / max(_now() - t_start, 1e-9),
            "buffer_groups": len(self.buffer),
            "running_groups": self.buffer.running,
            # how long, in total, B groups were ready but the staleness rule held the batch for an older one
            "staleness_held_s": self.buffer.held_s,
            "rollout_failed": stats.failed,
            "rollout_filtered": stats.filtered,
            "rollout_rejected": stats.rejected,
            "rollout_aborted": stats.aborted,
            "rollout_invalid": stats.invalid,
            **{f"train/{k}": v for k, v in result.stats.items()},
            # totals of the weight transport: full and delta updates, bytes, policy-identity checks and mismatches
            **{f"weights/{k}": v for k, v in getattr(self.weights, "stats", {}).items()},
        }
        self._log("train", st.version, record)

    async def _sync_weights(self, version: int) -> None:
        """Make every server serve the trainer's weights as `version` (transport and in-flight treatment: see
        weight_sync.py). The prepare step (disk: publishing the checkpoint) overlaps generation."""
        t0 = _now()
        await self.weights.prepare(version)
        t1 = _now()
        await update_weights(self.weights, self.client, version, self.interrupt)
        self.timings["publish_s"] += t1 - t0
        self.timings["weight_load_s"] += _now() - t1

    async def publish_final(self) -> str | None:
        """An HF checkpoint of the current weights (already there with disk sync; written now with broadcast)."""
        if self.weights.latest_checkpoint is None and self.state.version > 0:
            pub = await self.trainer.publish(self.state.version, os.path.join(self.run_dir, "weights"))
            return pub.path
        return self.weights.latest_checkpoint

    async def _periodic_eval(self) -> None:
        """A periodic eval of the version just made, as eval.mode says. overlap: due, started by the next step
        once it has its batch (see _train_one_step); stop: now, with the train loop and new rollouts waiting;
        pinned: a snapshot now and the eval on its own server (pinned_eval.py), nothing waits."""
        if self.eval_mode == "overlap":
            self._eval_due = True
        elif self.eval_mode == "stop":
            t0 = _now()
            self.rollout.hold()
            try:
                await self._evaluate()
            finally:
                self.rollout.release()
            self.timings["eval_wait_s"] += _now() - t0
        else:
            assert self.pinned_evals is not None
            t0 = _now()
            await self.pinned_evals.submit(self.state.version, self.state.wall_s)
            self.timings["eval_wait_s"] += _now() - t0  # the snapshot: the train loop's whole share of it

    def _pinned_result(self, version: int, wall_s: float, ev: dict[str, float]) -> None:
        """A pinned eval's figures, attributed to exactly `version` (pinned_eval.py checked every token)."""
        self.timings["eval_s"] += ev.get("seconds", 0.0)
        ev = {**ev, "version": version, "wall_s": wall_s}
        self.evals.append(ev)
        self._log("eval", version, ev)

    async def _join_eval(self) -> float:
        """Wait for a periodic eval still running (it must finish on the weights it started with, so the next weight
        sync waits for it); returns the seconds waited. Its failure fails the run, as an inline eval would."""
        task, self._eval_task = self._eval_task, None
        if task is None:
            return 0.0
        t0 = _now()
        await task
        waited = _now() - t0
        self.timings["eval_wait_s"] += waited
        return waited

    async def _evaluate(self) -> dict[str, float]:
        """Held-out eval of the weights the servers hold now. Periodic evals run as a task beside the next train
        step: in sync mode the servers are idle while the trainer works, in async mode the eval shares them with the
        rollouts; either way the trainer no longer stops for it."""
        assert self.evaluator is not None
        version, wall_s = self.state.version, self.state.wall_s
        t0 = _now()
        ev = await self.evaluator()
        self.timings["eval_s"] += _now() - t0
        ev = {**ev, "version": version, "wall_s": wall_s}
        self.evals.append(ev)
        self._log("eval", version, ev)
        return ev

    # ---- bookkeeping --------------------------------------------------------------------------------------------

    def _record_staleness(self, trajs: list[Trajectory], v: int) -> tuple[float, int]:
        """Staleness of a token = v - the version that produced it; returns (mean, max) over response tokens."""
        total = count = worst = 0
        hist = self.state.staleness_hist
        for t in trajs:
            for m, ver in zip(t.loss_mask, t.versions):
                if m:
                    s = v - ver
                    total += s
                    count += 1
                    worst = max(worst, s)
                    hist[str(s)] = hist.get(str(s), 0) + 1
        self.state.max_staleness_seen = max(self.state.max_staleness_seen, worst)
        return (total / count if count else 0.0), worst

    def _log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log(kind, step, values)
        if kind == "train":
            log.info(
                "step %d  reward %.3f  len %.1f  staleness %.2f/%d  samples/s %.1f  wait %.2fs  train %.2fs  "
                "sync %.2fs",
                step,
                values["reward_mean"],
                values["response_len_mean"],
                values["staleness_mean"],
                values["staleness_max"],
                values["samples_per_s"],
                values["wait_batch_s"],
                values["train_step_s"],
                values["weight_sync_s"],
            )
        else:
            log.info("eval @ version %d: accuracy %.1f%%  (%.1fs)", step, 100 * values["accuracy"], values["seconds"])

    async def save_checkpoint(self) -> str:
        """Trainer state through the trainer's own checkpoint, then the controller state beside it (atomically): the
        version, the next fresh draw and the draws not yet resolved in trained_index.jsonl. Then older checkpoints
        beyond `keep_checkpoints` go.

        Atomic as a whole: `latest.json` moves to the new checkpoint only once both parts are on disk, so a kill at
        any moment leaves the previous one usable. A second save at the same version (the last step's periodic
        save and the final one) does not write the trainer part again: rewriting a complete trainer checkpoint in
        place is the one step that could leave the latest checkpoint without it."""
        st = self.state
        path = checkpoint_dir(self.run_dir, st.version)
        trainer_dir = os.path.join(path, "trainer")
        t0 = _now()
        if self._saved_version != st.version or not os.path.isdir(trainer_dir):
            await self.trainer.save_checkpoint(trainer_dir)
        t1 = _now()
        st.data_position = self.stream.position
        # redraws queued by a resume and not handed out yet are unresolved too
        st.pending = sorted(set(self.ledger.pending()) | set(self.stream.pending_redraws))
        if self.journal is not None:  # the groups in flight, written before latest.json moves to this checkpoint
            self.journal.checkpoint(path, st.version, st.pending)
        save_state(self.run_dir, st, path)
        if self.journal is not None:  # no await since the snapshot: the new journal file starts where it ends
            self.journal.rotate(st.version)
        self._saved_version = st.version
        t2 = _now()
        prune_checkpoints(self.run_dir, self.keep_checkpoints)
        # the trainer's part (model + optimizer), ours (the state and the groups in flight) and the pruning of
        # older checkpoints, apart: the train loop waits for all three, and only ours grows with the work in flight
        t3 = _now()
        self.timings["checkpoint_trainer_s"] += t1 - t0
        self.timings["checkpoint_controller_s"] += t2 - t1
        self.timings["checkpoint_prune_s"] += t3 - t2
        self.timings["checkpoints"] += 1
        log.info(
            "checkpoint v%d: trainer %.2fs, controller %.3fs (%d groups in flight), pruning %.2fs",
            st.version,
            t1 - t0,
            t2 - t1,
            self.buffer.running,
            t3 - t2,
        )
        return path

    async def request_stop(self, reason: BaseException) -> None:
        """Stop after the step in progress (whose batch the trainer may already hold): the next wait for a batch
        raises `reason`, so the trainer's version and the controller's agree and a checkpoint can follow."""
        await self.buffer.close(reason)

    def finish(self, *, completed: bool) -> None:
        """Close the ledger; after a normal stop (`completed`) its end line names what was left unfinished (redraws
        of a resume that were never handed out again included)."""
        self.ledger.close(finished=completed, undrawn=self.stream.pending_redraws)
        if self.journal is not None:
            self.journal.close()


def _log_resume(journal: GenerationJournal) -> None:
    rep = journal.report
    log.info(
        "resume at version %d: %d groups in flight continue from the journal (%d calls, %d tokens kept); "
        "tokens not kept: %s; calls in flight at the stop: %d (their last segment's tokens never came back)",
        rep.version,
        rep.groups,
        rep.calls_kept,
        rep.tokens_kept,
        rep.tokens_dropped or "none",
        rep.calls_in_flight,
    )
    journal.write_report()


def _now() -> float:
    """The event loop's clock (the buffer's too): time.monotonic() in a live run, virtual time in the planner's."""
    return asyncio.get_running_loop().time()


def _spans_versions(t: Trajectory) -> bool:
    seen = {ver for m, ver in zip(t.loss_mask, t.versions) if m}
    return len(seen) > 1

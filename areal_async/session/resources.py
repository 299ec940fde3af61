"""What a run holds open (`Session`): closed at teardown, read by the fleet handler (`client`) and the recovery
policy, and handed to the rollback (rollback.py) that replaces its trainers, controller and metrics writer.

Apart from run.py so that run.py and rollback.py both import it from below, instead of one another.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from areal_async.inference.client import InferenceClient
from areal_async.launch import RecoveryLog, RunRecovery
from areal_async.launch.eval_server import EvalServerProcess
from areal_async.metrics import MetricsLogger
from areal_async.rollout.controller import AsyncRLController
from areal_async.rollout.pinned_eval import PinnedEvals
from areal_async.train.client import TrainerGroup

if TYPE_CHECKING:
    from areal_async.rewards.runner import RewardRunner

__all__ = ["Session"]


@dataclass
class Session:
    """What a run holds open, for teardown, the fleet handler (it reads `client`) and the recovery policy."""

    rewards: RewardRunner | None
    logger: MetricsLogger | None = None
    client: InferenceClient | None = None
    trainers: TrainerGroup | None = None
    controller: AsyncRLController | None = None
    recovery: RunRecovery | None = None  # the recovery policy, when recovery.enabled (run() keeps failure_policy's)
    recovery_log: RecoveryLog | None = None  # every fault and what was done
    trainers_stopped: bool = False  # every rank took the shutdown RPC: the trainer job is exiting by itself
    pinned_evals: PinnedEvals | None = None  # eval.mode=pinned
    eval_server: EvalServerProcess | None = None  # the server eval.mode=pinned started (no eval.server_url)

    def log_metrics(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if self.logger is not None:
            self.logger.log(kind, step, values)

    async def close(self) -> None:
        """Close what is open, trainers first (they exit on request); each part once."""
        ctrl, trainers, client, rewards, logger = (
            self.controller,
            self.trainers,
            self.client,
            self.rewards,
            self.logger,
        )
        self.controller = self.trainers = self.client = self.rewards = self.logger = None
        if self.recovery is not None:
            await self.recovery.close()
        if ctrl is not None:
            ctrl.finish(completed=False)  # closes the ledger file (its end line was written by a normal finish)
        if trainers is not None:
            with contextlib.suppress(Exception):
                busy = getattr(trainers, "abandoned", None) is not None  # then shutdown only closes connections
                await asyncio.wait_for(trainers.shutdown(), 30)
                self.trainers_stopped = not busy
        for part in (client, rewards):
            if part is not None:
                with contextlib.suppress(Exception):
                    await part.close()
        if logger is not None:
            logger.close()
        pinned, self.pinned_evals = self.pinned_evals, None
        if pinned is not None:
            with contextlib.suppress(Exception):
                await pinned.close()
        server, self.eval_server = self.eval_server, None
        if server is not None:
            await asyncio.to_thread(server.stop)

"""How a run's training segment can end other than by finishing: the exceptions the recovery policy
(launch/recovery.py), the weight broadcast (rollout/broadcast_sync.py) and run.py raise and catch. What each leads
to is in docs/recovery.md. Imports nothing from the package, so any layer may raise them. No torch here.

Here, in the controller's package, because the weight broadcast raises them and the launchers above it catch them
(nothing below may import launch/); launch/outcomes.py re-exports them under their first path.
"""

from __future__ import annotations

__all__ = ["NoServerServing", "RunStopped", "TrainerLost"]


class TrainerLost(RuntimeError):
    """The trainer job failed (a rank died or an RPC to it broke); the run rolls back to its last checkpoint.
    `pid`: the job's process when its exit is what was seen (a later job's guard ignores it)."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class NoServerServing(RuntimeError):
    """No inference server has been serving for `recovery.no_server_timeout_s`. `stopped_cleanly`: the training
    loop ended on its own after the step in progress (so the trainer and controller agree on the version and a
    checkpoint can be saved), rather than being cancelled."""

    stopped_cleanly = False


class RunStopped(RuntimeError):
    """The run gave up (retries spent, no server left); the message says which checkpoint resumes it."""

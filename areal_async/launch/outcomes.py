"""The run's outcome exceptions under their first path: they live in rollout/outcomes.py, below both the controller
that raises them and the launchers that catch them."""

from __future__ import annotations

from areal_async.rollout.outcomes import NoServerServing, RunStopped, TrainerLost

__all__ = ["NoServerServing", "RunStopped", "TrainerLost"]

"""Embedding areal_async in your own program (docs/embedding.md): the public names, kept at their first path.

They live in `areal_async.session.embed`, beside the run they drive; this module re-exports every one of them, so
`from areal_async import embed` and `from areal_async.embed import train` keep working.
"""

from __future__ import annotations

from areal_async.session.embed import (
    AgentContext,
    AgentFn,
    CheckerEnv,
    Env,
    EnvFactory,
    ExportMode,
    GenerationResult,
    Generator,
    GroupCallback,
    Observation,
    RewardLike,
    RunResult,
    Sample,
    SamplingParams,
    ScoreFn,
    Trajectory,
    Workflow,
    WorkflowFactory,
    agent_workflow,
    atrain,
    env_workflow,
    reward_fn,
    rollout_sampling,
    train,
    trajectory_from_generation,
)

__all__ = [
    "AgentContext",
    "AgentFn",
    "CheckerEnv",
    "Env",
    "EnvFactory",
    "ExportMode",
    "GenerationResult",
    "Generator",
    "GroupCallback",
    "Observation",
    "RewardLike",
    "RunResult",
    "Sample",
    "SamplingParams",
    "ScoreFn",
    "Trajectory",
    "Workflow",
    "WorkflowFactory",
    "agent_workflow",
    "atrain",
    "env_workflow",
    "reward_fn",
    "rollout_sampling",
    "train",
    "trajectory_from_generation",
]

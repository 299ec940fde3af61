"""areal_async: fully asynchronous reinforcement learning for LLM reasoning.

The package is split so that the controller side (rollout/, inference/client.py, rewards/, types, config, rpc)
never imports torch; only the inference server and the trainers do.

Embedding it in your own program: `areal_async.embed` (docs/embedding.md). Its main names are re-exported here
lazily, so `import areal_async` itself stays cheap and starts nothing: `areal_async.train(...)`,
`areal_async.env_workflow(...)`, `areal_async.agent_workflow(...)`, `areal_async.reward_fn(...)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EMBED = (
    "AgentContext",
    "Env",
    "RunResult",
    "Sample",
    "Trajectory",
    "Workflow",
    "agent_workflow",
    "atrain",
    "env_workflow",
    "reward_fn",
    "train",
)
__all__ = ["__version__", "embed", *_EMBED]

if TYPE_CHECKING:
    from areal_async import embed
    from areal_async.embed import (
        AgentContext,
        Env,
        RunResult,
        Sample,
        Trajectory,
        Workflow,
        agent_workflow,
        atrain,
        env_workflow,
        reward_fn,
        train,
    )


def __getattr__(name: str) -> Any:
    """Import areal_async.embed on first use of one of its names (module attribute hook, PEP 562)."""
    if name in _EMBED or name == "embed":
        import importlib

        mod = importlib.import_module("areal_async.embed")
        return mod if name == "embed" else getattr(mod, name)
    raise AttributeError(f"module 'areal_async' has no attribute {name!r}")

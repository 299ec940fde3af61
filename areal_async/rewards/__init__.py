"""Verifiable rewards: math (math-verify), code (sandboxed execution), and the registry and process-pool runner
that score them off the event loop. Importing this package is cheap: the math and code modules load on first use.
"""

from areal_async.rewards.registry import RewardEntry, call_reward, load, names, register, resolve
from areal_async.rewards.runner import RewardRunner, RewardStats

__all__ = ["RewardEntry", "RewardRunner", "RewardStats", "call_reward", "load", "names", "register", "resolve"]

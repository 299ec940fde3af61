"""areal_async: fully asynchronous reinforcement learning for LLM reasoning.

The package is split so that the controller side (rollout/, inference/client.py, rewards/, types, config, rpc)
never imports torch; only the inference server and the trainers do.
"""

__version__ = "0.1.0"

"""Trainer side: torchrun workers (FSDP2) and the pure pieces they are built from.

losses.py (decoupled PPO, KL, entropy), advantages.py (reward shaping, group baselines), packing.py (dynamic
micro-batching and rank balancing; torch-free, the controller uses it too) and logprobs.py (packed forward to
per-token logprobs) are pure functions with no process or device state; worker.py and its helpers own the rest.
Importing the package does no work.
"""

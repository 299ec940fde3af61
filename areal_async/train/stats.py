"""A train step's statistics: scalar sums gathered during the step, reduced across ranks once, then summarised.

The loss owns its keys and their summary (train/losses.py `LOSS_STAT_KEYS`, `summarize_loss_stats`); this module
owns the step's own (rewards, advantages, staleness, token counts, timings) and the reduction. Convention: keys
ending in `_max` reduce with MAX, all others with SUM. The key set is fixed up front: every rank must reduce the
same vector, also a rank whose shard is empty and never computed a loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from areal_async.config import LossConfig
from areal_async.train.losses import LOSS_STAT_KEYS, summarize_loss_stats

__all__ = ["StatSums", "StepResult", "STEP_STAT_KEYS", "summarize_step"]

STEP_STAT_KEYS = (
    "loss_sum",
    "response_tokens",
    "tokens",
    "reward_sum",
    "shaped_reward_sum",
    "adv_abs_sum",
    "staleness_sum",
    "staleness_max",
    "nonfinite_inputs",
    "step_seconds_max",
    "prox_seconds_max",
)


class StatSums:
    """Scalar accumulators on the device (no host sync per add), reduced across ranks in two all-reduces."""

    def __init__(self, device: torch.device, keys: tuple[str, ...] = STEP_STAT_KEYS + LOSS_STAT_KEYS) -> None:
        self.device = device
        self.values: dict[str, Tensor] = {
            k: torch.tensor(float("-inf") if k.endswith("_max") else 0.0, dtype=torch.float64, device=device)
            for k in keys
        }

    def add(self, key: str, value: Tensor | float) -> None:
        if key not in self.values:
            raise KeyError(f"unknown stat {key!r}: every rank must reduce the same keys (declare it up front)")
        v = torch.as_tensor(value, dtype=torch.float64, device=self.device).detach().reshape(())
        if key.endswith("_max"):
            self.values[key] = torch.maximum(self.values[key], v)
        else:
            self.values[key] = self.values[key] + v

    def add_all(self, stats: dict[str, Tensor]) -> None:
        for k, v in stats.items():
            self.add(k, v)

    def reduce(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for is_max in (False, True):
            keys = sorted(k for k in self.values if k.endswith("_max") == is_max)
            if not keys:
                continue
            t = torch.stack([self.values[k] for k in keys])
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM)
            out.update(zip(keys, t.tolist()))
        return out


@dataclass
class StepResult:
    """What the optimizer loop of a step reports besides the stat sums (same on every rank)."""

    minibatches: int = 0  # minibatches that had trainable tokens (each one an optimizer step, or a skipped one)
    grad_norms: list[float] = field(default_factory=list)  # per minibatch, before clipping
    skipped: int = 0  # optimizer steps skipped for a non-finite gradient norm
    lr: float = 0.0  # the learning rate this step used
    timings: dict[str, float] = field(default_factory=dict)  # host seconds: forward, backward, optimizer


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def summarize_step(
    r: dict[str, float], result: StepResult, loss_cfg: LossConfig, *, num_seqs: float, saved_tokens: float
) -> dict[str, float]:
    """The step's reported figures from the reduced sums `r` (see the module docstring)."""
    resp = r["response_tokens"]
    finite = [g for g in result.grad_norms if math.isfinite(g)]
    out = {
        "loss": r["loss_sum"] / max(result.minibatches, 1),
        **summarize_loss_stats(r, loss_cfg, response_tokens=resp),
        "grad_norm": float(np.mean(result.grad_norms)) if result.grad_norms else 0.0,
        "grad_norm_max": max(finite) if finite else 0.0,
        "skipped_steps": float(result.skipped),
        "optimizer_steps": float(len(result.grad_norms) - result.skipped),
        "staleness_mean": _ratio(r["staleness_sum"], resp),
        "staleness_max": max(r["staleness_max"], 0.0),
        "reward_mean": _ratio(r["reward_sum"], num_seqs),
        "shaped_reward_mean": _ratio(r["shaped_reward_sum"], num_seqs),
        "adv_abs_mean": _ratio(r["adv_abs_sum"], num_seqs),
        "response_len_mean": _ratio(resp, num_seqs),
        "num_seqs": num_seqs,
        "tokens": r["tokens"],
        "shared_prefix_tokens": saved_tokens,  # tokens of repeated prompts the model did not run again
        "response_tokens": resp,
        "nonfinite_inputs": r["nonfinite_inputs"],
        "lr": float(result.lr),
        "step_seconds": r["step_seconds_max"],
        "prox_seconds": r["prox_seconds_max"],
        "tokens_per_s": _ratio(r["tokens"], r["step_seconds_max"]),
    }
    return out

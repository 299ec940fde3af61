"""Rewards to advantages: shaping, group-relative baselines, optional batch normalisation. Pure torch, per sequence.

No critic: the baseline of a sample is the other samples of its prompt group (GRPO family), gamma = lambda = 1,
so one scalar advantage per sequence is broadcast to all of its trained tokens by the caller.
Groups are never split across trainer ranks, so everything here is rank-local except the batch normalisation,
whose mean/std the worker may all-reduce: `normalization_moments` + `mean_std_from_moments` +
`batch_normalize_with`. Statistics are computed in float64 (rewards are few; precision is free) and returned in the
input's floating dtype.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from areal_async.config import AdvantageConfig

__all__ = ["shape_rewards", "group_advantages", "batch_normalize", "batch_normalize_with",
           "normalization_moments", "mean_std_from_moments", "compute_advantages"]

Estimator = Literal["grpo", "drgrpo", "rloo"]


def _as_float(x: Tensor | list, name: str) -> Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(f"{name} must be a flat [B] tensor, got shape {tuple(t.shape)}")
    return t if t.is_floating_point() else t.float()


def shape_rewards(rewards: Tensor, cfg: AdvantageConfig, response_lens: Tensor | None = None) -> Tensor:
    """r' = clip((r + bias) * scale, -clip, clip), then DAPO's soft overlong penalty. [B] -> [B].

    The penalty (when `cfg.overlong_max_len` = L_max is set, L_cache = `cfg.overlong_cache_len`) is added after the
    clip: for a response longer than L_max - L_cache, r' += -(len - (L_max - L_cache)) / L_cache * factor, a ramp
    from 0 to -factor across the cache window. As in DAPO the penalty bottoms out at -factor (a response beyond
    L_max was truncated; it is not worse the further it would have gone). L_cache = 0 is a hard -factor beyond L_max.
    """
    r = _as_float(rewards, "rewards")
    out = ((r.double() + cfg.reward_bias) * cfg.reward_scale).clamp(-cfg.reward_clip, cfg.reward_clip)
    if cfg.overlong_max_len is not None:
        if response_lens is None:
            raise ValueError("overlong_max_len is set: shape_rewards needs response_lens")
        lens = torch.as_tensor(response_lens, device=r.device).double()
        if lens.shape != r.shape:
            raise ValueError(f"response_lens shape {tuple(lens.shape)} != rewards shape {tuple(r.shape)}")
        l_max, l_cache, factor = cfg.overlong_max_len, cfg.overlong_cache_len, cfg.overlong_factor
        if l_cache < 0 or l_cache > l_max:
            raise ValueError(f"overlong_cache_len must be in [0, overlong_max_len={l_max}], got {l_cache}")
        start = l_max - l_cache
        if l_cache > 0:
            penalty = (-(lens - start) / l_cache * factor).clamp(min=-factor, max=0.0)
        else:
            penalty = torch.where(lens > l_max, -float(factor), 0.0).double()
        out = out + penalty
    return out.to(r.dtype)


def group_advantages(rewards: Tensor, group_ids: Tensor, estimator: Estimator = "grpo", eps: float = 1e-6) -> Tensor:
    """Group-relative advantages. [B] -> [B].

    grpo: (r - mean_g) / (std_g + eps) with the population std; drgrpo: r - mean_g (Dr.GRPO drops the std, which
    over-weights near-uniform groups); rloo: r - mean of the other members of the group. A group of one sample
    has no baseline and gets 0 under every estimator. Group ids may be any integers, in any order.
    """
    r = _as_float(rewards, "rewards")
    gid = torch.as_tensor(group_ids, device=r.device)
    if gid.shape != r.shape:
        raise ValueError(f"group_ids shape {tuple(gid.shape)} != rewards shape {tuple(r.shape)}")
    if r.numel() == 0:
        return r.clone()
    _, inv = torch.unique(gid, return_inverse=True)  # [B] dense group index
    num_groups = int(inv.max().item()) + 1
    x = r.double()
    count = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add(0, inv, torch.ones_like(x))
    total = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add(0, inv, x)
    n = count[inv]  # [B] size of each sample's group
    mean = (total / count)[inv]
    if estimator == "grpo":
        sq = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add(0, inv, (x - mean).square())
        std = (sq / count).sqrt()[inv]
        adv = (x - mean) / (std + eps)
    elif estimator == "drgrpo":
        adv = x - mean
    elif estimator == "rloo":
        others = (total[inv] - x) / (n - 1).clamp(min=1.0)
        adv = torch.where(n > 1, x - others, 0.0)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected 'grpo', 'drgrpo' or 'rloo'")
    adv = torch.where(n > 1, adv, 0.0)
    return adv.to(r.dtype)


def normalization_moments(adv: Tensor) -> Tensor:
    """(count, sum, sum of squares) of `adv` as a float64 [3] tensor: all-reduce it with SUM across ranks."""
    x = _as_float(adv, "adv").double()
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), x.sum(),
                        x.square().sum()])


def mean_std_from_moments(moments: Tensor) -> tuple[float, float]:
    """Mean and population std from (all-reduced) `normalization_moments`."""
    count, total, sq = (float(v) for v in moments.double().tolist())
    if count <= 0:
        return 0.0, 0.0
    mean = total / count
    return mean, max(sq / count - mean * mean, 0.0) ** 0.5


def batch_normalize_with(adv: Tensor, mean: float | Tensor, std: float | Tensor, eps: float = 1e-6) -> Tensor:
    """(adv - mean) / (std + eps) with given (e.g. global) statistics. [B] -> [B]."""
    a = _as_float(adv, "adv")
    return ((a.double() - mean) / (std + eps)).to(a.dtype)


def batch_normalize(adv: Tensor, eps: float = 1e-6) -> Tensor:
    """(adv - mean) / (std + eps) over this batch, population std. [B] -> [B]."""
    mean, std = mean_std_from_moments(normalization_moments(adv))
    return batch_normalize_with(adv, mean, std, eps)


def compute_advantages(rewards: Tensor, group_ids: Tensor, cfg: AdvantageConfig, response_lens: Tensor | None = None,
                       *, batch_stats: tuple[float, float] | None = None, eps: float = 1e-6) -> Tensor:
    """The whole chain for one rank's sequences: shape, group baseline, then batch-normalise if `cfg.batch_norm`.

    `batch_stats` (mean, std) replaces the local statistics of the last step; a multi-rank worker computes the
    group advantages first, all-reduces `normalization_moments`, and passes the global pair here (or calls the
    pieces itself). [B] -> [B].
    """
    shaped = shape_rewards(rewards, cfg, response_lens)
    adv = group_advantages(shaped, group_ids, cfg.estimator, eps)
    if cfg.batch_norm:
        adv = batch_normalize(adv, eps) if batch_stats is None else batch_normalize_with(adv, *batch_stats, eps=eps)
    return adv

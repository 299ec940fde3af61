"""Rewards to advantages: shaping, group-relative baselines, optional batch normalisation. Pure torch, per sequence.

No critic: the baseline of a sample is the other samples of its prompt group (GRPO family), gamma = lambda = 1,
so one scalar advantage per sequence is broadcast to all of its trained tokens by the caller.
Groups are never split across trainer ranks, so everything here is rank-local except the batch normalisation,
whose mean/std the worker may all-reduce: `normalization_moments` + `mean_std_from_moments` +
`batch_normalize_with`. Statistics are computed in float64 (rewards are few; precision is free) and returned in the
input's floating dtype.

Baseline weights (optional, [B], finite and > 0): how much each sequence counts in its group's statistics. The agent
path's per_call export turns an episode of k calls into k trajectories of weight 1/k (agent/episode.py), so that
every episode counts once in its group's baseline however many calls it made; an unweighted mean would let the
episodes with more calls set the baseline. Only the ratios of weights within a group (and, for the batch
normalisation, across the batch) matter. Weights shape the baseline only, never the loss: every trained token is
still a term of the token-mean loss. Without weights every sequence weighs 1.0, and the weighted formulas with all
weights 1.0 run exactly the same float operations as the unweighted ones (x * 1.0 is x, a sum of ones is the
count), so the advantages are bit-identical.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from areal_async.config import AdvantageConfig

__all__ = [
    "shape_rewards",
    "group_advantages",
    "batch_normalize",
    "batch_normalize_with",
    "normalization_moments",
    "mean_std_from_moments",
    "compute_advantages",
]

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


def _weights(weights: Tensor | list | None, like: Tensor) -> Tensor:
    """The baseline weights as float64 on `like`'s device, ones where none were given. [B]"""
    if weights is None:
        return torch.ones(like.shape, dtype=torch.float64, device=like.device)
    w = torch.as_tensor(weights, device=like.device).double()
    if w.shape != like.shape:
        raise ValueError(f"weights shape {tuple(w.shape)} != rewards shape {tuple(like.shape)}")
    if w.numel() and not bool((torch.isfinite(w) & (w > 0)).all()):
        raise ValueError("weights must be finite and > 0")
    return w


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    estimator: Estimator = "grpo",
    eps: float = 1e-6,
    *,
    weights: Tensor | None = None,
) -> Tensor:
    """Group-relative advantages. [B] -> [B].

    With w_i the baseline weight of sample i (1.0 without `weights`) and W_g the sum of the weights of group g:
    grpo: (r - mean_g) / (std_g + eps), mean_g = sum w r / W_g and std_g the weighted population std,
    sqrt(sum w (r - mean_g)^2 / W_g); drgrpo: r - mean_g (Dr.GRPO drops the std, which over-weights
    near-uniform groups); rloo: r_i - (sum_g w r - w_i r_i) / (W_g - w_i), the weighted mean of the group with
    this one sample left out. RLOO leaves out the sample, not its episode: a per_call trajectory's baseline still
    holds the other calls of its own episode (at their weights), since the trainer does not know which calls
    share an episode; with one trajectory per episode (concat export, every other workflow) it is exact
    leave-one-out. A group of one sample has no baseline and gets 0 under every estimator (a group is its
    trajectories here, so one episode of several calls is compared call against call, as without weights).
    Group ids may be any integers, in any order.
    """
    r = _as_float(rewards, "rewards")
    gid = torch.as_tensor(group_ids, device=r.device)
    if gid.shape != r.shape:
        raise ValueError(f"group_ids shape {tuple(gid.shape)} != rewards shape {tuple(r.shape)}")
    w = _weights(weights, r)  # [B] float64
    if r.numel() == 0:
        return r.clone()
    _, inv = torch.unique(gid, return_inverse=True)  # [B] dense group index
    num_groups = int(inv.max().item()) + 1
    x = r.double()
    xw = x * w  # [B]

    def per_group(v: Tensor) -> Tensor:  # [B] -> [G] sums
        return torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add(0, inv, v)

    n = per_group(torch.ones_like(x))[inv]  # [B] size of each sample's group
    wsum = per_group(w)  # [G]
    total = per_group(xw)  # [G]
    mean = (total / wsum)[inv]  # [B]
    if estimator == "grpo":
        std = (per_group(w * (x - mean).square()) / wsum).sqrt()[inv]
        adv = (x - mean) / (std + eps)
    elif estimator == "drgrpo":
        adv = x - mean
    elif estimator == "rloo":
        rest = wsum[inv] - w  # [B] weight of the others; > 0 in a group of two or more (all 1.0: n - 1 >= 1)
        others = (total[inv] - xw) / torch.where(rest > 0, rest, 1.0)
        adv = torch.where((n > 1) & (rest > 0), x - others, 0.0)
    else:
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected 'grpo', 'drgrpo' or 'rloo'")
    adv = torch.where(n > 1, adv, 0.0)
    return adv.to(r.dtype)


def normalization_moments(adv: Tensor, weights: Tensor | None = None) -> Tensor:
    """(total weight, weighted sum, weighted sum of squares) of `adv` as a float64 [3] tensor: all-reduce it with
    SUM across ranks. Without weights: (count, sum, sum of squares).

    The batch normalisation takes the same baseline weights as the group baseline: the unweighted batch mean
    would shift the advantages back toward the unweighted baseline. One group of two episodes, one call with
    reward 1 and three calls with reward 0, has weighted drgrpo advantages +0.5 and -0.5 x3; their unweighted
    mean is -0.25, and subtracting it gives r - 0.25, exactly what the unweighted group mean gives. Weighted, the
    batch statistics are over episodes, as the group statistics are.
    """
    x = _as_float(adv, "adv").double()
    w = _weights(weights, x)
    return torch.stack([w.sum(), (w * x).sum(), (w * x.square()).sum()])


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


def batch_normalize(adv: Tensor, eps: float = 1e-6, *, weights: Tensor | None = None) -> Tensor:
    """(adv - mean) / (std + eps) over this batch, population std, weighted by `weights` (see
    `normalization_moments`). [B] -> [B]."""
    mean, std = mean_std_from_moments(normalization_moments(adv, weights))
    return batch_normalize_with(adv, mean, std, eps)


def compute_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    cfg: AdvantageConfig,
    response_lens: Tensor | None = None,
    *,
    batch_stats: tuple[float, float] | None = None,
    eps: float = 1e-6,
    weights: Tensor | None = None,
) -> Tensor:
    """The whole chain for one rank's sequences: shape, group baseline, then batch-normalise if `cfg.batch_norm`.

    `weights` are the baseline weights (module docstring), used by the group baseline and the local batch
    statistics. `batch_stats` (mean, std) replaces the local statistics of the last step; a multi-rank worker
    computes the group advantages first, all-reduces `normalization_moments` (weighted alike), and passes the
    global pair here (or calls the pieces itself). [B] -> [B].
    """
    shaped = shape_rewards(rewards, cfg, response_lens)
    adv = group_advantages(shaped, group_ids, cfg.estimator, eps, weights=weights)
    if cfg.batch_norm:
        adv = (
            batch_normalize(adv, eps, weights=weights)
            if batch_stats is None
            else batch_normalize_with(adv, *batch_stats, eps=eps)
        )
    return adv

"""Reward shaping and group advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from areal_async.config import AdvantageConfig
from areal_async.train.advantages import (
    batch_normalize,
    batch_normalize_with,
    compute_advantages,
    group_advantages,
    mean_std_from_moments,
    normalization_moments,
    shape_rewards,
)

EPS = 1e-6


def test_shape_rewards_bias_scale_clip():
    cfg = AdvantageConfig(reward_bias=1.0, reward_scale=2.0, reward_clip=3.0)
    r = torch.tensor([0.0, 1.0, -5.0, 0.2])
    # (r + 1) * 2 = 2, 4, -8, 2.4 -> clipped to [-3, 3]
    assert shape_rewards(r, cfg).tolist() == pytest.approx([2.0, 3.0, -3.0, 2.4], abs=1e-6)
    assert shape_rewards(r, cfg).dtype == torch.float32
    assert shape_rewards(torch.tensor([1, 0]), AdvantageConfig()).tolist() == [1.0, 0.0]  # int rewards are fine


def test_shape_rewards_overlong_penalty():
    cfg = AdvantageConfig(overlong_max_len=10, overlong_cache_len=4, overlong_factor=1.0)
    r = torch.ones(6)
    lens = torch.tensor([5, 6, 7, 8, 10, 12])
    # the ramp starts after L_max - L_cache = 6: -(len - 6) / 4 -> 0, 0, -0.25, -0.5, -1; beyond L_max floored at -1
    assert shape_rewards(r, cfg, lens).tolist() == pytest.approx([1, 1, 0.75, 0.5, 0.0, 0.0], abs=1e-6)
    half = AdvantageConfig(overlong_max_len=10, overlong_cache_len=4, overlong_factor=0.5, reward_clip=0.5)
    # the penalty is added after the clip: 1 -> 0.5, then - 0.5 * 0.5
    assert shape_rewards(torch.tensor([1.0]), half, torch.tensor([8])).tolist() == pytest.approx([0.25])
    hard = AdvantageConfig(overlong_max_len=10, overlong_cache_len=0, overlong_factor=2.0)
    assert shape_rewards(torch.zeros(3), hard, [9, 10, 11]).tolist() == [0.0, 0.0, -2.0]
    with pytest.raises(ValueError, match="response_lens"):
        shape_rewards(r, cfg)
    with pytest.raises(ValueError, match="overlong_cache_len"):
        shape_rewards(r, AdvantageConfig(overlong_max_len=3, overlong_cache_len=4), lens)


REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 4.0])
GROUPS = torch.tensor([7, 7, 7, 7, 3, 9, 9])  # a group of 4, a lone sample, a pair; ids unordered


def test_grpo_hand_values():
    # group 7: mean 0.5, population std 0.5; group 3: size 1 -> 0; group 9: mean 3, std 1
    k = 0.5 / (0.5 + EPS)
    expect = [k, -k, -k, k, 0.0, -1 / (1 + EPS), 1 / (1 + EPS)]
    assert group_advantages(REWARDS, GROUPS, "grpo", EPS).tolist() == pytest.approx(expect, abs=1e-7)


def test_drgrpo_hand_values():
    assert group_advantages(REWARDS, GROUPS, "drgrpo").tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, -1, 1])


def test_rloo_hand_values():
    # group 7: 1 - (0 + 0 + 1) / 3 = 2/3, 0 - 2/3 = -2/3; group 9: 2 - 4, 4 - 2
    expect = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, -2.0, 2.0]
    assert group_advantages(REWARDS, GROUPS, "rloo").tolist() == pytest.approx(expect, abs=1e-6)


def test_uniform_group_gives_zero_and_errors():
    assert group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), "grpo").tolist() == [0.0] * 4
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(REWARDS, GROUPS, "ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(REWARDS, GROUPS[:3])


def test_batch_normalize_hand_values():
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0])
    std = math.sqrt(1.25)  # population std around 2.5
    expect = [(x - 2.5) / (std + EPS) for x in (1, 2, 3, 4)]
    assert batch_normalize(adv, EPS).tolist() == pytest.approx(expect, abs=1e-6)
    assert batch_normalize_with(adv, 2.0, 0.5, 0.0).tolist() == pytest.approx([-2.0, 0.0, 2.0, 4.0])


def test_moments_compose_across_shards():
    # Two "ranks" all-reducing (summing) their moments get the statistics of the union.
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 10.0])
    mean, std = mean_std_from_moments(normalization_moments(a) + normalization_moments(b))
    whole = torch.cat([a, b]).double()
    assert mean == pytest.approx(whole.mean().item())
    assert std == pytest.approx(whole.std(unbiased=False).item())
    assert mean_std_from_moments(normalization_moments(torch.zeros(0))) == (0.0, 0.0)


def test_compute_advantages_chain():
    cfg = AdvantageConfig(estimator="drgrpo", reward_scale=2.0, batch_norm=True)
    adv = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]), cfg)
    # shaped 2, 0, 6, 2 -> drgrpo 1, -1, 2, -2 -> mean 0, std sqrt(2.5)
    s = math.sqrt(2.5)
    assert adv.tolist() == pytest.approx([1 / s, -1 / s, 2 / s, -2 / s], abs=1e-5)
    glob = compute_advantages(
        torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]), cfg, batch_stats=(1.0, 2.0), eps=0.0
    )
    assert glob.tolist() == pytest.approx([0.0, -1.0, 0.5, -1.5])


# ---- baseline weights (the agent's per_call export: every episode counts once) ------------------------------------

# One prompt, two episodes: episode A made 1 call and earned 1, episode B made 3 calls and earned 0 (per_call export:
# weights 1 and 1/3 x3). Weighted, the baseline is the mean over episodes, 0.5; unweighted it would be 0.25.
EP_REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0])
EP_GROUPS = torch.zeros(4, dtype=torch.long)
EP_WEIGHTS = torch.tensor([1.0, 1 / 3, 1 / 3, 1 / 3])


def test_weighted_baseline_counts_every_episode_once():
    drgrpo = group_advantages(EP_REWARDS, EP_GROUPS, "drgrpo", weights=EP_WEIGHTS)
    assert drgrpo.tolist() == pytest.approx([0.5, -0.5, -0.5, -0.5], abs=1e-6)  # r - 0.5
    assert group_advantages(EP_REWARDS, EP_GROUPS, "drgrpo").tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    # grpo: weighted population std sqrt((1 * 0.25 + 3 * 1/3 * 0.25) / 2) = 0.5, so +-0.5 / (0.5 + eps)
    k = 0.5 / (0.5 + EPS)
    assert group_advantages(EP_REWARDS, EP_GROUPS, "grpo", EPS, weights=EP_WEIGHTS).tolist() == pytest.approx(
        [k, -k, -k, -k], abs=1e-6
    )
    # the same as one trajectory per episode (what the concat export gives)
    per_episode = group_advantages(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long), "grpo", EPS)
    assert per_episode.tolist() == pytest.approx([k, -k], abs=1e-6)
    # rloo, leaving out the trajectory (not its episode): A: 1 - (1/3 * 0 * 3) / 1 = 1;
    # each B call: 0 - (1 * 1 + 2 * 1/3 * 0) / (1 + 2/3) = -0.6
    assert group_advantages(EP_REWARDS, EP_GROUPS, "rloo", weights=EP_WEIGHTS).tolist() == pytest.approx(
        [1.0, -0.6, -0.6, -0.6], abs=1e-6
    )
    assert group_advantages(EP_REWARDS, EP_GROUPS, "rloo").tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # only ratios within a group matter; a group of one still gets 0 whatever its weight
    assert group_advantages(EP_REWARDS, EP_GROUPS, "grpo", weights=EP_WEIGHTS * 7.0).tolist() == pytest.approx(
        [k, -k, -k, -k], abs=1e-6
    )
    assert group_advantages(torch.tensor([3.0]), torch.tensor([5]), "rloo", weights=torch.tensor([0.5])).tolist() == [
        0.0
    ]


def test_weighted_per_call_groups_equal_per_episode_groups():
    """Random groups of episodes of 1-4 calls, every call credited with its episode's reward: weighted by 1/calls,
    each call's advantage is its episode's advantage in the group of one trajectory per episode (grpo, drgrpo)."""
    gen = torch.Generator().manual_seed(3)
    ep_rewards, ep_groups, rewards, groups, weights, owner = [], [], [], [], [], []
    for g in range(20):
        for _ in range(int(torch.randint(2, 6, (1,), generator=gen))):
            r, calls = float(torch.randint(0, 4, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
            ep_rewards.append(r)
            ep_groups.append(g)
            rewards += [r] * calls
            groups += [g] * calls
            weights += [1.0 / calls] * calls
            owner += [len(ep_rewards) - 1] * calls
    for est in ("grpo", "drgrpo"):
        want = group_advantages(torch.tensor(ep_rewards), torch.tensor(ep_groups), est)[torch.tensor(owner)]
        got = group_advantages(torch.tensor(rewards), torch.tensor(groups), est, weights=torch.tensor(weights))
        assert torch.allclose(got, want, atol=1e-5), est
        plain = group_advantages(torch.tensor(rewards), torch.tensor(groups), est)
        assert (plain - want).abs().max() > 0.1  # unweighted, the episodes with more calls move the baseline


def test_weighted_batch_norm_keeps_the_episode_baseline():
    """drgrpo + batch norm on the two-episode group: weighted advantages +0.5, -0.5 x3 have weighted mean 0 and std
    0.5. An unweighted batch mean (-0.25) would give back r - 0.25, the unweighted baseline."""
    cfg = AdvantageConfig(estimator="drgrpo", batch_norm=True)
    adv = compute_advantages(EP_REWARDS, EP_GROUPS, cfg, weights=EP_WEIGHTS, eps=0.0)
    assert adv.tolist() == pytest.approx([1.0, -1.0, -1.0, -1.0], abs=1e-5)
    adv_unweighted_norm = batch_normalize(group_advantages(EP_REWARDS, EP_GROUPS, "drgrpo", weights=EP_WEIGHTS), 0.0)
    plain = batch_normalize(group_advantages(EP_REWARDS, EP_GROUPS, "drgrpo"), 0.0)
    assert torch.allclose(adv_unweighted_norm, plain, atol=1e-6) and not torch.allclose(adv, plain, atol=0.1)
    # weighted moments still compose across shards: (sum w, sum w a, sum w a^2)
    a, wa, b, wb = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25]), torch.tensor([3.0]), torch.tensor([2.0])
    mean, std = mean_std_from_moments(normalization_moments(a, wa) + normalization_moments(b, wb))
    x, w = torch.cat([a, b]).double(), torch.cat([wa, wb]).double()
    m = float((w * x).sum() / w.sum())
    assert mean == pytest.approx(m) and std == pytest.approx(float(((w * (x - m) ** 2).sum() / w.sum()).sqrt()))


def test_bad_weights_are_refused():
    for bad in (
        [1.0, 0.0, 1.0, 1.0],
        [1.0, -1.0, 1.0, 1.0],
        [1.0, float("nan"), 1.0, 1.0],
        [float("inf"), 1.0, 1.0, 1.0],
    ):
        with pytest.raises(ValueError, match="finite and > 0"):
            group_advantages(EP_REWARDS, EP_GROUPS, weights=torch.tensor(bad))
    with pytest.raises(ValueError, match="weights shape"):
        group_advantages(EP_REWARDS, EP_GROUPS, weights=torch.ones(3))
    with pytest.raises(ValueError, match="finite and > 0"):
        normalization_moments(EP_REWARDS, torch.zeros(4))


def _unweighted_before(rewards: torch.Tensor, group_ids: torch.Tensor, estimator: str, eps: float) -> torch.Tensor:
    """`group_advantages` as it was before baseline weights existed, line for line: the promise is that every
    workflow without weights trains exactly as before."""
    r = rewards if rewards.is_floating_point() else rewards.float()
    _, inv = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inv.max().item()) + 1
    x = r.double()
    count = torch.zeros(num_groups, dtype=torch.float64).index_add(0, inv, torch.ones_like(x))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add(0, inv, x)
    n = count[inv]
    mean = (total / count)[inv]
    if estimator == "grpo":
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add(0, inv, (x - mean).square())
        adv = (x - mean) / ((sq / count).sqrt()[inv] + eps)
    elif estimator == "drgrpo":
        adv = x - mean
    else:
        others = (total[inv] - x) / (n - 1).clamp(min=1.0)
        adv = torch.where(n > 1, x - others, 0.0)
    return torch.where(n > 1, adv, 0.0).to(r.dtype)


def test_no_weights_or_all_ones_is_bit_identical_to_before():
    gen = torch.Generator().manual_seed(11)
    rewards = torch.randn(300, generator=gen) * 3  # [B] float32
    groups = torch.randint(0, 60, (300,), generator=gen)  # sizes 1 and up, unordered
    ones = torch.ones(300)
    for est in ("grpo", "drgrpo", "rloo"):
        before = _unweighted_before(rewards, groups, est, EPS)
        assert torch.equal(group_advantages(rewards, groups, est, EPS), before), est
        assert torch.equal(group_advantages(rewards, groups, est, EPS, weights=ones), before), est
    adv = _unweighted_before(rewards, groups, "grpo", EPS)
    x = adv.double()
    moments_before = torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), x.square().sum()])
    assert torch.equal(normalization_moments(adv), moments_before)
    assert torch.equal(normalization_moments(adv, ones), moments_before)
    cfg = AdvantageConfig(estimator="grpo", batch_norm=True, reward_scale=0.5)
    group_before = _unweighted_before(shape_rewards(rewards, cfg), groups, "grpo", EPS).double()
    stats_before = mean_std_from_moments(
        torch.stack([torch.tensor(300.0, dtype=torch.float64), group_before.sum(), group_before.square().sum()])
    )
    chain_before = batch_normalize_with(group_before.float(), *stats_before, eps=EPS)
    assert torch.equal(compute_advantages(rewards, groups, cfg), chain_before)
    assert torch.equal(compute_advantages(rewards, groups, cfg, weights=ones), chain_before)

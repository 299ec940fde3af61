"""Reward shaping and group advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from areal_async.config import AdvantageConfig
from areal_async.train.advantages import (batch_normalize, batch_normalize_with, compute_advantages,
                                          group_advantages, mean_std_from_moments, normalization_moments,
                                          shape_rewards)

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
    glob = compute_advantages(torch.tensor([1.0, 0.0, 3.0, 1.0]), torch.tensor([0, 0, 1, 1]), cfg,
                              batch_stats=(1.0, 2.0), eps=0.0)
    assert glob.tolist() == pytest.approx([0.0, -1.0, 0.5, -1.5])

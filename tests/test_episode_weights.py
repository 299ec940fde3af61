"""Baseline weights from the agent's per_call export to the trainer's advantages: the real Episode export, the wire
(`pack_trajectories`: sent only when needed), the trainer's shard check and the controller's trajectory check.
The same through a real torchrun step is in tests/test_trainer.py (`test_episode_weights_in_a_real_step`)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from areal_async.agent.episode import CallRecord, Episode
from areal_async.train.advantages import group_advantages
from areal_async.train.client import validate_trajectories
from areal_async.train.errors import BatchError
from areal_async.train.shard import decode_shard
from areal_async.types import Array, Trajectory, pack_trajectories

CPU = torch.device("cpu")


def _episode(name: str, calls: int, reward: float) -> Episode:
    ep = Episode(name, group_id=4)
    for i in range(calls):  # unrelated prompts: not linear, so the export is per_call
        ep.add(
            CallRecord(
                call_id=f"{name}{i}",
                kind="chat",
                prompt_ids=[10 + i, 11 + i],
                output_ids=[3, 4],
                output_logprobs=[-0.5, -0.25],
                output_versions=[0, 0],
                finish_reason="stop",
                temperature=1.0,
            )
        )
    ep.set_reward(reward)
    return ep


def _pack(trajs: list[Trajectory]):
    return pack_trajectories(trajs, 0, sum(t.response_len for t in trajs), len(trajs))


def test_two_episodes_one_and_three_calls_get_baseline_one_half():
    """Episode A (1 call, reward 1) and episode B (3 calls, reward 0) of one prompt, exported per_call, packed,
    decoded as the trainer does: the group baseline is 0.5 (each episode once), not 0.25 (each call once)."""
    trajs = [t for ep in (_episode("a", 1, 1.0), _episode("b", 3, 0.0)) for t in ep.to_trajectories(mode="per_call")]
    assert [t.reward for t in trajs] == [1.0, 0.0, 0.0, 0.0]  # with discount 1 every call of B is credited 0
    validate_trajectories(trajs)
    shard = decode_shard(_pack(trajs), 100, CPU)
    assert shard.baseline_weights is not None
    assert shard.baseline_weights.tolist() == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])
    adv = group_advantages(shard.rewards, shard.group_ids, "drgrpo", weights=shard.baseline_weights)
    assert (shard.rewards - adv).tolist() == pytest.approx([0.5] * 4, abs=1e-6)  # the baseline
    plain = group_advantages(shard.rewards, shard.group_ids, "drgrpo")
    assert (shard.rewards - plain).tolist() == pytest.approx([0.25] * 4, abs=1e-6)


def test_weights_travel_only_when_some_differs_from_one():
    base = Trajectory(
        input_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -1.0, -1.0],
        versions=[-1, 0, 0],
        reward=1.0,
        group_id=0,
        prompt_len=1,
    )
    ones = [
        msgspec.structs.replace(base, info={"episode_weight": 1.0, "episode_calls": 1}),
        msgspec.structs.replace(base, info={"episode_weight": 1}),
    ]
    plain = _pack([base, base])
    assert plain.baseline_weights is None and _pack(ones).baseline_weights is None
    # an ordinary batch is unchanged on the wire: no key for the absent field
    assert msgspec.msgpack.encode(_pack(ones)) == msgspec.msgpack.encode(plain)
    assert b"baseline_weights" not in msgspec.msgpack.encode(plain)
    assert decode_shard(plain, 100, CPU).baseline_weights is None
    half = _pack([base, msgspec.structs.replace(base, info={"episode_weight": 0.5})])
    assert half.baseline_weights is not None and half.baseline_weights.dtype == "float32"
    assert half.baseline_weights.to_numpy().tolist() == [1.0, 0.5]
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(half), type=type(half))
    assert decode_shard(wire, 100, CPU).baseline_weights.tolist() == [1.0, 0.5]


@pytest.mark.parametrize(
    "weights, message",
    [
        (np.array([1.0, 0.0], np.float32), "finite and > 0, sequence 1 has 0.0"),
        (np.array([-1.0, 1.0], np.float32), "finite and > 0, sequence 0 has -1.0"),
        (np.array([1.0, np.nan], np.float32), "finite and > 0, sequence 1 has nan"),
        (np.array([np.inf, 1.0], np.float32), "finite and > 0, sequence 0 has inf"),
        (np.array([1.0, 1.0, 1.0], np.float32), "length 3 != 2"),
        (np.array([1.0, 0.5], np.float64), "dtype must be float32"),
        (np.ones((2, 1), np.float32), "must be 1-d"),
    ],
)
def test_trainer_rejects_bad_weights(weights, message):
    t = Trajectory(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, versions=[0] * 3, reward=1.0)
    batch = msgspec.structs.replace(_pack([t, t]), baseline_weights=Array.from_numpy(weights))
    with pytest.raises(BatchError, match=f"batch.baseline_weights: .*{message}"):
        decode_shard(batch, 100, CPU)


@pytest.mark.parametrize(
    "weight, message",
    [
        (float("nan"), "finite and > 0"),
        (float("inf"), "finite and > 0"),
        (0.0, "finite and > 0"),
        (-0.5, "finite and > 0"),
        ("1", "must be a number"),
        (True, "must be a number"),
        (1e-40, "outside the float32 range"),
        (1e39, "outside the float32 range"),
    ],
)
def test_controller_rejects_bad_weights_before_sending(weight, message):
    good = Trajectory(
        input_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0] * 3,
        versions=[0] * 3,
        reward=1.0,
        info={"episode_weight": 0.25},
    )
    bad = msgspec.structs.replace(good, info={"episode_weight": weight})
    validate_trajectories([good, msgspec.structs.replace(good, info={"episode_weight": 3})])
    with pytest.raises(ValueError, match=f"trajectory 1: info\\['episode_weight'\\].*{message}"):
        validate_trajectories([good, bad])

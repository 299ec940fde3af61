"""RPC messages of the trainer that types.py does not define. Torch-free: the controller imports them.

The shared ones (TrainStepRequest/Result, PublishRequest/Result, CheckpointRequest/Result, InitBroadcastRequest,
BroadcastRequest/Result, WeightSpec, Empty, TrainerInfo) stay in areal_async/types.py.
"""

from __future__ import annotations

import msgspec

from areal_async.types import WeightSpec

__all__ = [
    "WeightPlanRequest",
    "WeightPlan",
    "OpenBroadcastRequest",
    "BroadcastEndpoint",
    "AbortBroadcastRequest",
    "AbortBroadcastResult",
]


class WeightPlanRequest(msgspec.Struct, kw_only=True):
    """Ask trainer rank 0 how `broadcast` will bucket the weights (names, dtypes, shapes in broadcast order)."""

    bucket_bytes: int = 256 << 20


class WeightPlan(msgspec.Struct, kw_only=True):
    buckets: list[WeightSpec]
    num_bytes: int  # total bytes the broadcast will send


class OpenBroadcastRequest(msgspec.Struct, kw_only=True):
    """Ask trainer rank 0 to host the rendezvous store of a weight-update group before anyone joins it."""

    group_name: str
    world_size: int  # 1 + total inference ranks
    port: int = 0  # 0: a free port, bound by rank 0 (no race with other processes)


class BroadcastEndpoint(msgspec.Struct, kw_only=True):
    """Where the servers meet trainer rank 0: its reachable address (TrainerInfo.host) and the store's port."""

    address: str
    port: int


class AbortBroadcastRequest(msgspec.Struct, kw_only=True):
    """Ask trainer rank 0 to abort weight-update group `group_name` now. Served beside a running `broadcast` call
    (not queued behind it): a member that failed a bucket will never receive the rest, so rank 0 stops sending at
    once instead of at its per-bucket deadline. The group is finished after it; the controller forms a new one."""

    group_name: str
    reason: str = ""


class AbortBroadcastResult(msgspec.Struct, kw_only=True):
    running: bool  # a broadcast on the group was running and stops; False: none was (the group, if any, is gone)

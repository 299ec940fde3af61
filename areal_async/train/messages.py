"""RPC messages of the trainer that types.py does not define. Torch-free: the controller imports them.

The shared ones (TrainStepRequest/Result, PublishRequest/Result, CheckpointRequest/Result, InitBroadcastRequest,
BroadcastRequest/Result, WeightSpec, Empty, TrainerInfo) stay in areal_async/types.py.
"""

from __future__ import annotations

import msgspec

from areal_async.types import WeightSpec

__all__ = ["WeightPlanRequest", "WeightPlan", "METHODS"]


class WeightPlanRequest(msgspec.Struct, kw_only=True):
    """Ask trainer rank 0 how `broadcast` will bucket the weights (names, dtypes, shapes in broadcast order)."""

    bucket_bytes: int = 256 << 20


class WeightPlan(msgspec.Struct, kw_only=True):
    buckets: list[WeightSpec]
    num_bytes: int  # total bytes the broadcast will send


# RPC method names served by every trainer rank (areal_async/train/worker.py).
METHODS = ("info", "train_step", "publish", "save_checkpoint", "load_checkpoint", "weight_plan", "init_broadcast",
           "broadcast", "shutdown")

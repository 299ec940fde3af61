"""RPC messages of the trainer that types.py does not define. Torch-free: the controller imports them.

The shared ones (TrainStepRequest/Result, PublishRequest/Result, CheckpointRequest/Result, InitBroadcastRequest,
BroadcastRequest/Result, WeightSpec, Empty, TrainerInfo) stay in areal_async/types.py.
"""

from __future__ import annotations

import msgspec

from areal_async.protocol.weight_identity import Identity
from areal_async.types import WeightSpec

__all__ = [
    "WeightPlanRequest",
    "WeightPlan",
    "OpenBroadcastRequest",
    "BroadcastEndpoint",
    "AbortBroadcastRequest",
    "AbortBroadcastResult",
    "DeltaPublishRequest",
    "DeltaPublishResult",
    "IdentityRequest",
    "DeltaBroadcastPrepare",
    "DeltaBroadcastPlan",
    "DeltaSendRequest",
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


class DeltaPublishRequest(msgspec.Struct, kw_only=True):
    """Publish version `version` under `root` as a full HF checkpoint or, with `train.delta_sync`, as a delta of the
    served-dtype bits against the version published before (train/delta_publish.py decides which), and say what
    the servers must then hold (`DeltaPublishResult.identity`)."""

    version: int
    root: str
    keep: int = 2
    served_dtype: str = "float32"  # the dtype the servers hold the weights in: deltas and identities are of its bits
    force_full: bool = False  # a full snapshot whatever the schedule (a delta was refused somewhere)
    # train.lora: also compute the identity of the merged weights (the embedded server's proof; it costs one gather
    # of the base and a merge of every adapted weight per version). SGLang applies adapters per request and keeps
    # its base, so its adapter sync asks for none (rollout/lora_sync.py)
    identity: bool = True


class DeltaPublishResult(msgspec.Struct, kw_only=True):
    path: str
    seconds: float
    num_bytes: int  # bytes written: the checkpoint's, or the delta file's
    kind: str  # "full" or "delta"
    identity: Identity  # of the weights as served in `served_dtype`
    changed: int = 0  # elements whose served bits changed since the base (a delta only)
    total: int = 0  # elements of the model
    full_bytes: int = 0  # bytes of the whole model in the served dtype (what a full sync of its bits ships)
    base_version: int = -1  # the version a delta applies to (-1: full)
    identity_s: float = 0.0  # seconds spent on digests (part of `seconds`)


class IdentityRequest(msgspec.Struct, kw_only=True):
    """Ask the trainers for the identity of the weights they hold now, as served in `served_dtype` (collective:
    a gather of every parameter, for a transport that publishes nothing, such as broadcast)."""

    served_dtype: str = "float32"


class DeltaBroadcastPrepare(msgspec.Struct, kw_only=True):
    """Ask the trainers to prepare the delta broadcast of `version` (the version they hold) in `served_dtype`:
    a gather, the XOR of the served bits against the last version prepared, compressed, held on rank 0."""

    version: int
    served_dtype: str = "float32"


class DeltaBroadcastPlan(msgspec.Struct, kw_only=True):
    """What a delta broadcast will send. `kind`: "delta" (send it with `send_delta`), "full" (no base to diff
    against: broadcast the full weights; the bits are kept for the next delta), "off" (train.delta_sync is off) or
    "adapter" (train.lora: send the adapters with `send_delta`; the servers merge them).
    `spec`: the payloads in send order (uint8, one per changed parameter, named after it)."""

    kind: str
    version: int
    spec: WeightSpec
    base_combined: str = ""
    identity: Identity | None = None  # of the result, as served
    num_bytes: int = 0
    full_bytes: int = 0
    changed: int = 0
    total: int = 0
    seconds: float = 0.0
    lora_rank: int = 0  # kind "adapter" (train.lora): the payloads are the adapters, W = W0 + alpha / r * B @ A
    lora_alpha: float = 0.0


class DeltaSendRequest(msgspec.Struct, kw_only=True):
    """Send the prepared delta of `version` through group `group_name` (rank 0; no gather)."""

    group_name: str
    version: int

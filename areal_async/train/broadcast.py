"""Trainer side of SGLang's weight broadcast (/init_weights_update_group + /update_weights_from_distributed).

The group is a process group of its own, apart from the trainers' FSDP group: trainer rank 0 is group rank 0 and
hosts the rendezvous store at (master_address, master_port); server ranks join from `rank_offset` = 1 on. Only
trainer rank 0 is a member, but every trainer rank takes part in `broadcast` because gathering a full parameter
out of FSDP is an all-gather among the trainers.

Choreography (driven by the controller, see `TrainerGroup.broadcast_weights` in train/client.py):

    1. controller: `weight_plan(bucket_bytes)` from trainer rank 0 -> buckets of (names, dtypes, shapes)
    2. controller, concurrently: trainer `init_broadcast` and every server's /init_weights_update_group
       (each side blocks in the rendezvous until the other arrives); done once
    3. controller, concurrently: trainer `broadcast(version)`, and for each bucket in order, every server's
       /update_weights_from_distributed(bucket) -- the trainer broadcasts the bucket's tensors one by one, in the
       announced order, while that HTTP call is pending; the server returns once it has them all

Tensors go one `broadcast` per tensor, in the checkpoint's dtype, exactly as SGLang receives them; buckets only bound
how much a server allocates per HTTP call. The plan is a pure function of the model and `bucket_bytes`, so the
broadcast recomputes it and returns it for the controller to check.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from areal_async.train.publish import iter_full_tensors
from areal_async.types import BroadcastResult, InitBroadcastRequest, WeightSpec

__all__ = ["WeightBroadcaster", "plan_buckets", "spec_bytes", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling SGLang's `dtypes` field uses."""
    return str(dtype).removeprefix("torch.")


def spec_bytes(spec: WeightSpec) -> int:
    """Bytes the tensors of one bucket occupy."""
    return sum(math.prod(shape) * getattr(torch, dt).itemsize for dt, shape in zip(spec.dtypes, spec.shapes))


def plan_buckets(model: nn.Module, *, skip: set[str], dtype: torch.dtype, bucket_bytes: int) -> list[WeightSpec]:
    """Group the state-dict entries, in order, into buckets of at most `bucket_bytes` (a bigger tensor is a
    bucket of its own). Local: reads only global shapes, no collective."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[WeightSpec] = []
    current = WeightSpec(names=[], dtypes=[], shapes=[])
    size = 0
    for name, value in model.state_dict().items():
        if name in skip:
            continue
        sent = dtype if value.is_floating_point() else value.dtype  # as iter_full_tensors sends it
        nbytes = value.numel() * sent.itemsize
        if current.names and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = WeightSpec(names=[], dtypes=[], shapes=[]), 0
        current.names.append(name)
        current.dtypes.append(dtype_name(sent))
        current.shapes.append(list(value.shape))
        size += nbytes
    if current.names:
        buckets.append(current)
    return buckets


class WeightBroadcaster:
    """Holds the weight-update groups this trainer rank created (rank 0 only) and sends the weights through them."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.devices: dict[str, torch.device] = {}

    def init_group(self, req: InitBroadcastRequest, device: torch.device) -> None:
        """Rank 0: host the store and join group `req.group_name` as rank 0 (blocks until the servers join).
        Other trainer ranks: nothing. Re-initialising a name replaces the old group."""
        if req.world_size < 2:
            raise ValueError(f"world_size must be >= 2 (the trainer plus at least one server rank), "
                             f"got {req.world_size}")
        if req.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {req.backend!r}")
        if req.backend == "nccl" and device.type != "cuda":
            raise ValueError("backend 'nccl' needs the trainer on CUDA; use 'gloo' on CPU")
        if dist.get_rank() != 0:
            return
        self.close(req.group_name)
        from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

        timeout = timedelta(seconds=self.timeout_s)
        # The store is created here rather than through a tcp:// rendezvous: under torchrun
        # (TORCHELASTIC_USE_AGENT_STORE) that rendezvous would make even rank 0 a client and nobody would host it.
        store = dist.TCPStore(host_name=req.master_address, port=req.master_port, world_size=req.world_size,
                              is_master=True, timeout=timeout, multi_tenant=True)
        # SGLang's server side prefixes the store with the group name; the keys must meet.
        store = PrefixStore(req.group_name, store)
        pg, _ = _new_process_group_helper(req.world_size, 0, [], req.backend, store, group_name=req.group_name,
                                          timeout=timeout)
        _world.pg_group_ranks[pg] = {i: i for i in range(req.world_size)}
        self.groups[req.group_name] = pg
        self.devices[req.group_name] = device if req.backend == "nccl" else torch.device("cpu")

    def broadcast(self, model: nn.Module, *, group_name: str, skip: set[str], dtype: torch.dtype,
                  bucket_bytes: int) -> BroadcastResult:
        """Collective among the trainers; rank 0 also broadcasts each full tensor to the group."""
        t0 = time.perf_counter()
        rank = dist.get_rank()
        pg = self.groups.get(group_name)
        missing = rank == 0 and pg is None
        from areal_async.train.engine import any_rank

        if any_rank(missing):
            raise RuntimeError(f"no weight-update group {group_name!r} on trainer rank 0: call init_broadcast first")
        buckets = plan_buckets(model, skip=skip, dtype=dtype, bucket_bytes=bucket_bytes)
        num_bytes = 0
        send_device = self.devices.get(group_name, torch.device("cpu"))
        for name, tensor in iter_full_tensors(model, skip=skip, dtype=dtype, to_cpu=send_device.type == "cpu"):
            if tensor is None:
                continue
            tensor = tensor.to(send_device)
            dist.broadcast(tensor, group=pg, group_src=0)
            num_bytes += tensor.numel() * tensor.element_size()
        return BroadcastResult(buckets=buckets, seconds=time.perf_counter() - t0, num_bytes=num_bytes)

    def close(self, group_name: str | None = None) -> None:
        """Leave one group (or all)."""
        names = [group_name] if group_name is not None else list(self.groups)
        for name in names:
            pg = self.groups.pop(name, None)
            self.devices.pop(name, None)
            if pg is not None:
                try:
                    dist.destroy_process_group(pg)
                except Exception:  # a group whose peers are gone may refuse a clean teardown
                    pass

"""One private c10d process group beside (or without) the default one: the weight-update group that trainer rank 0
forms with inference server ranks, the way SGLang's `init_custom_process_group` does, so that a trainer written for
SGLang and our servers meet on the same store keys.

Both ends use `new_custom_group`: the trainer (train/broadcast.py) as group rank 0, which hosts the TCPStore, and
every server rank (server/weights.py `init_custom_group`) as a client of that store. The store is wrapped in
`PrefixStore(group_name)` on both ends (SGLang's server side does so, the keys must meet).

Two things in torch's `_new_process_group_helper` (torch/distributed/distributed_c10d.py) decide whether this works:
- when the default group is bound to a device (`init_process_group(device_id=...)`, which the trainers use for
  eager NCCL init), the helper takes that group's NCCL communicator as `split_from` and creates the new
  communicator by `ncclCommSplit` of it, i.e. among the trainers, instead of a fresh one with the servers: with one
  trainer rank it returns at once while the servers wait, with more it blocks until the watchdog fires. The default
  group is unbound for the duration of the call and bound again afterwards.
- `_world.pg_group_ranks` must map group ranks to themselves, or `broadcast(src=0, group=pg)` translates src
  through the default world.

Also: an index-less CUDA device ("cuda", what "auto" resolves to without LOCAL_RANK) is taken as the thread's current
device, so `set_device` never receives a device without an index.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from areal_async.net.address import pin_gloo_interface

__all__ = [
    "new_custom_group",
    "open_store",
    "connect_store",
    "unbound_default_group",
    "concrete_device",
    "bind_cuda",
    "device_uuid",
]


def concrete_device(device: torch.device | str) -> torch.device:
    """`device` with an index: "cuda" becomes cuda:{current_device()}; CPU stays as it is."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def bind_cuda(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (the current device is per thread); no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(concrete_device(device))


def device_uuid(device: torch.device | str) -> str:
    """The physical identity of a CUDA device ("" for CPU): the same GPU gives the same string in every process,
    whatever CUDA_VISIBLE_DEVICES renumbered. Two members of one NCCL group on one GPU fail ("Duplicate GPU"),
    so the controller compares the trainer's and the servers' before it picks the broadcast's backend."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return ""
    try:
        return str(torch.cuda.get_device_properties(concrete_device(dev)).uuid)
    except (AttributeError, RuntimeError, AssertionError):  # an old torch, or no CUDA
        return ""


@contextlib.contextmanager
def unbound_default_group() -> Iterator[None]:
    """While inside, the default group (if any) has no bound device, so new groups are not split from it."""
    if not dist.is_initialized():
        yield
        return
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    bound = default.bound_device_id
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def open_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Host the group's rendezvous store (group rank 0). `port` 0 binds a free port (read it from `.port`): no
    bind-close-reuse race. Returns at once; the members meet in `new_custom_group`.

    The store is created here rather than through a tcp:// rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE)
    that rendezvous would make even rank 0 a client and nobody would host it."""
    return dist.TCPStore(
        host_name=host,
        port=port,
        world_size=world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=port != 0,
    )


def new_custom_group(
    backend: str,
    store: dist.Store,
    *,
    world_size: int,
    rank: int,
    group_name: str,
    device: torch.device | str,
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Create process group `group_name` of `world_size` ranks on `store` (already connected), as `rank`. Blocks
    until every rank has joined. Works whether or not this process has a default group."""
    from torch.distributed import distributed_c10d as c10d

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unsupported backend {backend!r}; use gloo (CPU) or nccl (CUDA)")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    dev = concrete_device(device)
    if backend == "nccl":
        if dev.type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
        torch.cuda.set_device(dev)
    if backend == "gloo":
        pin_gloo_interface()  # servers and trainer rank 0 on other hosts must reach this member's gloo address
    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(group_name, store)
    with unbound_default_group():
        pg, _ = c10d._new_process_group_helper(
            world_size, rank, [], backend, prefixed, group_name=group_name, timeout=timeout
        )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == rank, for broadcast(src=0)
    return pg


def connect_store(init_method: str, rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """A member's (rank > 0) connection to the store behind `init_method` ("tcp://host:port")."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    return store

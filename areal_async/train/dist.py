"""The trainers' process group and device: joining the world, agreeing on failures, small all-reduces.

Leaf of the trainer package (imports nothing of train/), so the engine, publishing, checkpoints and the broadcast
can all use `any_rank` / `agree` without importing each other.

Devices: "auto" is this rank's CUDA device (LOCAL_RANK) when CUDA is available, else the CPU. On CUDA the default
group is nccl for tensors plus gloo for CPU objects (DCP and barriers exchange CPU tensors), bound to the rank's
device (`device_id`: eager NCCL init, and the device barriers use). The weight-update group the broadcast forms
with inference servers must not be split from this group's communicator: areal_async/net/custom_group.py unbinds the
default group around its creation.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from areal_async.net.address import ADDRESS_ENV, host_address, pin_gloo_interface
from areal_async.train.errors import TrainerFailure, peer_error

__all__ = [
    "rank_device",
    "init_distributed",
    "any_rank",
    "agree",
    "all_reduce_floats",
    "bind_device",
    "host_address",
    "ADDRESS_ENV",
]


def rank_device(device: str = "auto") -> torch.device:
    """ "auto": this rank's CUDA device (LOCAL_RANK) when CUDA is available, else CPU. "cuda" without an index is
    this rank's device too, so a device string never leaves the index to whatever thread runs the code."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return dev


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> torch.device:
    """Join the default process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Without torchrun's variables this becomes a private world of one, so the engine also works in a plain process.
    """
    dev = rank_device(device)
    bind_device(dev)
    if not dist.is_initialized():
        pin_gloo_interface()  # a Debian-style host: gloo would bind 127.0.1.1, which other hosts cannot reach
        backend = "cuda:nccl,cpu:gloo" if dev.type == "cuda" else "gloo"
        kwargs: dict = {}
        if "RANK" not in os.environ:  # not under torchrun: a private world of one
            kwargs = dict(store=dist.HashStore(), rank=0, world_size=1)
        dist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=dev if dev.type == "cuda" else None,
            **kwargs,
        )
    return dev


def bind_device(device: torch.device) -> None:
    """The CUDA current device is per thread; RPC handlers run in a worker thread, so every entry point binds."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _reduce_device() -> torch.device:
    """Where a small all-reduce tensor must live: a pure nccl default group cannot reduce CPU tensors."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank (an all-reduce, so also a barrier). Used to turn one
    rank's failure into an error everywhere instead of a hang in the next collective."""
    if _world() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_reduce_device())
    dist.all_reduce(t)
    return bool(t.item())


def agree(error: TrainerFailure | None, kind: type[TrainerFailure], what: str) -> None:
    """Collective: raise on every rank when any rank has an `error`. The rank that found it raises it; the others
    raise the Peer* twin of `kind` (train/errors.py), so every rank's answer carries the kind of the failure."""
    failed = any_rank(error is not None)
    if error is not None:
        raise error
    if failed:
        raise peer_error(kind)(f"another trainer rank: {what} (see that rank's error)")


def all_reduce_floats(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    """All-reduce a few scalars in float64 (counts and sums that must be exact across ranks)."""
    if _world() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=_reduce_device())
    dist.all_reduce(t, op=op)
    return t.tolist()
